#!/usr/bin/env bash
# One device call (H200): the step kernels' CUDA tests, per-kernel step profiles (8B, hybrid) with the DeltaNet tile sweep, and the hybrid step
# benchmark (floor, plain, verify + rollback in both modes, exactness, transformers).
# Each part under its own cap; the results tar is rewritten after each part (<= 8 files return).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${KTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_deltanet.py \
    tests/kernels/test_qwen3_5_step.py $(ls tests/kernels/test_qwen35*.py 2>/dev/null) tests/kernels/test_norm.py \
    tests/kernels/test_rope.py > $R/cuda_kernel_tests.txt 2>&1; echo "kernels rc=$?" >> $R/cuda_kernel_tests.txt
  timeout ${GTESTS_S:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py tests/engine/test_step_width.py \
    >> $R/cuda_kernel_tests.txt 2>&1; echo "gpu rc=$?" >> $R/cuda_kernel_tests.txt
  grep -E "passed|failed|FAILED|rc=" $R/cuda_kernel_tests.txt | tail -12; pack
fi
timeout ${PROFILE_S:-150} python3 benchmarks/gpu/step_profile.py --skip attention --json $R/h200-step-profile.json 2>&1 \
  | grep -v -i warn | cut -c1-1500; pack
timeout ${HYBRID_S:-200} python3 benchmarks/gpu/hybrid_step.py --json $R/h200-hybrid-step.json 2>&1 | grep -v -i warn | cut -c1-800 | tail -20; pack
ls -la "$OUT"
