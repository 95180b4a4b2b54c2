#!/usr/bin/env bash
# One device call (H200), the session's measurements:
#   1. every `gpu`-marked test, and tests/kernels on CUDA;
#   2. the embedded bench, HumanEval and the stdlib set, all prompts x 128 tokens, engine
#      defaults, arms as in docs/bench.md, with plots;
#   3. the embedded round split into parts (embedded_round.py), DSpark and DFlash;
#   4. the drafter round at the Qwen3-8B shape (drafter_round.py: bf16 / q8 / q4, quant kernels).
# Each part under its own cap; the results tar is rewritten after each part (<= 8 files return).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TESTS_S:-170} python3 -m pytest -q -m gpu -p no:cacheprovider tests > $R/gpu_tests.txt 2>&1; echo "rc=$?" >> $R/gpu_tests.txt
  # the kernel tests run on CUDA whenever there is a GPU, but are not `gpu`-marked: run them too
  timeout ${KTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels >> $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
  grep -E "passed|failed|FAILED|Error" $R/gpu_tests.txt | tail -8; pack
fi
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0"
summary() { python3 -c "import json;d=json.load(open('$1'));print(' exact',d['exact'],'graph_warmup',d.get('graph_warmup'));[print('  %-18s tau %-5s ms/tok %.4f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['ms_per_token'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -8; }
for set in ${SETS:-humaneval stdlib}; do
  s=$(date +%s)
  timeout ${BENCH_S:-120} python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 $ARMS \
    --plot $R/h200-embedded-$set.png --json > $R/h200-embedded-$set.json 2> $R/bench-$set.err
  echo "$set rc=$? $(( $(date +%s) - s )) s"; summary $R/h200-embedded-$set.json; pack
done
if [ "${ROUND:-1}" = 1 ]; then
  timeout ${ROUND_S:-90} python3 benchmarks/gpu/embedded_round.py --json $R/h200-embedded-round.json 2>&1 | grep -v -i warn | tail -12; pack
fi
if [ "${DRAFTER:-1}" = 1 ]; then
  timeout ${DRAFTER_S:-150} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 60 --json $R/h200-drafter-round.json 2>&1 \
    | grep -v Warning | tail -14; pack
fi
ls -la "$OUT"
