#!/usr/bin/env bash
# On the lent H200: `memra parity` at the Qwen3-8B drafter shape (issue 5).
#
# Two random drafters of that shape (5 layers, hidden 4096, 32/8 heads x 128, ffn 12288, taps
# 1,9,17,25,33 of 36, block 16, bf16 weights, std 0.02):
#   dspark  DeepSpec format with its own embed_tokens/lm_head (vocab 151936), a rank-256 markov
#           head and a markov confidence head, so every oracle stage is compared;
#   zlab    z-lab format (no tables: ctx_features, layer_out, hidden_out).
# For each: an oracle from the float64 reference (`--make-oracle`, CPU), then the engine on CUDA
# under --prec bf16, --prec q8 (quantized at load) and, for dspark, a q8 GGUF from
# `memra quantize`. Results come back under $OUT (at most 8 files).
#
# SMALL=1 runs the same pipeline at a toy shape on whatever device is there (a dry run here).
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "$SMALL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || exit 1
fi
OUT=${OUT:-/tmp/parity_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/parity_8b}; rm -rf "$WORK"; mkdir -p "$WORK"
CTX=${CTX:-512}
DEVICE=${DEVICE:-cuda}
LOG=$OUT/parity_8b.log

python3 - "$WORK" <<'EOF' 2>&1 | tee "$LOG"
import os, sys, time, torch
from memra_cli.tiny.draft import make_tiny_draft
work = sys.argv[1]
small = bool(os.environ.get("SMALL"))
shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             mask_token_id=511, target_layer_ids=(1, 3), num_target_layers=4) if small else dict(
    hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
    mask_token_id=151935, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36)
print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())
for name, fmt, extra in (("dspark", "deepspec", dict(markov_rank=256, confidence="markov")),
                         ("zlab", "zlab", {})):
    t = time.perf_counter()
    make_tiny_draft(f"{work}/{name}", fmt, block_size=16, std=0.02, dtype=torch.bfloat16, **shape, **extra)
    print(f"made {name}: {time.perf_counter() - t:.1f} s")
EOF
[ -d "$WORK/zlab" ] || exit 1

step() {  # step LABEL CMD...: run and time; stdout to $WORK/LABEL.out, both streams' tail to the log
  local label=$1; shift
  local t0=$EPOCHREALTIME
  "$@" > "$WORK/$label.out" 2> "$WORK/$label.err"; local rc=$?
  local t1=$EPOCHREALTIME
  printf '\n== %s: rc=%s, %s s\n$ %s\n' "$label" "$rc" "$(python3 -c "print(f'{$t1 - $t0:.1f}')")" "$*" | tee -a "$LOG"
  tail -n 40 "$WORK/$label.err" | tee -a "$LOG"
  case "$*" in *--json*) ;; *) tail -n 40 "$WORK/$label.out" | tee -a "$LOG" ;; esac
}
summary() {  # summary LABEL: the --json result as one line per stage and path
  cp "$WORK/$1.out" "$OUT/$1.json"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('pass:', d['pass'])
for s in d['stages']:
    print(f\"  {s['stage']:15s} {s['path']:6s} rel_l2 {s['rel_l2'] if s['rel_l2'] is not None else float('nan'):.3e}  max_abs {s['max_abs'] if s['max_abs'] is not None else float('nan'):.3e}  argmax {s['argmax_agree']}  bound {s['threshold']}  {'pass' if s['pass'] else 'FAIL'}  {s.get('note', '')}\")
" "$OUT/$1.json" 2>&1 | tee -a "$LOG"
}

memra="python3 -m memra_cli"
step census-dspark $memra census "$WORK/dspark"
step oracle-dspark $memra parity "$WORK/dspark" --make-oracle "$WORK/dspark.npz" --ctx "$CTX" --seed 0
step oracle-zlab $memra parity "$WORK/zlab" --make-oracle "$WORK/zlab.npz" --ctx "$CTX" --seed 0
step dspark-bf16 $memra parity "$WORK/dspark" "$WORK/dspark.npz" --prec bf16 --device "$DEVICE" --json; summary dspark-bf16
step dspark-q8 $memra parity "$WORK/dspark" "$WORK/dspark.npz" --prec q8 --device "$DEVICE" --json; summary dspark-q8
step quantize-dspark $memra quantize "$WORK/dspark" --out "$WORK/dspark-q8.gguf" --policy q8
step dspark-q8gguf $memra parity "$WORK/dspark-q8.gguf" "$WORK/dspark.npz" --device "$DEVICE" --json; summary dspark-q8gguf
step zlab-bf16 $memra parity "$WORK/zlab" "$WORK/zlab.npz" --prec bf16 --device "$DEVICE" --json; summary zlab-bf16
step zlab-q8 $memra parity "$WORK/zlab" "$WORK/zlab.npz" --prec q8 --device "$DEVICE" --json; summary zlab-q8

# More seeds of the dspark drafter under --prec bf16 (weights and inputs both reseeded): how far
# confidence_raw's plain relative L2 wanders against hidden_out's (docs § confidence_raw).
for seed in ${SWEEP_SEEDS-1 2 3}; do
  python3 -c "
import sys, torch
from memra_cli.tiny.draft import make_tiny_draft
small = bool('$SMALL')
shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             mask_token_id=511, target_layer_ids=(1, 3), num_target_layers=4) if small else dict(
    hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
    mask_token_id=151935, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36)
make_tiny_draft('$WORK/sweep', 'deepspec', block_size=16, std=0.02, dtype=torch.bfloat16, seed=$seed,
                markov_rank=256, confidence='markov', **shape)
" && $memra parity "$WORK/sweep" --make-oracle "$WORK/sweep.npz" --ctx "$CTX" --seed "$seed" > /dev/null 2>&1 \
  && $memra parity "$WORK/sweep" "$WORK/sweep.npz" --prec bf16 --device "$DEVICE" --json 2>/dev/null \
  | python3 -c "
import json, re, sys
d = json.load(sys.stdin)
for s in d['stages']:
    if s['stage'] in ('hidden_out', 'confidence_raw'):
        m = re.search(r'plain rel_l2 (\S+)\)', s['note'])
        print(f\"sweep seed $seed {s['stage']:15s} {s['path']:6s} judged {s['rel_l2']:.2e} plain {m.group(1) if m else 'same'} {'pass' if s['pass'] else 'FAIL'}\")
" 2>&1 | tee -a "$LOG"
  rm -rf "$WORK/sweep" "$WORK/sweep.npz"
done
ls -la "$OUT"
