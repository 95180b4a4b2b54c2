"""Why two benchmarks measured the H200's copy bandwidth 1.55x apart (2.76 vs 4.27 TB/s).

drafter_round.py times a CUDA-graph replay of a 1 GiB copy (30 reps, 3 warm-up calls) as its
first measurement; kernels_quant.py times an eager 2 GiB copy with triton's do_bench (200 reps).
Both divide kernel traffic by it to report fractions of the copy bandwidth, so the difference
matters. This runs both, in this order: drafter_round's first (a cold GPU, as there), then
kernels_quant's, then drafter_round's again, and a longer graph-replay run, and prints TB/s.

    python benchmarks/gpu/copy_bw.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import drafter_round as dr  # noqa: E402
import kernels_quant as kq  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "h200-copy-bw.json")
    a = p.parse_args()
    dev = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(), "command": "python benchmarks/gpu/copy_bw.py"}
    t0 = time.time()
    out["drafter_round_first_tbps"] = dr.copy_bandwidth(dev, 1 << 30) / 1e12
    out["kernels_quant_tbps"] = kq.copy_bandwidth() / 1e12
    out["drafter_round_again_tbps"] = dr.copy_bandwidth(dev, 1 << 30) / 1e12
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    from memra_cli.engine.runtime import cuda_graphs

    graph, _ = cuda_graphs.capture(lambda: dst.copy_(src), dev)
    for _ in range(200):  # a second of copies first: clocks up
        graph.replay()
    out["graph_1gib_after_warmup_tbps"] = 2 * (1 << 30) / (dr.median_ms(graph.replay, dev, reps=100) * 1e-3) / 1e12
    out["seconds"] = round(time.time() - t0, 2)
    print(json.dumps(out, indent=1))
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
