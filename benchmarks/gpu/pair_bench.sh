#!/usr/bin/env bash
# On the lent H200: the shipped embedded pair's bench, every arm, on each prompt set (with the
# plot), then the quantized drafters' arms on HumanEval (what q8_0 / q4_0 cost in tau).
#   bash benchmarks/gpu/pair_bench.sh            # SETS="humaneval stdlib" QUANT=1 BENCH_S=150
set -o pipefail
source benchmarks/gpu/_env.sh
show() { python3 -c "import json;d=json.load(open('$1'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -12; }
for set in ${SETS:-humaneval stdlib}; do
  s=$(date +%s); json=$R/h200-pair-$set.json
  timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 \
    --arm off --arm plain --arm dflash --arm dflash:adapt=0 --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0 \
    --plot ${json%.json}.png --json > $json 2> ${json%.json}.err
  echo "bench $set rc=$? $(( $(date +%s) - s )) s"; show $json; tail -n 2 ${json%.json}.err | cut -c1-300; pack
done
if [ "${QUANT:-1}" = 1 ]; then
  s=$(date +%s); json=$R/h200-pair-humaneval-quantized.json
  timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 \
    --arm off --arm plain --arm dspark --arm dspark:prec=q8 --arm dspark:prec=q4 \
    --arm dflash --arm dflash:prec=q8 --arm dflash:prec=q4 --json > $json 2> ${json%.json}.err
  echo "bench quantized rc=$? $(( $(date +%s) - s )) s"; show $json; tail -n 2 ${json%.json}.err | cut -c1-300; pack
fi
