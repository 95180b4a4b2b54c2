#!/usr/bin/env bash
# The drafter's round and the hybrid target with the SwiGLU epilogue shipped (dense_linear glu=True
# behind the swiglu step op): drafter_round.py (bf16 / q8 / q4 draft + ingest, the round against
# plain decoding, exactness, the profile) and hybrid_step.py (plain decode, verify + rollback).
#   bash benchmarks/gpu/glu_round.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
timeout ${ROUND_S:-200} python3 benchmarks/gpu/drafter_round.py --reps 20 --profile --budget-s 60 \
  --json $R/h200-drafter-round.json 2>&1 | grep -v -i warn | grep -v "^  q[48]_0 \[" | grep -v "^    " | tail -22; pack
timeout ${HYB_S:-170} python3 benchmarks/gpu/hybrid_step.py --skip-transformers \
  --json $R/h200-hybrid-step.json 2>&1 | grep -v -i warn | tail -3
python3 -c "
import json;d=json.load(open('$R/h200-hybrid-step.json'));s=d.get('summary',{})
print(json.dumps({k:v for k,v in s.items() if not isinstance(v,(dict,list))})[:1200])" 2>&1 | tail -3; pack
