#!/usr/bin/env bash
# The hybrid's speculative rounds queued one ahead, the rollback inside each round's graph
# (Qwen35State.restore_round), and the DeltaNet recurrence's load-ahead depth, on the H200:
#   bash benchmarks/gpu/hybrid_rounds.sh          # tests, then hybrid_step.py twice
#   SWEEP=1 bash benchmarks/gpu/hybrid_rounds.sh  # first the recurrence sweep (step_profile.py gdn:
#                                                 # tiles x LATE_PREP x stash x PREFETCH)
# Tests: the DeltaNet / settle kernels, the model's step through the kernels, the gpu-marked
# engine tests (the pipelined hybrid sessions among them). Then hybrid_step.py (its `rounds`
# section: verify + in-graph rollback per round beside the plain token and the floor) with the
# module's PREFETCH, then with the other.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
if [ "${SWEEP:-0}" = 1 ]; then
  timeout ${SWEEP_S:-120} python3 benchmarks/gpu/step_profile.py --skip attention,8b,hybrid --json $R/h200-gdn-prefetch.json 2>&1 \
    | grep -v -i warn | cut -c1-300 | tail -4; pack
fi
timeout ${KTESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_settle.py tests/kernels/test_deltanet.py \
  tests/kernels/test_qwen3_5_step.py > $R/gpu_tests.txt 2>&1; echo "kernels rc=$?" >> $R/gpu_tests.txt
timeout ${GTESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py \
  tests/engine/test_step_width.py >> $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt
grep -E "passed|failed|FAILED|Error|rc=" $R/gpu_tests.txt | tail -12; pack
PF=$(python3 -c "import re; print(re.search(r'(?m)^PREFETCH = (\d)', open('kernels/deltanet.py').read())[1])")
for pf in $PF $((3 - PF)); do
  timeout ${HYBRID_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers --gdn-tile 16,1,1,$pf \
    --json $R/h200-hybrid-step-pf$pf.json 2>&1 | grep -v -i warn | grep -E "rounds|round_ms|over|floor_rows|plain_token" | cut -c1-700 | tail -14; pack
done
