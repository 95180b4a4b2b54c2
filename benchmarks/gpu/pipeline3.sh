#!/usr/bin/env bash
# Third device call of the pipelining work (H200): after the settle kernel (a chained round's
# settlement in one launch): the gpu-marked engine tests and the CUDA kernel tests of the
# settlement and the step ops, then the embedded pair's HumanEval bench with MEMRA_PIPELINE=1
# and =0 one after the other (164 x 128, greedy, bf16, every arm), and the stdlib set pipelined.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_step_width.py \
  tests/engine/test_qwen3_5.py tests/engine/test_spec.py > $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt
timeout ${KTESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_settle.py tests/kernels/test_step_ops.py \
  >> $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0"
run_bench() {  # $1 prompt set, $2 MEMRA_PIPELINE
  s=$(date +%s)
  MEMRA_PIPELINE=$2 timeout ${BENCH_S:-100} python3 -m memra_cli bench --prompts $1 --max-new 128 --warmup 2 \
    $ARMS --json > $R/h200-$1-pipeline$2.json 2> $R/h200-$1-pipeline$2.err
  echo "bench $1 MEMRA_PIPELINE=$2 rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$R/h200-$1-pipeline$2.json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -8
  tail -2 $R/h200-$1-pipeline$2.err | cut -c1-300; pack
}
run_bench humaneval 1
run_bench humaneval 0
run_bench stdlib 1
