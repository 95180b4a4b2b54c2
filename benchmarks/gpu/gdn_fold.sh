#!/usr/bin/env bash
# One device call (H200): the DeltaNet recurrence's row grouping (deltanet.FOLD) both ways.
#   1. the recurrence tile sweep (step_profile.py's gdn section: tiles x LATE_PREP x FOLD, 1 and 16 rows);
#   2. the recurrence's CUDA tests (both groupings against the twin, row-count invariance);
#   3. the hybrid step benchmark (no transformers) with the module's constants and with FOLD on.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${SWEEP_S:-120} python3 benchmarks/gpu/step_profile.py --skip attention,8b,hybrid --json $R/h200-gdn-fold-tiles.json 2>&1 \
  | grep -v -i warn | tail -3
python3 - $R/h200-gdn-fold-tiles.json <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))["gdn"]
for k, v in sorted(g.items()):
    if isinstance(v, float) and "stash0" in k: print(f"  {k}: {v:.2f}")
print("  best_rows16", g.get("best_rows16"), " replay 1/16:", g.get("replay_all_layers_rows1_us"), g.get("replay_all_layers_rows16_us"))
PY
pack
timeout ${KTESTS_S:-100} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_deltanet.py > $R/cuda_tests.txt 2>&1
echo "deltanet kernels rc=$?" >> $R/cuda_tests.txt; tail -2 $R/cuda_tests.txt; pack
for tile in "" "16,1,1,1"; do
  tag=${tile:+-fold}
  timeout ${HYBRID_S:-150} python3 benchmarks/gpu/hybrid_step.py --skip-transformers ${tile:+--gdn-tile $tile} \
    --json $R/h200-hybrid-step$tag.json 2>&1 | grep -v -i warn | cut -c1-600 | tail -18; pack
done
