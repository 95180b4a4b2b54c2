#!/usr/bin/env bash
# On the lent H200: the HumanEval bench in four slices of 41 prompts (each its own interleaved
# run with its own exactness gate), so a slow run still returns the slices it finished.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; fi
for i in 0 1 2 3; do
  s=$(date +%s)
  python3 -m memra_cli bench --prompts .benchdata/he$i.jsonl --max-new 128 --dtype ${DTYPE:-float32} --no-phase-times --warmup 1 \
    --arm off --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:vt=confidence --arm dspark:harvest=dflash \
    --json > $OUT/he$i.json 2> $OUT/he$i.err; echo "slice $i rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$OUT/he$i.json'));[print(' ',a['name'],round(a['tau'],2),round(a['tok_per_s'],1),a['speedup'],a.get('speedup_vs_off'),a['exact']) for a in d['arms']]" 2>&1 | tail -8
done
