#!/usr/bin/env bash
# One device call (H200): the hybrid step benchmark with the modules' own tiles (floor, plain by
# steps and by round graphs, verify + rollback in both modes, exactness, transformers), the
# per-kernel profile of the hybrid step, and the CUDA kernel and gpu-marked hybrid tests.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${HYBRID_S:-240} python3 benchmarks/gpu/hybrid_step.py --json $R/h200-hybrid-step.json 2>&1 \
  | grep -v -i warn | cut -c1-900 | tail -32; pack
timeout ${PROFILE_S:-90} python3 benchmarks/gpu/step_profile.py --skip gdn,attention,8b --json $R/h200-step-profile.json 2>&1 \
  | grep -v -i warn | cut -c1-600; pack
timeout ${KTESTS_S:-170} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_deltanet.py \
  tests/kernels/test_qwen35.py tests/kernels/test_qwen3_5_step.py > $R/cuda_tests.txt 2>&1; echo "kernels rc=$?" >> $R/cuda_tests.txt
timeout ${GTESTS_S:-100} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py tests/engine/test_step_width.py \
  >> $R/cuda_tests.txt 2>&1; echo "gpu rc=$?" >> $R/cuda_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/cuda_tests.txt | tail -14; pack
