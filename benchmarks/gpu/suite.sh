#!/usr/bin/env bash
# The GPU suite in one device call (<= 10 minutes): the environment (_env.sh), then
# `python -m benchmarks.gpu.suite`, results under $OUT. Arguments pass through, e.g.
#   bash benchmarks/gpu/suite.sh --parts target_step,drafter_round,hybrid_step,embedded_bench,tests
# (docs/perf.md, "How to measure").
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m benchmarks.gpu.suite --out "$OUT" "$@"
