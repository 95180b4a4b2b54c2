#!/usr/bin/env bash
# One device call (H200): rounds queued one ahead of the host's read (MEMRA_PIPELINE, default on)
# against rounds read one by one, in the same call:
#   1. the gpu-marked engine tests (real graphs and pinned reads; the hybrid's graphed restores);
#   2. the embedded pair's HumanEval bench (164 x 128, greedy, bf16, every arm) with the default
#      and with MEMRA_PIPELINE=0, alone on the GPU one after the other;
#   3. where a plain token goes on the embedded target (embedded_plain.py: pipelined and not);
#   4. the hybrid step benchmark (hybrid_step.py, no transformers): plain decode pipelined and
#      not, beside the floor, verify + rollback, exactness.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
engine_gpu_tests
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack

pipeline_bench humaneval 1
pipeline_bench humaneval 0

timeout ${PLAIN_S:-100} python3 benchmarks/gpu/embedded_plain.py --json $R/h200-embedded-plain.json 2>&1 | tail -4; pack

timeout ${HYBRID_S:-200} python3 benchmarks/gpu/hybrid_step.py --skip-transformers --json $R/h200-hybrid-step.json 2>&1 \
  | grep -v -i warn | cut -c1-900 | tail -24; pack
