#!/usr/bin/env bash
# On the lent H200: fixed-width target steps (bf16 speculative == plain greedy) and CUDA graphs.
# SHAPE_WIDTHS / BENCH_MODES pick a subset of the modes (e.g. SHAPE_WIDTHS=16g BENCH_MODES="16 --cuda-graphs").
#   1. the GPU-marked tests (incl. the bit-identity of a token's logits across step groupings);
#   2. the Qwen3-8B shape, bf16: plain ms/token, round ms, exactness over 3 prompts, with 16-row
#      steps as CUDA graphs, 16-row steps eager, and variable widths (benchmarks/gpu_shapes.py);
#   3. `memra bench` on the embedded pair in bf16 in the same three modes.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; fi
OUT=${OUT:-/tmp/steps_out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 benchmarks/gpu_shapes.py --tokens 96 --prompts 3 --widths ${SHAPE_WIDTHS:-16G,16g,16,variable} --json "$OUT/shapes_8b_steps.json" 2>&1 | grep "step mode\|GATE\|Error" | cut -c1-400
IFS=';' read -ra MODES <<< "${BENCH_MODES:-16 --cuda-graphs;16 --no-cuda-graphs;variable --no-cuda-graphs}"
for mode in "${MODES[@]}"; do
  set -- $mode; tag=w$1$([ "$2" = "--cuda-graphs" ] && echo g)
  timeout ${BENCH_S:-110} python3 -m memra_cli bench --n ${BENCH_N:-24} --max-new 128 --no-phase-times --dtype bfloat16 --step-width $1 $2 \
    --arm off --arm dflash --arm dspark --arm dspark:vt=ladder --json > "$OUT/bench_bf16_$tag.json" 2> "$OUT/bench_bf16_$tag.err"
  echo "bench $tag rc=$?"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('  exact', d['exact'], 'mismatches', len(d['mismatches']))
for a in d['arms']:
    print(f\"  {a['name']:18s} tau {a['tau']:.2f}  tok/s {a['tok_per_s']:.1f}  ms/tok {a['ms_per_token']:.2f}  speedup {a['speedup']:.2f}  exact {a['exact']}\")
" "$OUT/bench_bf16_$tag.json" 2>&1 | tail -8
done
