#!/usr/bin/env bash
# One device call (H200): the hybrid step benchmark with the modules' own tiles (floor, plain by
# steps and by round graphs, verify + rollback in both modes, exactness, transformers), the
# per-kernel profile of the hybrid step, and the CUDA kernel and gpu-marked hybrid tests.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${HYBRID_S:-240} python3 benchmarks/gpu/hybrid_step.py --json $R/h200-hybrid-step.json 2>&1 \
  | grep -v -i warn | cut -c1-900 | tail -32; pack
hybrid_profile_and_tests
