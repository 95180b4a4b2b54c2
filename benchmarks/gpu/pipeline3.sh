#!/usr/bin/env bash
# Third device call of the pipelining work (H200): after the settle kernel (a chained round's
# settlement in one launch): the gpu-marked engine tests and the CUDA kernel tests of the
# settlement and the step ops, then the embedded pair's HumanEval bench with MEMRA_PIPELINE=1
# and =0 one after the other (164 x 128, greedy, bf16, every arm), and the stdlib set pipelined.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
engine_gpu_tests
timeout ${KTESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_settle.py tests/kernels/test_step_ops.py \
  >> $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
pipeline_bench humaneval 1
pipeline_bench humaneval 0
pipeline_bench stdlib 1
