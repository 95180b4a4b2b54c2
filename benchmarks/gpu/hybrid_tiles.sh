#!/usr/bin/env bash
# One device call (H200): the DeltaNet recurrence and head_dim-256 attention tile sweeps
# (step_profile.py's gdn and attention sections), the hybrid step benchmark with the fastest of
# each (hybrid_step.py --gdn-tile / --attn-tile), then those tiles written into the modules for
# the per-kernel profile of the hybrid step and the CUDA tests. Each part under its own cap; the
# results tar is rewritten after each part.
set -o pipefail
source "$(dirname "$0")/_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${SWEEP_S:-170} python3 benchmarks/gpu/step_profile.py --skip 8b,hybrid --json $R/h200-tiles.json 2>&1 \
  | grep -v -i warn | cut -c1-2000; pack
pick() { python3 -c "import json,sys; print(','.join(map(str, json.load(open('$R/h200-tiles.json'))[sys.argv[1]][sys.argv[2]])))" "$@" 2>/dev/null; }
GT=$(pick gdn best_rows16); AT=$(pick attention best_hd256)
echo "gdn tile ${GT:-module} attention hd256 tile ${AT:-module}"
timeout ${HYBRID_S:-200} python3 benchmarks/gpu/hybrid_step.py ${GT:+--gdn-tile $GT} ${AT:+--attn-tile $AT} --skip-transformers \
  --json $R/h200-hybrid-step.json 2>&1 | grep -v -i warn | cut -c1-900 | tail -30; pack
python3 - "$GT" "$AT" <<'PY'
import re, sys
gt, at = sys.argv[1], sys.argv[2]
if gt:
    bv, w, late = (gt.split(",") + ["1"])[:3]
    p = "kernels/deltanet.py"; s = open(p).read()
    s = re.sub(r"(?m)^BLOCK_V = \d+", f"BLOCK_V = {bv}", s); s = re.sub(r"(?m)^REC_WARPS = \d+", f"REC_WARPS = {w}", s)
    s = re.sub(r"(?m)^LATE_PREP = \w+", f"LATE_PREP = {bool(int(late))}", s); open(p, "w").write(s)
if at:
    sp, bn, bm, st, wp = at.split(",")
    p = "kernels/attention.py"; s = open(p).read()
    s = re.sub(r"256: Tile\([^)]*\)", f"256: Tile(split={sp}, block_n={bn}, block_m={bm}, num_stages={st}, num_warps={wp})", s)
    open(p, "w").write(s)
print("modules set:", gt, at)
PY
grep -nE "^BLOCK_V|^REC_WARPS|^LATE_PREP" kernels/deltanet.py; grep -n "256: Tile" kernels/attention.py
hybrid_profile_and_tests
ls -la "$OUT"
