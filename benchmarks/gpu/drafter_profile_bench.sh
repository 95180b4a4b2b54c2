#!/usr/bin/env bash
# One H200 call: where the drafter's side of a round goes (drafter_round.py --profile: kernel
# tables of the graphed proposal and ingest, bf16 and q8, and same-size copy / cuBLAS yardsticks
# at the quantized shapes), then the embedded pair's bench on both prompt sets with every arm
# (off, plain, dflash, dspark, dspark:vt=ladder, dspark:adapt=0; 128 tokens, all prompts).
#   bash benchmarks/gpu/drafter_profile_bench.sh      (results.tgz under $OUT)
set -o pipefail
source benchmarks/gpu/_env.sh
s=$(date +%s)
timeout ${ROUND_S:-200} python3 benchmarks/gpu/drafter_round.py --profile --reps 20 --budget-s 70 \
  --json $R/h200-drafter-round.json 2>&1 | grep -v -i warn | tail -80
echo "drafter_round rc=$? $(( $(date +%s) - s )) s"; pack
for set in ${SETS:-humaneval stdlib}; do BENCH_S=${BENCH_S:-150} pipeline_bench $set 1; done
