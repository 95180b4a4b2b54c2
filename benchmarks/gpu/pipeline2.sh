#!/usr/bin/env bash
# Second device call of the pipelining work (H200): pipeline.sh's gpu-marked tests and embedded
# benches again after the chained round's fix (its first call: the capture refused a host read),
# without the hybrid step benchmark (measured in that first call).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
engine_gpu_tests
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
pipeline_bench humaneval 1
pipeline_bench humaneval 0
timeout ${PLAIN_S:-120} python3 benchmarks/gpu/embedded_plain.py --json $R/h200-embedded-plain.json 2>&1 | tail -3; pack
