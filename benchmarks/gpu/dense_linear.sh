#!/usr/bin/env bash
# One H200 call for the few-row dense kernel (memra_kernels.dense_linear):
#   1. its kernel tests on the GPU;
#   2. dense_linear_sweep.py: cuBLAS vs the kernel's tiles on the 8B target's and drafter's shapes
#      (SHAPES=8b,drafter,hybrid to add the Qwen3.5-4B ones), writing a TUNED table;
#   3. target_step.py with that table: the shipped Triton ops vs the same ops with every weight
#      matmul on cuBLAS, in one process, contexts 512 / 4k / 32k, a short exactness sweep;
#   4. drafter_round.py with the table and --dense-ab (bf16 / q8 / q4 drafter side, round, exactness,
#      and the cuBLAS side in the same process).
#   bash benchmarks/gpu/dense_linear.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_linear.py > $R/gpu_tests.txt 2>&1
echo "kernels rc=$?" >> $R/gpu_tests.txt; tail -3 $R/gpu_tests.txt
timeout ${SWEEP_S:-240} python3 benchmarks/gpu/dense_linear_sweep.py --shapes ${SHAPES:-8b,drafter} --budget-s ${SWEEP_BUDGET:-200} \
  --json $R/h200-dense-linear.json --tuned $R/dense_tuned.json 2>&1 | grep -v -i warn | tail -24; pack
TUNED=${TUNED_FILE:-$R/dense_tuned.json}
timeout ${STEP_S:-170} python3 benchmarks/gpu/target_step.py --variants triton,triton-cublas --dense-tuned $TUNED \
  --sweep-lengths 512 --sweep-prompts 3 --sweep-tokens 64 --prefill-length 0 \
  --json $R/h200-target-step-dense.json 2>&1 | grep -v -i warn | tail -12; pack
if [ "${ROUND:-1}" = 1 ]; then
  timeout ${ROUND_S:-150} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 0 --dense-tuned $TUNED --dense-ab \
    --json $R/h200-drafter-round-dense.json 2>&1 | grep -v -i warn | grep -v "^  q[48]_0 \[" | tail -16; pack
fi
