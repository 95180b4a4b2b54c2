#!/usr/bin/env bash
# On the lent H200: GPU-marked tests, real-shape numbers, then the H200 bench.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; fi
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
timeout 150 python3 benchmarks/gpu_shapes.py --json $OUT/shapes_8b.json 2>&1 | tail -30
timeout ${BENCH_S:-200} python3 -m memra_cli bench --n ${BENCH_N:-164} --max-new 128 --no-phase-times \
  --arm off --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:vt=confidence --arm dspark:harvest=dflash \
  --json --plot $OUT/bench_h200.png > $OUT/bench_h200.json 2> $OUT/bench_h200.err; echo "bench rc=$?"
tail -3 $OUT/bench_h200.err; python3 -c "import json;d=json.load(open('$OUT/bench_h200.json'));[print(a['name'],round(a['tau'],2),round(a['tok_per_s'],1),a['speedup'],a.get('speedup_vs_off'),a['exact']) for a in d['arms']]" 2>&1 | tail -9
