#!/usr/bin/env bash
# One device call: the attention kernel's CUDA tests (long splits included), the long-split
# sweep at the 8B shape (long_attention.py), then target_step.py's timing with the sweep's best
# head_dim-128 tile and the full exactness sweep (512, 4096 and 16384-token prompts, 20 x 256 tokens).
source benchmarks/gpu/_env.sh
nvidia-smi -L
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py > $R/attn_tests.txt 2>&1; echo "attention tests rc=$?"
tail -3 $R/attn_tests.txt; pack
timeout 150 python3 benchmarks/gpu/long_attention.py --json $R/h200-long-attention.json 2>&1 | grep -v -i warn; pack
TILE=$(python3 -c "import json;print(','.join(map(str,json.load(open('$R/h200-long-attention.json'))['best'])))" 2>/dev/null)
echo "tile $TILE"
timeout ${TS_S:-360} python3 benchmarks/gpu/target_step.py ${TILE:+--attn-tile $TILE} --sweep-lengths 512,4096,16384 --sweep-prompts 20 \
  --sweep-tokens 256 --json $R/h200-target-step-long.json 2>&1 | grep -v -i warn | cut -c1-300; pack
