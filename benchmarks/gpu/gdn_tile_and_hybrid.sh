#!/usr/bin/env bash
# One device call (H200): the DeltaNet recurrence's tile sweep (step_profile.py's gdn section),
# then the hybrid step benchmark with the tile the sweep found fastest for a 16-row replay-mode
# verify (`--gdn-tile`), and the hybrid's kernel / gpu tests with that tile as the module's.
set -o pipefail
source "$(dirname "$0")/_env.sh"
timeout ${PROFILE_S:-60} python3 benchmarks/gpu/step_profile.py --skip attention,8b,hybrid --json $R/h200-gdn-tiles.json 2>&1 \
  | grep -v -i warn | cut -c1-2500; pack
TILE=$(python3 -c "import json;print(','.join(map(str,json.load(open('$R/h200-gdn-tiles.json'))['gdn']['best_rows16'])))" 2>/dev/null || echo 32,4)
echo "tile $TILE"
timeout ${HYBRID_S:-200} python3 benchmarks/gpu/hybrid_step.py --gdn-tile $TILE --skip-transformers --json $R/h200-hybrid-step.json 2>&1 \
  | grep -v -i warn | cut -c1-800 | tail -24; pack
BV=${TILE%,*}; WP=${TILE#*,}
sed -i "s/^BLOCK_V = .*/BLOCK_V = $BV/; s/^REC_WARPS = .*/REC_WARPS = $WP/" kernels/deltanet.py
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_deltanet.py tests/kernels/test_qwen3_5_step.py \
  > $R/cuda_tests.txt 2>&1; echo "kernels rc=$?" >> $R/cuda_tests.txt
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py >> $R/cuda_tests.txt 2>&1; echo "gpu rc=$?" >> $R/cuda_tests.txt
grep -E "passed|failed|rc=" $R/cuda_tests.txt; pack
