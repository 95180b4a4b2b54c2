#!/usr/bin/env bash
# One device call (H200) for what the 2026-12-03 session built but could not measure:
#   1. where a plain token of the embedded target goes with whole-round graphs
#      (benchmarks/gpu/embedded_plain.py: replay, run with its read, whole sessions, decode only);
#   2. the sampled exactness sweep and the T = 1 bench on the rebuilt pair (docs/bench.md says
#      they last ran on the previous pair);
#   3. the drafter round at the 8B shape (benchmarks/gpu/drafter_round.py).
# Each part under its own cap; the results tar is rewritten after each part (<= 8 files return).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${PLAIN_S:-120} python3 benchmarks/gpu/embedded_plain.py --json $R/h200-embedded-plain.json 2>&1 | tail -6; pack
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder"
for t in 0.3 1.0; do for p in 1.0 0.9; do
  timeout ${SWEEP_S:-60} python3 -m memra_cli bench --prompts humaneval --n 20 --max-new 64 --warmup 1 $ARMS \
    --temperature $t --top-p $p --seed 1 --json > $R/sweep-t$t-p$p.json 2> $R/sweep-t$t-p$p.err
  echo "T=$t top-p=$p rc=$? $(python3 -c "import json;d=json.load(open('$R/sweep-t$t-p$p.json'));print('exact',d['exact'],[(a['name'],a['exact'],round(a['tau'],2)) for a in d['arms']])" 2>&1 | tail -1)"
done; done; pack
timeout ${T1_S:-150} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS --temperature 1.0 --seed 1 \
  --plot $R/h200-humaneval-t1.png --json > $R/h200-humaneval-t1.json 2> $R/h200-humaneval-t1.err
python3 -c "import json;d=json.load(open('$R/h200-humaneval-t1.json'));print('T=1 exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -7; pack
timeout ${ROUND_S:-130} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 50 --json $R/h200-drafter-round.json 2>&1 \
  | grep -v Warning | tail -12; pack
ls -la "$OUT"
