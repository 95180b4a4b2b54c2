#!/usr/bin/env bash
# One H200 call: the dense kernel on the hybrid's shapes, and early launch with L2 weight prefetch.
#   1. dense_linear_sweep.py on the Qwen3.5-4B shapes (a TUNED table for them);
#   2. target_step.py: the shipped table with plain launches, PDL_PREFETCH 2 and 4, the same with every
#      swept shape on the kernel ("-all"), and cuBLAS only, one process;
#   3. hybrid_step.py with the 8B + hybrid tables, and with cuBLAS only (two processes).
#   bash benchmarks/gpu/dense_prefetch.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
[ "${SWEEP:-1}" = 1 ] && timeout ${SWEEP_S:-150} python3 benchmarks/gpu/dense_linear_sweep.py --shapes hybrid --budget-s 120 \
  --json $R/h200-dense-linear-hybrid.json --tuned $R/dense_tuned_hybrid.json 2>&1 | grep -v -i warn | tail -12; pack
python3 -c "
import json,os
from memra_kernels import dense_linear as dl
t={f'{n}x{k}': vars(c) for (n,k),c in dl.TUNED.items()}
if os.path.exists('$R/dense_tuned_hybrid.json'): t.update(json.load(open('$R/dense_tuned_hybrid.json')))
json.dump(t, open('$R/dense_tuned_merged.json','w'), indent=1)
print('merged table:', sorted(t))"
timeout ${STEP_S:-240} python3 benchmarks/gpu/target_step.py --dense-all docs/results/h200-dense-linear.json \
  --variants ${VARIANTS:-triton,triton-pf2,triton-pf4,triton-all,triton-pf2-all,triton-cublas} \
  --contexts ${CONTEXTS:-512,32768} --sweep-lengths 512 --sweep-prompts 2 --sweep-tokens 48 --prefill-length 0 \
  --json $R/h200-target-step-prefetch.json 2>&1 | grep -v -i warn | grep -E "ctx|exact|floor" | tail -24; pack
[ "${HYBRID:-1}" = 1 ] || exit 0
for v in ${HYB_VARIANTS:-merged none}; do
  t=$R/dense_tuned_merged.json; pf=""
  [ $v = none ] && t=none; [ $v = merged-pf2 ] && pf="--dense-prefetch 2"
  timeout ${HYB_S:-200} python3 benchmarks/gpu/hybrid_step.py --skip-transformers --dense-tuned $t $pf \
    --json $R/h200-hybrid-step-dense-$v.json 2>&1 | grep -v -i warn | tail -4
  python3 -c "
import json;d=json.load(open('$R/h200-hybrid-step-dense-$v.json'));s=d.get('summary',{})
print('$v', json.dumps({k:v for k,v in s.items() if not isinstance(v,(dict,list))})[:900])" 2>&1 | tail -2; pack
done
