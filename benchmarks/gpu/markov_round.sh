#!/usr/bin/env bash
# The DSpark proposal's chain in one launch with one reduction a slot and the lm_head's bf16
# output read as it is (H200): the markov kernel alone (per TABLE_WARPS), the embedded round
# part by part, the CUDA tests that touch it, and the embedded pair's bench on both prompt sets.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout 60 python3 benchmarks/gpu/markov_chain.py --json $R/h200-markov-chain.json 2>&1 | tail -8; pack
timeout ${KTESTS_S:-60} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_markov.py tests/kernels/test_drafter_ops.py \
  > $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
engine_gpu_tests_append() { timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_step_width.py \
  tests/engine/test_spec.py tests/engine/test_draft.py >> $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt; }
engine_gpu_tests_append
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -6; pack
timeout 90 python3 benchmarks/gpu/embedded_round.py --arm dspark --arm dspark:adapt=0 --json $R/h200-embedded-round.json 2>&1 \
  | grep -v -i warn | tail -12; pack
pipeline_bench humaneval 1; pack
pipeline_bench stdlib 1; pack
