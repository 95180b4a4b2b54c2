#!/usr/bin/env bash
# One device call: the GPU-marked tests, the Qwen3-8B-shape step modes (torch step ops: the
# comparison with earlier numbers), and the target step against its floor with the Triton step ops.
set -o pipefail
# memra is not pip-installed there: put the checkout on the path, and kernels/ under its import name
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/session_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests -x 2>&1 | tail -12 | tee "$OUT/gpu_tests.txt"
MEMRA_KERNELS=0 timeout ${SHAPES_S:-150} python3 benchmarks/gpu_shapes.py --tokens ${SHAPE_TOKENS:-96} --prompts 3 --widths ${SHAPE_WIDTHS:-16G,16g} --json "$OUT/shapes_8b_steps.json" 2>&1 | grep "step mode\|GATE\|rror" | cut -c1-600 | tee "$OUT/shapes.txt"
[ "${KSHAPES_S:-90}" != 0 ] && timeout ${KSHAPES_S:-90} python3 benchmarks/gpu_shapes.py --kernels --tokens 96 --prompts 3 --widths 16G --json "$OUT/shapes_8b_kernels.json" 2>&1 | grep "step mode\|GATE\|rror" | cut -c1-600 | tee "$OUT/shapes_kernels.txt"
timeout ${STEP_S:-220} python3 benchmarks/gpu/target_step.py ${STEP_ARGS:-} --json "$OUT/h200-target-step.json" 2>&1 | tail -30 | tee "$OUT/target_step.txt"
