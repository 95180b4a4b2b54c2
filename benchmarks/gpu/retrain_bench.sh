#!/usr/bin/env bash
# On the lent H200, one call: the drafter data again over a finished target stage (build-work/,
# carried), both drafters, then the bench of the new pair on HumanEval and the stdlib set.
# Everything lands under $OUT as soon as it exists, so a call cut short still returns it.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m memra_cli.assets.build --stage data --work build-work 2>&1 | tee $OUT/build-data.log
python3 -m memra_cli.assets.build --stage drafters --work build-work --out /tmp/assets 2>&1 | grep -v "Writing model shards" | tee $OUT/build-drafters.log
cp /tmp/assets/build_info.json build-work/state.json $OUT/
tar cf - -C /tmp/assets target dflash dspark build_info.json stdlib.jsonl | split -b 15M - $OUT/assets.tar.part-
for d in target dflash dspark; do rm -rf memra_cli/assets/$d; cp -r /tmp/assets/$d memra_cli/assets/; done
cp /tmp/assets/build_info.json memra_cli/assets/; cp /tmp/assets/stdlib.jsonl memra_cli/engine/data/stdlib.jsonl
for set in humaneval stdlib; do
  s=$(date +%s)
  python3 -m memra_cli bench --prompts $set --max-new 128 --warmup 2 \
    --arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder \
    --json > $OUT/bench-$set.json 2> $OUT/bench-$set.err; echo "bench $set rc=$? $(( $(date +%s) - s )) s"
  tail -3 $OUT/bench-$set.err
  python3 -c "import json;d=json.load(open('$OUT/bench-$set.json'));[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),a['speedup'],a.get('speedup_vs_off'),a['exact']) for a in d['arms']]" 2>&1 | tail -8
done
ls -la $OUT
