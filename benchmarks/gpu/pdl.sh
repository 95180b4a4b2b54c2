#!/usr/bin/env bash
# Programmatic dependent launch (kernels/_pdl.py), measured on the H200 against plain launches.
#   bash benchmarks/gpu/pdl.sh steps   # tests, the 8B step (PDL on and off in one process, with
#                                      # the exactness sweep), the hybrid step on then off
#   bash benchmarks/gpu/pdl.sh rounds  # the embedded pair's bench with PDL on then off, the
#                                      # drafter round on then off
#   bash benchmarks/gpu/pdl.sh final   # after quant_linear went back to plain order: the drafter
#                                      # round, the hybrid step, the stdlib bench, PDL on
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
kernel_tests() {  # the PDL chain test and the kernels it chains, on the GPU
  timeout ${KTESTS_S:-60} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl.py tests/kernels/test_argmax.py \
    tests/kernels/test_norm.py tests/kernels/test_activation.py >> $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
}
case "$1" in
steps)
  TESTS_S=170 engine_gpu_tests
  kernel_tests
  grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
  timeout ${STEP_S:-260} python3 benchmarks/gpu/target_step.py --sweep-lengths 512,4096 --sweep-prompts 20 --sweep-tokens 256 \
    --json $R/h200-target-step.json 2>&1 | grep -E "^triton|^torch|^sweep|prefill|rc="; pack
  for flag in "" --no-pdl; do
    timeout ${HYBRID_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers $flag \
      --json $R/h200-hybrid-step${flag:+-nopdl}.json 2>&1 | grep -v -i warn | cut -c1-300 | tail -16; pack
  done ;;
rounds)
  kernel_tests; grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -4; pack
  for pdl in 1 0; do
    MEMRA_PDL=$pdl pipeline_bench humaneval 1; mv $R/h200-humaneval-pipeline1.json $R/h200-humaneval-pdl$pdl.json
    mv $R/h200-humaneval-pipeline1.err $R/h200-humaneval-pdl$pdl.err; pack
  done
  for pdl in 1 0; do
    MEMRA_PDL=$pdl timeout ${ROUND_S:-100} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 60 \
      --json $R/h200-drafter-round-pdl$pdl.json 2>&1 | tail -3; pack
  done ;;
final)
  timeout ${ROUND_S:-100} python3 benchmarks/gpu/drafter_round.py --reps 20 --budget-s 60 \
    --json $R/h200-drafter-round.json 2>&1 | tail -3; pack
  timeout ${HYBRID_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers \
    --json $R/h200-hybrid-step.json 2>&1 | grep -v -i warn | cut -c1-300 | tail -16; pack
  pipeline_bench stdlib 1; mv $R/h200-stdlib-pipeline1.json $R/h200-stdlib-pdl1.json; pack
  pipeline_bench humaneval 1; mv $R/h200-humaneval-pipeline1.json $R/h200-humaneval-pdl1-run2.json; pack ;;
esac
