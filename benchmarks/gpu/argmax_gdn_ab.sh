#!/usr/bin/env bash
# One H200 call after the split-row argmax (and, when .ab/deltanet_head.py holds the previous
# DeltaNet kernel module, the recurrence without in-loop layout conversions):
#   1. CUDA tests: argmax, PDL chain, DeltaNet / Qwen3.5 step kernels, gpu-marked engine tests;
#   2. drafter_round.py --profile with PDL on, then its profile with PDL off (kernel times
#      without the early-launch waits);
#   3. hybrid_step.py (Qwen3.5-4B shape): the shipped kernels, then (A/B) the previous DeltaNet
#      module swapped in, in a second process.
#   bash benchmarks/gpu/argmax_gdn_ab.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
timeout ${KTESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_argmax.py tests/kernels/test_pdl.py \
  tests/kernels/test_deltanet.py tests/kernels/test_qwen3_5_step.py > $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
timeout ${GTESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py tests/engine/test_step_width.py \
  tests/engine/test_spec.py >> $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
timeout ${ROUND_S:-150} python3 benchmarks/gpu/drafter_round.py --profile --reps 20 --budget-s 60 \
  --json $R/h200-drafter-round.json 2>&1 | grep -v -i warn | grep -v "^  q[48]_0 \[" | tail -60; pack
MEMRA_PDL=0 timeout ${ROUND_S:-150} python3 benchmarks/gpu/drafter_round.py --profile --reps 20 --budget-s 0 \
  --json $R/h200-drafter-round-nopdl.json 2>&1 | grep -v -i warn | grep -E "profile|us  x|propose" | head -50; pack
hybrid() {  # $1: json name
  timeout ${HYBRID_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers --json $R/$1 2>&1 | grep -v -i warn \
    | sed -n '/^{/,$p' | tail -40; pack
}
hybrid h200-hybrid-step.json
if [ -f .ab/deltanet_head.py ]; then
  cp kernels/deltanet.py /tmp/deltanet_new.py && cp .ab/deltanet_head.py kernels/deltanet.py
  echo "--- previous DeltaNet kernel"; hybrid h200-hybrid-step-gdn-before.json
  cp /tmp/deltanet_new.py kernels/deltanet.py
fi
# The embedded pair's DFlash arm with the whole block verified (adapt=0) beside its default
# (the ladder: no accept-rate head), HumanEval, every prompt.
s=$(date +%s); json=$R/h200-humaneval-dflash-adapt0.json
timeout ${BENCH_S:-100} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 \
  --arm off --arm plain --arm dflash --arm dflash:adapt=0 --arm dspark --json > $json 2> ${json%.json}.err
echo "bench rc=$? $(( $(date +%s) - s )) s"
python3 -c "import json;d=json.load(open('$json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -8; pack
