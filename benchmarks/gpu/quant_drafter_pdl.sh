#!/usr/bin/env bash
# One H200 call after quantized drafters' graphs moved to plain launch order (no PDL):
#   1. the gpu-marked engine tests (graphed drafter rounds, exactness) and the PDL / argmax kernels';
#   2. drafter_round.py (8B shape; bf16 / q8 / q4 drafter side of a round, round, exactness);
#   3. the embedded pair's HumanEval bench with bf16, q8 and q4 drafters side by side (tau and
#      speed from quantizing, every stream checked against off).
#   bash benchmarks/gpu/quant_drafter_pdl.sh        (results.tgz under $OUT; ROUND=0 skips 2.)
set -o pipefail
source benchmarks/gpu/_env.sh
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl.py tests/kernels/test_argmax.py \
  tests/kernels/test_quant_linear.py > $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
timeout ${GTESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine >> $R/gpu_tests.txt 2>&1
echo "gpu rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
if [ "${ROUND:-1}" = 1 ]; then
  timeout ${ROUND_S:-150} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 0 \
    --json $R/h200-drafter-round.json 2>&1 | grep -v -i warn | grep -v "^  q[48]_0 \[" | tail -14; pack
fi
s=$(date +%s); json=$R/h200-humaneval-quantized-drafters.json
timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 --arm off --arm plain \
  --arm dspark --arm dspark:prec=q8 --arm dspark:prec=q4 --arm dflash --arm dflash:prec=q8 --arm dflash:prec=q4 \
  --json > $json 2> ${json%.json}.err
echo "bench rc=$? $(( $(date +%s) - s )) s"
python3 -c "import json;d=json.load(open('$json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],3),round(a['ms_per_token'],4),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -10
tail -2 ${json%.json}.err | cut -c1-300; pack
