#!/usr/bin/env bash
# The shipped configuration (growing splits in the kernel, off in the head_dim-128 tile): the
# gpu-marked engine tests and target_step.py's timing with the exactness sweep at 512 and 4096.
source benchmarks/gpu/_env.sh
nvidia-smi -L
TESTS_S=120 engine_gpu_tests; grep -E "passed|failed|rc=" $R/gpu_tests.txt | tail -4; pack
timeout 330 python3 benchmarks/gpu/target_step.py --sweep-lengths 512,4096 --sweep-prompts 20 --sweep-tokens 256 \
  --json $R/h200-target-step.json 2>&1 | grep -E "^triton|^sweep|prefill"; pack
