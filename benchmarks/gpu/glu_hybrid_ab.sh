#!/usr/bin/env bash
# The hybrid step with and without the SwiGLU epilogue, back to back (two processes, twice:
# on, off, on, off), to tell the fusion from the machine.
#   bash benchmarks/gpu/glu_hybrid_ab.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
for run in on1 off1 on2 off2; do
  flag=""; [ "${run:0:3}" = off ] && flag="--no-glu"
  timeout ${HYB_S:-100} python3 benchmarks/gpu/hybrid_step.py --skip-transformers $flag \
    --json $R/h200-hybrid-step-glu-$run.json > $R/hybrid-$run.log 2>&1
  python3 -c "
import json;s=json.load(open('$R/h200-hybrid-step-glu-$run.json'))['summary']
print('$run', {k: round(s[k], 3) for k in ('memra_plain_token_ms_w1','memra_plain_token_ms_w16','plain_over_floor','verify16_round_ms_k8','verify16_round_over_plain')}, s['exact'])" 2>&1 | tail -1; pack
done
