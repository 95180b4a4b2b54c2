#!/usr/bin/env bash
# On the lent H200, the call after `build_assets.sh retrain` (warm machine: build-work/assets is
# still there): the retrained pair beside the shipped one in one bench run per prompt set, so the
# two pairs' ratios come from the same process, same target, same plain baseline.
#   bash benchmarks/gpu/retrain_compare.sh [SET...]   # prompt sets, default humaneval stdlib
# (With a cold machine, carry the new assets as build-work/assets.)
set -o pipefail
source benchmarks/gpu/_env.sh
NEW=build-work/assets
[ -f $NEW/dspark/config.json ] || { echo "error: $NEW/dspark/config.json: no retrained pair here (cold machine? carry it)"; exit 2; }
for set in ${@:-humaneval stdlib}; do
  s=$(date +%s); json=$R/h200-retrain-$set.json
  timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 \
    --arm off --arm plain --arm dflash --arm dspark --arm dspark:adapt=0 \
    --arm dflash:draft=$NEW/dflash --arm dspark:draft=$NEW/dspark --arm dspark:draft=$NEW/dspark,adapt=0 \
    --json > $json 2> ${json%.json}.err
  echo "bench $set rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -10
  tail -2 ${json%.json}.err | cut -c1-300; pack
done
cp $NEW/build_info.json $R/; pack
