#!/usr/bin/env bash
# On the lent H200: the embedded-model build in two calls (each fits the 10-minute cap).
#   bash benchmarks/gpu/build_assets.sh target   # corpus, tokenizer, target, drafter data, the depth sweep
#   bash benchmarks/gpu/build_assets.sh drafters # both drafters side by side, then the assembled pair
# or, to retrain the drafters for the target already shipped (memra_cli/assets):
#   bash benchmarks/gpu/build_assets.sh seed     # the shipped target into build-work, then the drafter data
#   bash benchmarks/gpu/build_assets.sh drafters
# or all of that in one call (the new pair also lands in build-work/assets, for a warm next call
# to bench beside the shipped one with `memra bench --target/--draft`):
#   bash benchmarks/gpu/build_assets.sh retrain
# or the split retrain, each drafter alone on the GPU (more steps a second than two side by side:
# docs/bench.md, "The embedded models"), three calls:
#   BUDGET_S=400 bash benchmarks/gpu/build_assets.sh solo dflash  # seed + data + the DFlash drafter
#   BUDGET_S=400 bash benchmarks/gpu/build_assets.sh solo dspark  # the same data again + the DSpark drafter
#   bash benchmarks/gpu/build_assets.sh assemble   # carry build-work/ holding both calls' drafters/
#                                                  # (and one call's state.json, stdlib.jsonl, target/)
#   SHARDS=2 on a solo call: data.pt and one more draw of prompts, the drafter over both;
#   LAYERS=N on a solo call: the drafter's depth instead of the recipe's (DFlash 3, DSpark the sweep's best);
#   MARKOV=R on a solo dspark call: the markov head's rank instead of the recipe's 64;
#   BENCH=1 on the assemble call: the new pair benched beside the shipped one (carry .whl too);
#   BENCH_KINDS=dspark (or dflash) benches only that kind's arms
# On two GPUs (kind nvidia-h200-x2) `retrain` already trains each drafter alone, on its own GPU,
# in one call: device time counts the call's wall time whatever the kind, so that is the cheaper way.
# On four GPUs (kind nvidia-h200-x4) `retrain` is the recipe of docs/train.md "Retraining the
# embedded pair": four data shards made side by side (one per GPU), then each drafter alone on two
# GPUs (torch.distributed.run, gradients averaged), each rank over its own two shards, for
# BUDGET_S seconds (default 400; the budget against the shipped drafters': docs/train.md,
# "The retrain recipe: one call on four GPUs").
# Each solo call regenerates the drafter data (the data does not fit the carry
# limit beside the tree) and returns build-work less data.pt as tar parts.
# State lives in build-work/ (git-ignored; carry it to the second call: the machine is bare again).
# Results come back under $OUT as tar parts (the device returns at most 8 files of 16 MiB).
# TESTS_S > 0 also runs the `gpu`-marked tests after the target stage (they do not share the GPU
# with anything timed).
set -o pipefail
source benchmarks/gpu/_env.sh  # memra_kernels, the repo and any carried wheels on the path
stage=${1:?stage: target, seed, drafters, retrain, solo KIND or assemble}
# a fresh results folder: a warm machine keeps /tmp between calls (and the bench refuses to overwrite a plot)
R=/tmp/results; rm -rf $R; mkdir -p $R "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
python3 -c "import sys, torch, transformers, tokenizers; print(sys.version, torch.__version__, transformers.__version__, tokenizers.__version__)" | tee -a $R/gpu.txt
# a fresh build-work seeded with the shipped target (and its record), then the drafter data over it
seed_and_data() {
  rm -rf build-work
  python3 -m memra_cli.assets.build --stage seed --work build-work 2>&1 | tee $R/build-seed.log
  python3 -m memra_cli.assets.build --stage data --work build-work 2>&1 | grep -v "Loading weights" | tee $R/build-data.log
  cp build-work/state.json $R/
}
# both drafters of build-work into the assembled pair at /tmp/assets, returned as tar parts
assemble_and_pack() {
  python3 -m memra_cli.assets.build --stage assemble --work build-work --out /tmp/assets 2>&1 | tee $R/build-assemble.log
  cp /tmp/assets/build_info.json $R/
  tar cf - -C /tmp/assets target dflash dspark build_info.json stdlib.jsonl | split -b 15M - "$OUT/assets.tar.part-"
}
# four GPUs: the data step as four shards side by side (shard 0 is data.pt with the held-out splits),
# then each drafter over two GPUs of its own, each rank on two shards (ranks r and r+2 of --shards 4)
retrain_on_four() {
  rm -rf build-work
  python3 -m memra_cli.assets.build --stage seed --work build-work 2>&1 | tee $R/build-seed.log
  for shard in 0 1 2 3; do
    CUDA_VISIBLE_DEVICES=$shard python3 -m memra_cli.assets.build --stage data --shard $shard --work build-work 2>&1 \
      | grep -v "Loading weights" > $R/build-data-$shard.log &
  done
  wait
  cat $R/build-data-*.log | grep "drafter data"
  cp build-work/state.json $R/
  gpus=("0,1" "2,3"); i=0
  for kind in dflash dspark; do
    CUDA_VISIBLE_DEVICES=${gpus[$i]} python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m memra_cli.assets.build --stage drafter --kind $kind --work build-work --shards 4 \
      --draft-budget-s "${BUDGET_S:-400}" 2>&1 | grep -v "Loading weights" > $R/build-$kind.log &
    i=$((i + 1))
  done
  echo "drafters on 4 GPUs: each alone over 2 (data-parallel), 4 data shards" | tee $R/drafter-gpus.txt
  wait
}
if [ "$stage" = target ]; then
  rm -rf build-work
  python3 -m memra_cli.assets.build --stage target --work build-work 2>&1 | grep -v "Writing model shards\|Loading weights" | tee $R/build-target.log
  python3 -m memra_cli.assets.build --stage sweep --work build-work 2>&1 | grep -v "Loading weights" | tee $R/build-sweep.log
  cp build-work/state.json build-work/sweep.json $R/
  tar cf - build-work | split -b 15M - "$OUT/work.tar.part-"
  if [ "${TESTS_S:-0}" -gt 0 ]; then
    timeout "$TESTS_S" python3 -m pytest -q -m gpu -p no:cacheprovider tests > $R/gpu_tests.txt 2>&1
    echo "rc=$?" >> $R/gpu_tests.txt; tail -4 $R/gpu_tests.txt
  fi
elif [ "$stage" = seed ]; then
  seed_and_data
  tar cf - build-work | split -b 15M - "$OUT/work.tar.part-"
elif [ "$stage" = solo ]; then
  kind=${2:?solo needs dflash or dspark}
  seed_and_data
  # SHARDS > 1: further draws of training prompts (data --shard I), so the drafter makes fewer
  # passes over more data in its budget (docs/tuning.md#drafter-data)
  for ((shard = 1; shard < ${SHARDS:-1}; shard++)); do
    python3 -m memra_cli.assets.build --stage data --shard $shard --work build-work 2>&1 | grep -v "Loading weights" \
      | tee $R/build-data-$shard.log
  done
  python3 -m memra_cli.assets.build --stage drafter --kind "$kind" --work build-work --shards "${SHARDS:-1}" \
    --draft-budget-s "${BUDGET_S:-400}" ${LAYERS:+--draft-layers $LAYERS} ${MARKOV:+--markov-rank $MARKOV} 2>&1 | grep -v "Loading weights" | tee $R/build-$kind.log | grep -v " step "
  # the drafter's resumable training state (drafters/KIND.ckpt, ~25 MB with AdamW's moments) stays
  # behind too: the assemble call's carry (64 MiB) must hold both drafters beside the target
  tar cf - --exclude=build-work/data.pt --exclude='build-work/data.shard*.pt' --exclude='build-work/drafters/*.ckpt' \
    build-work | split -b 15M - "$OUT/work-$kind.tar.part-"
elif [ "$stage" = assemble ]; then
  assemble_and_pack
  # BENCH=1: the assembled pair beside the shipped one, in one bench process per prompt set (the
  # bench needs the CLI's wheels: carry .whl too)
  if [ "${BENCH:-0}" = 1 ]; then
    # BENCH_KINDS: the drafter kinds whose arms run (default both; one kind when only that drafter
    # was retrained, so the call spends its time on the arms that changed)
    arms=(--arm off --arm plain)
    for kind in ${BENCH_KINDS:-dflash dspark}; do
      arms+=(--arm $kind --arm $kind:adapt=0 --arm $kind:draft=/tmp/assets/$kind
             --arm $kind:draft=/tmp/assets/$kind,adapt=0)
    done
    for set in humaneval stdlib; do
      python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 "${arms[@]}" \
        --plot $R/bench-$set.png --json > $R/bench-$set.json 2> $R/bench-$set.log
      echo "bench $set rc=$?"; tail -n 3 $R/bench-$set.log
    done
  fi
else
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$stage" = retrain ] && [ "$ngpu" -ge 4 ]; then
    retrain_on_four
  else
    if [ "$stage" = retrain ]; then seed_and_data; tar czf "$OUT/results.tgz" -C $R .; fi
    # on a machine of two GPUs (kind nvidia-h200-x2) each drafter trains alone on its own GPU: about
    # twice the steps of two side by side on one, in the same call (BUDGET_S overrides the recipe's)
    gpu=0
    for kind in dflash dspark; do
      CUDA_VISIBLE_DEVICES=$(( ngpu > 1 ? gpu : 0 )) python3 -m memra_cli.assets.build --stage drafter --kind $kind \
        --work build-work ${BUDGET_S:+--draft-budget-s $BUDGET_S} 2>&1 | grep -v "Loading weights" > $R/build-$kind.log &
      gpu=$((gpu + 1))
    done
    echo "drafters on $(( ngpu > 1 ? 2 : 1 )) GPU(s)" | tee $R/drafter-gpus.txt
    wait
  fi
  tail -n 2 $R/build-dflash.log $R/build-dspark.log
  assemble_and_pack
  rm -rf build-work/assets; cp -r /tmp/assets build-work/assets
fi
tar czf "$OUT/results.tgz" -C $R .
ls -la "$OUT"
