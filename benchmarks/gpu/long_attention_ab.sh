#!/usr/bin/env bash
# One device call after the growing splits landed: the gpu-marked engine tests, then the target
# step timed with the old one-size tile (256 keys) and with the module's (growing splits), one
# process each, back to back on one machine (timing only: a one-prompt sweep, no prefill).
source benchmarks/gpu/_env.sh
nvidia-smi -L
TESTS_S=210 engine_gpu_tests; grep -E "passed|failed|rc=" $R/gpu_tests.txt | tail -4; pack
for arm in base module; do
  [ $arm = base ] && T="--attn-tile 256,32,64,3,4" || T=""
  timeout 150 python3 benchmarks/gpu/target_step.py $T --sweep-lengths 512 --sweep-prompts 1 --sweep-tokens 32 \
    --prefill-length 0 --json $R/h200-target-step-$arm.json 2>&1 | grep -E "^triton|sweep exact"; pack
done
