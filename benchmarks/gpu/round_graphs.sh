#!/usr/bin/env bash
# One device call (H200) for the rebuilt embedded pair with whole-round CUDA graphs:
#   1. the embedded bench, HumanEval and the stdlib set, all prompts x 128 tokens, the engine's
#      defaults (round graphs on), arms as in docs/bench.md, with plots;
#   2. every `gpu`-marked test (the round graphs' against the per-part graphs among them);
#   3. the same HumanEval bench with MEMRA_ROUND_GRAPHS=0 (the per-part graphs), for the A/B.
# Each part under its own cap; the results tar is rewritten after each part, so a call cut short
# still returns what finished (the device returns <= 8 files).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0"
summary() { python3 -c "import json;d=json.load(open('$1'));print(' exact',d['exact']);[print('  %-18s tau %-5s ms/tok %.3f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['ms_per_token'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -8; }
for set in humaneval stdlib; do
  s=$(date +%s)
  timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 $ARMS \
    --plot $R/h200-embedded-$set.png --json > $R/h200-embedded-$set.json 2> $R/bench-$set.err
  echo "$set rc=$? $(( $(date +%s) - s )) s"; summary $R/h200-embedded-$set.json
  tar czf "$OUT/results.tgz" -C $R .
done
timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests > $R/gpu_tests.txt 2>&1; echo "rc=$?" >> $R/gpu_tests.txt
tail -4 $R/gpu_tests.txt
tar czf "$OUT/results.tgz" -C $R .
s=$(date +%s)
MEMRA_ROUND_GRAPHS=0 timeout ${BENCH_S:-150} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS \
  --json > $R/h200-embedded-humaneval-parts.json 2> $R/bench-parts.err
echo "humaneval, MEMRA_ROUND_GRAPHS=0: rc=$? $(( $(date +%s) - s )) s"; summary $R/h200-embedded-humaneval-parts.json
tar czf "$OUT/results.tgz" -C $R .
ls -la "$OUT"
