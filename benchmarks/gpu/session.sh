#!/usr/bin/env bash
# One device call: the GPU-marked tests, the Qwen3-8B-shape step modes (graphed target, graphed
# and eager drafter), and the kernel checks/timings. Results land in $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; fi
OUT=${OUT:-/tmp/session_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 170 python3 benchmarks/gpu_shapes.py --tokens 96 --prompts 3 --widths ${SHAPE_WIDTHS:-16G,16g} --json "$OUT/shapes_8b_steps.json" 2>&1 | grep "step mode\|GATE\|Error\|rror" | cut -c1-400 | tee "$OUT/shapes.txt"
for k in kernels_target kernels_quant; do
  [ -f benchmarks/gpu/$k.py ] && timeout 110 python3 benchmarks/gpu/$k.py 2>&1 | tail -40 | tee "$OUT/$k.txt"
done
