#!/usr/bin/env bash
# The dense kernel shipped (every engine shape on it, early launch with a 2-tile L2 prefetch):
#   PART=a  the kernel tests and the gpu-marked engine tests; target_step.py in full (Triton ops with
#           the kernel, and with cuBLAS, one process; 512 / 4k / 32k; 20 prompts x 256 tokens at 512
#           and 4k; the 32k prefill);
#   PART=b  drafter_round.py with --dense-ab and --profile; hybrid_step.py with the kernel and with
#           cuBLAS only (two processes).
#   PART=a bash benchmarks/gpu/dense_final.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
if [ "${PART:-a}" = a ]; then
  timeout ${KTESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_linear.py tests/kernels/test_pdl.py \
    tests/kernels/test_step_ops.py tests/kernels/test_drafter_ops.py > $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
  timeout ${GTESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine >> $R/gpu_tests.txt 2>&1
  echo "gpu rc=$?" >> $R/gpu_tests.txt
  grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
  timeout ${STEP_S:-300} python3 benchmarks/gpu/target_step.py --variants triton,triton-cublas \
    --sweep-lengths ${LENGTHS:-512,4096} --sweep-prompts ${PROMPTS:-20} --sweep-tokens 256 \
    --json $R/h200-target-step.json 2>&1 | grep -v -i warn | grep -E "ctx|exact|prefill|sweep" | tail -16; pack
else
  timeout ${ROUND_S:-170} python3 benchmarks/gpu/drafter_round.py --reps 20 --dense-ab --profile --budget-s 60 \
    --json $R/h200-drafter-round.json 2>&1 | grep -v -i warn | grep -v "^  q[48]_0 \[" | grep -v "^    " | tail -22; pack
  for v in shipped none; do
    t=""; [ $v = none ] && t="--dense-tuned none"
    timeout ${HYB_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers $t \
      --json $R/h200-hybrid-step-dense-$v.json 2>&1 | grep -v -i warn | tail -2
    python3 -c "
import json;d=json.load(open('$R/h200-hybrid-step-dense-$v.json'));s=d.get('summary',{})
print('$v', json.dumps({k:v for k,v in s.items() if not isinstance(v,(dict,list))})[:900])" 2>&1 | tail -2; pack
  done
fi
