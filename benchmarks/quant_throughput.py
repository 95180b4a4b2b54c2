"""q8_0 / q4_0 encode throughput: memra's encoder vs `gguf.quants.quantize`, same run (not a test).

Encodes --mb MiB of random normal float32 (rows of 4096) with both encoders, for each qtype,
arms interleaved, best of --repeat; checks the bytes are identical and prints MB/s of f32 input
consumed per arm (wall clock) and the ratio ours/gguf, also as a ratio of process CPU time, which
moves less when other work shares the host. Both encoders are single-threaded numpy.

    python -m benchmarks.quant_throughput [--mb 256] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

import gguf
import numpy as np

from memra_cli.engine.quant.blocks import quantize

GG = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
COLS = 4096


def timed(fn):
    """(wall seconds, process CPU seconds, result): CPU time is the steadier number on a shared host."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t, time.process_time() - c, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="MiB of float32 input (default 256)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per arm; the best is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args()

    rows = max(1, a.mb * 2**20 // (4 * COLS))
    x = np.random.default_rng(a.seed).standard_normal((rows, COLS), dtype=np.float32)
    mb = x.nbytes / 1e6
    result = {"shape": list(x.shape), "input_mb": round(mb, 1), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "numpy": np.__version__, "gguf": importlib.metadata.version("gguf")}
    for qtype, gtype in GG.items():
        wall = {"ours": float("inf"), "gguf": float("inf")}
        cpu = dict(wall)
        for _ in range(a.repeat):  # interleave the arms so load drift hits both alike
            runs = {"ours": timed(lambda: quantize(x, qtype, "bench")),
                    "gguf": timed(lambda: gguf.quants.quantize(x, gtype))}
            if not np.array_equal(runs["ours"][2].reshape(-1), runs["gguf"][2].reshape(-1)):
                print(f"error: {qtype} bytes differ from gguf", file=sys.stderr)
                return 1
            for arm, (w, c, _) in runs.items():
                wall[arm], cpu[arm] = min(wall[arm], w), min(cpu[arm], c)
            del runs
        result[qtype] = {"ours_mb_s": round(mb / wall["ours"], 1), "gguf_mb_s": round(mb / wall["gguf"], 1),
                         "ratio_ours_over_gguf": round(wall["gguf"] / wall["ours"], 2),
                         "cpu_time_ratio": round(cpu["gguf"] / cpu["ours"], 2), "bytes_identical": True}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"input {result['input_mb']} MB f32 {tuple(x.shape)}, {result['cores']} cores, "
              f"numpy {result['numpy']}, gguf {result['gguf']}")
        for qtype in GG:
            r = result[qtype]
            print(f"{qtype}: ours {r['ours_mb_s']:8.1f} MB/s   gguf {r['gguf_mb_s']:8.1f} MB/s   "
                  f"ours/gguf {r['ratio_ours_over_gguf']:.2f}x (CPU time {r['cpu_time_ratio']:.2f}x)   "
                  "bytes identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
