"""The device's memory floors, the yardsticks the step and kernel benchmarks divide by: a
device-to-device copy (eager 2 GiB and graph-replayed 1 GiB, bytes read + written) and the read
floor (a sum over a 2 GiB buffer: every byte read once, almost nothing written).

    python -m benchmarks.gpu.bandwidth [--json OUT/bandwidth.json] [--gib 2] [--device cpu]

`--device cpu` (small buffers) is the smoke run; the numbers only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import timing


def measure(device: str, nbytes: int, reps: int) -> dict:
    """GB/s of the three probes on `device` over `nbytes` buffers (the graphed copy uses half)."""
    cuda = torch.device(device).type == "cuda"
    out = {"copy_eager_gbps": timing.copy_gbps(nbytes, reps, device=device),
           "read_sum_gbps": timing.read_gbps(nbytes, reps, device=device)}
    if cuda:
        out["copy_graph_gbps"] = timing.copy_gbps(nbytes // 2, reps, graphed=True, device=device)
    return {k: round(v, 1) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bandwidth.json")
    p.add_argument("--gib", type=float, default=2.0, help="buffer size (GiB) of the copy and the read")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    t0 = time.time()
    name = torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else "cpu"
    out = {"device": name, "command": "python -m benchmarks.gpu.bandwidth " + " ".join(sys.argv[1:] if argv is None else argv),
           **measure(a.device, int(a.gib * timing.GIB), a.reps), "seconds": round(time.time() - t0, 2)}
    print(json.dumps(out, indent=1))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
