#!/usr/bin/env bash
# On the lent H200: one stage of the embedded-model build per call (each fits the 10-minute cap).
#   bash benchmarks/gpu/build_assets.sh target   # corpus, tokenizer, target, drafter data, then the sweep
#   bash benchmarks/gpu/build_assets.sh drafters # both drafters from the target stage's state
# State lives in build-work/ (git-ignored; carry it back if the machine was released between
# calls). Results come back under $OUT as tar parts (transfers take files of at most 16 MiB).
set -eo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
stage=${1:?stage: target or drafters}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import sys, torch, transformers, tokenizers; print(sys.version, torch.__version__, transformers.__version__, tokenizers.__version__)" | tee -a $OUT/gpu.txt
if [ "$stage" = target ]; then
  rm -rf build-work
  python3 -m memra_cli.assets.build --stage target --work build-work 2>&1 | grep -v "Writing model shards" | tee $OUT/build-target.log
  python3 -m memra_cli.assets.build --stage sweep --work build-work 2>&1 | tee $OUT/build-sweep.log || true
  cp build-work/state.json build-work/stdlib.jsonl $OUT/ ; cp build-work/sweep.json $OUT/ || true
  tar cf - build-work | split -b 15M - $OUT/work.tar.part-
else
  python3 -m memra_cli.assets.build --stage drafters --work build-work --out /tmp/assets 2>&1 | grep -v "Writing model shards" | tee $OUT/build-drafters.log
  cp /tmp/assets/build_info.json $OUT/
  tar cf - -C /tmp/assets target dflash dspark build_info.json stdlib.jsonl | split -b 15M - $OUT/assets.tar.part-
fi
ls -la $OUT
