#!/usr/bin/env bash
# memra serve on the GPU with the embedded pair (bf16, graphs on, the engine's defaults), one call:
#   1. one client: the server's per-request tok/s against `memra generate` and a warm in-process
#      session of the same program, interleaved per prompt (docs/serve.md § One client; the check:
#      server within 10% of generate), 16 HumanEval prompts x 256 tokens;
#   2. the load test: 200 streamed requests from 16 clients, every stream compared with plain
#      decoding (interleaved graphed sessions stay exact), p50/p99 latency, total tok/s.
# The device has no registry: the serve extra's wheels and their dependencies come in .whl
# (here: pip download -d .whl starlette uvicorn httpx openai, for the device's Python).
source benchmarks/gpu/_env.sh
python3 -m pip install -q --no-index --find-links .whl --target /tmp/serve-site starlette uvicorn httpx openai \
  && export PYTHONPATH=$PYTHONPATH:/tmp/serve-site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
timeout ${SINGLE_S:-240} python3 benchmarks/serve_load.py single --device cuda --requests 16 --max-tokens 256 --json \
  > "$R/serve-single.json"; echo "single rc=$?"; cat "$R/serve-single.json"
timeout ${LOAD_S:-300} python3 benchmarks/serve_load.py load --device cuda --requests 200 --clients 16 --max-tokens 64 \
  --timeout-s 280 --json > "$R/serve-load.json"; echo "load rc=$?"; cat "$R/serve-load.json"
pack
