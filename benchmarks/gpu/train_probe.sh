#!/usr/bin/env bash
# On the lent H200: how fast the build's drafter training and data generation run at other batch
# sizes, eager and compiled (benchmarks/gpu/train_probe.py), the two kinds side by side as the
# build runs them, then one kind alone; then the data generator at two batch sizes.
#   bash benchmarks/gpu/train_probe.sh            # BATCHES=128,256 MODES=eager,compile ALONE=1 DATAGEN=1
# Side by side, the two processes' phases need not line up (one compiles while the other trains),
# so compare modes on the ALONE rows; the side-by-side rows say what the build's stage gets.
source benchmarks/gpu/_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $R/gpu.txt
B=${BATCHES:-128,256}; M=${MODES:-eager,compile}
for kind in dflash dspark; do
  python3 benchmarks/gpu/train_probe.py drafter --kind $kind --batches $B --modes $M --json $R/probe-$kind.json 2>&1 \
    | grep -v "Loading weights" > $R/probe-$kind.log &
done
wait; tail -n 8 $R/probe-dflash.log $R/probe-dspark.log; pack
if [ "${ALONE:-1}" = 1 ]; then
  python3 benchmarks/gpu/train_probe.py drafter --kind dspark --batches $B --modes $M --json $R/probe-dspark-alone.json 2>&1 \
    | grep -v "Loading weights" | tail -n 8; pack
fi
if [ "${DATAGEN:-1}" = 1 ]; then
  python3 benchmarks/gpu/train_probe.py datagen --gen-batches ${GEN_BATCHES:-4096,16384} --json $R/probe-datagen.json 2>&1 \
    | grep -v "Loading weights\|deprecated\|forward_call"; pack
fi
