#!/usr/bin/env bash
# The SwiGLU fusion (dense_linear glu=True behind the swiglu step op), measured:
#   the kernel tests on CUDA (dense_linear with glu, activation, PDL, step ops, drafter ops);
#   target_step.py with the fusion and without it in one process (512 / 4k / 32k), then the
#   exactness sweep (20 prompts x 256 tokens at 512 and 4k) with the shipped ops.
#   bash benchmarks/gpu/glu_step.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
timeout ${KTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_linear.py tests/kernels/test_activation.py \
  tests/kernels/test_pdl.py tests/kernels/test_step_ops.py tests/kernels/test_drafter_ops.py > $R/gpu_tests.txt 2>&1
echo "kernels rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -8; pack
timeout ${STEP_S:-330} python3 benchmarks/gpu/target_step.py --variants ${VARIANTS:-triton,triton-noglu} \
  --sweep-lengths ${LENGTHS:-512,4096} --sweep-prompts ${PROMPTS:-20} --sweep-tokens 256 --prefill-length 0 \
  --json $R/h200-target-step.json 2>&1 | grep -v -i warn | grep -E "ctx|exact|sweep|speedup" | tail -16; pack
