#!/usr/bin/env bash
# One H200 call: head_dim-128 attention tiles with shorter splits at short contexts (growing splits
# keep long contexts' partials in proportion), then the 8B step with the pick against the shipped tile.
#   bash benchmarks/gpu/attn_tile_step.sh        (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
C="256,32,64,3,4;128,64,64,2,4;128,64,64,2,4,256,1024;128,64,64,2,4,512,1024;128,64,64,2,4,1024,1024"
C="$C;128,64,64,2,4,1024,2048;128,32,64,3,4,1024,1024;128,64,32,2,4,1024,1024"
timeout ${ATTN_S:-150} python3 benchmarks/gpu/long_attention.py --candidates "$C" --pick $R/pick.txt \
  --json $R/h200-long-attention-short.json 2>&1 | grep -v -i warn | tail -8; pack
if [ -s $R/pick.txt ]; then
  timeout ${STEP_S:-240} python3 benchmarks/gpu/target_step.py --variants triton,triton-tile,triton-r2,triton-tile-r2 --attn-tile "$(cat $R/pick.txt)" \
    --sweep-lengths 512,4096 --sweep-prompts ${PROMPTS:-10} --sweep-tokens 256 --prefill-length 0 \
    --json $R/h200-target-step-tile.json 2>&1 | grep -v -i warn | grep -E "ctx|exact|sweep" | tail -10; pack
fi
