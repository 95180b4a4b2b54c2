#!/usr/bin/env bash
# Second device call of the pipelining work (H200): pipeline.sh's gpu-marked tests and embedded
# benches again after the chained round's fix (its first call: the capture refused a host read),
# without the hybrid step benchmark (measured in that first call).
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_step_width.py \
  tests/engine/test_qwen3_5.py tests/engine/test_spec.py > $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0"
for pipe in 1 0; do
  s=$(date +%s)
  MEMRA_PIPELINE=$pipe timeout ${BENCH_S:-100} python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 \
    $ARMS --json > $R/h200-humaneval-pipeline$pipe.json 2> $R/h200-humaneval-pipeline$pipe.err
  echo "bench MEMRA_PIPELINE=$pipe rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$R/h200-humaneval-pipeline$pipe.json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -8
  tail -3 $R/h200-humaneval-pipeline$pipe.err | cut -c1-300; pack
done
timeout ${PLAIN_S:-120} python3 benchmarks/gpu/embedded_plain.py --json $R/h200-embedded-plain.json 2>&1 | tail -3; pack
