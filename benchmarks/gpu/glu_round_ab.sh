#!/usr/bin/env bash
# The drafter's round with and without the SwiGLU epilogue, back to back on one machine (two
# processes), with the time budget that lets the q8_0 / q4_0 kernel-bandwidth section run.
#   bash benchmarks/gpu/glu_round_ab.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
if [ -n "${QTESTS:-}" ]; then  # the quantized kernels' glu tests and the drafter's ops on CUDA first
  timeout ${QTESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_linear.py \
    tests/kernels/test_drafter_ops.py > $R/gpu_tests.txt 2>&1; echo "tests rc=$?" >> $R/gpu_tests.txt
  grep -E "passed|failed|FAILED|rc=" $R/gpu_tests.txt | tail -4; pack
fi
for run in on off; do
  flag=""; [ $run = off ] && flag="--no-glu"
  timeout ${ROUND_S:-150} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 110 $flag \
    --json $R/h200-drafter-round-glu-$run.json > $R/round-$run.log 2>&1
  echo "$run rc=$?"; grep -E "^  (bf16|q8|q4) |round/plain|worst frac|exact:" $R/round-$run.log | head -8; pack
done
