#!/usr/bin/env bash
# On the lent H200: build the embedded models; results come back under $OUT as tar parts
# (the transfer takes at most 8 files of 16 MiB each).
set -eo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import sys, torch, transformers, tokenizers; print(sys.version, torch.__version__, transformers.__version__, tokenizers.__version__)" | tee -a $OUT/gpu.txt
python3 -m memra_cli.assets.build --out /tmp/assets 2>&1 | grep -v "Writing model shards" | tee $OUT/build.log
cp /tmp/assets/build_info.json $OUT/
tar cf - -C /tmp/assets target dflash dspark build_info.json | split -b 15M - $OUT/assets.tar.part-
ls -la $OUT
