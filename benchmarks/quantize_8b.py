"""Wall time of `memra quantize` on a drafter of the Qwen3-8B-DFlash shape (not a test).

Writes a random-weight bf16 drafter checkpoint of the z-lab Qwen3-8B-DFlash geometry — 5 layers,
hidden 4096, intermediate 12288, 32 q heads / 8 kv heads x 128, 5 target taps, no markov head;
1.05 B parameters, 2.1 GB (normal weights, std 0.02) — then times `memra quantize --policy q8`
and `--policy q4` as whole commands (interpreter start, imports, census, quantizing, error
statistics, writing the GGUF), each in a fresh process. The command's own JSON report gives the
sizes and its in-process time.

    python -m benchmarks.quantize_8b [--dir /tmp/memra-quant-8b] [--policies q8,q4] [--repeat 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(layers=5, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
             target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36)


def build(d: Path) -> float:
    import torch

    from memra_cli.tiny.draft import make_tiny_draft

    if (d / "model.safetensors").is_file() and (d / "config.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    make_tiny_draft(d, "zlab", dtype=torch.bfloat16, std=0.02, **SHAPE)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/memra-quant-8b"))
    ap.add_argument("--policies", default="q8,q4")
    ap.add_argument("--repeat", type=int, default=1, help="runs per policy; the best wall time is kept")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    src = a.dir / "draft"
    built_s = build(src)
    result: dict = {"source": str(src), "source_bytes": (src / "model.safetensors").stat().st_size,
                    "build_s": round(built_s, 1), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "runs": {}}
    for policy in a.policies.split(","):
        out = a.dir / f"draft-{policy}.gguf"
        best = None
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "memra_cli", "quantize", str(src), "--policy", policy,
                                "--out", str(out), "--force", "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
            rep = json.loads(r.stdout)
            if best is None or wall < best[0]:
                best = (wall, rep)
        wall, rep = best
        t = rep["totals"]
        errs = [x["rel_rms_error"] for x in rep["tensors"] if x["type"] in ("Q8_0", "Q4_0")]
        result["runs"][policy] = {
            "command_wall_s": round(wall, 2), "in_process_write_s": round(t["seconds"], 2),
            "bytes_before": t["bytes_before"], "bytes_after": t["bytes_after"], "file_bytes": t["file_bytes"],
            "ratio": round(t["ratio"], 3), "n_tensors": t["n_tensors"], "types": t["types"],
            "input_mb_per_s": round(t["bytes_before"] / 1e6 / wall, 1),
            "rel_rms_error_range": [min(errs), max(errs)],
        }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"source: {result['source_bytes'] / 1e9:.2f} GB bf16 ({src}), {result['cores']} cores")
    for policy, r in result["runs"].items():
        lo, hi = r["rel_rms_error_range"]
        print(f"memra quantize --policy {policy}: {r['command_wall_s']:.2f} s whole command "
              f"({r['in_process_write_s']:.2f} s writing), {r['bytes_before'] / 1e9:.2f} GB -> "
              f"{r['file_bytes'] / 1e9:.3f} GB (ratio {r['ratio']:.2f}x), {r['input_mb_per_s']:.0f} MB/s of bf16 input, "
              f"rel RMS error {lo:.2e}..{hi:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
