"""The one-launch markov chain (memra_kernels.markov, the table path) on the embedded DSpark
drafter's shape: 15 slots over a 4096-token vocabulary, bf16 table, logits in bf16 (the
lm_head's output, as a greedy round passes them) and float32. Times each TABLE_WARPS candidate
as a CUDA graph of 20 chained launches (benchmarks/timing.py `graph_ms`), after checking its
tokens against the torch twin.

    python -m benchmarks.gpu.markov_chain --json $OUT/h200-markov-chain.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memra_kernels import markov

from benchmarks.timing import graph_ms as bench_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--warps", default="4,8,16")
    a = ap.parse_args()
    dev, n, V, r = torch.device("cuda"), 15, 4096, 64
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(V, r, generator=g) / r ** 0.5).to(torch.bfloat16).to(dev)
    w2 = torch.randn(V, r, generator=g).to(torch.bfloat16).to(dev)
    logits = (torch.randn(n, V, generator=g) * 4).to(dev)
    anchor = torch.tensor([7], device=dev)
    table = markov.bias_table(w1, w2, torch.bfloat16)
    ref = markov.markov_chain_ref(logits.to(torch.bfloat16).float(), anchor, w1, w2, torch.bfloat16).tolist()
    out = {"device": torch.cuda.get_device_name(), "n": n, "V": V, "module_warps": markov.TABLE_WARPS, "us": {}}
    saved = markov.TABLE_WARPS
    for warps in (int(x) for x in a.warps.split(",")):
        markov.TABLE_WARPS = warps
        for name, lg in (("bf16", logits.to(torch.bfloat16)), ("f32", logits.to(torch.bfloat16).float())):
            got = markov.markov_chain(lg, anchor, w1, w2, torch.bfloat16, table=table).tolist()
            us = 1e3 * bench_graph([lambda: markov.markov_chain(lg, anchor, w1, w2, torch.bfloat16, table=table)] * 20,
                                   reps=30)
            out["us"][f"warps{warps}_{name}"] = {"us": round(us, 2), "exact": got == ref}
            print(f"warps {warps:2d} logits {name}: {us:6.2f} us  exact {got == ref}", flush=True)
    markov.TABLE_WARPS = saved
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
