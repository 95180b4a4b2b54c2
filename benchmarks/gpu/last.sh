#!/usr/bin/env bash
# The session's last device call (H200): the new kernels' own tests on CUDA (tests/kernels
# runs on the GPU when there is one; these files are not `gpu`-marked, so `-m gpu` skips them),
# the step-width gpu tests, and the HumanEval bench of the embedded pair.
set -o pipefail
source "$(dirname "$0")/_env.sh"
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gather.py tests/kernels/test_markov.py tests/kernels/test_argmax.py > $R/cuda-kernel-tests.txt 2>&1; echo "rc=$?" >> $R/cuda-kernel-tests.txt
tail -3 $R/cuda-kernel-tests.txt; pack
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_step_width.py > $R/gpu-step-width-tests.txt 2>&1; echo "rc=$?" >> $R/gpu-step-width-tests.txt
tail -2 $R/gpu-step-width-tests.txt; pack
ARMS="--arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0"
timeout 75 python3 -m memra_cli bench --prompts humaneval --max-new 128 --warmup 2 $ARMS \
  --plot $R/h200-embedded-humaneval.png --json > $R/h200-embedded-humaneval.json 2> $R/bench.err; echo "bench rc=$?"
python3 -c "import json;d=json.load(open('$R/h200-embedded-humaneval.json'));print(' exact',d['exact']);[print('  %-18s tau %-5s ms/tok %.4f speedup %.3f exact %s'%(a['name'],a['tau'] and round(a['tau'],2),a['ms_per_token'],a['speedup'],a['exact'])) for a in d['arms']]" 2>&1 | tail -7; pack
