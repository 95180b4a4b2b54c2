"""The few-row dense kernel (memra_kernels.dense_linear) against cuBLAS on the engine's shapes.

For each weight shape [out, in] (bf16): cuBLAS's `F.linear` at M = 16 and M = 1, then a sweep of
the kernel's tiles at M = 16 (each candidate checked against the reference and for row
invariance first), the best one also at M = 1. Every time is a CUDA-graph replay of calls that
cycle through enough copies of the weight that L2 never holds the one being read (as the engine
reads weights: once per step). Prints a TUNED table of the shapes where the kernel beat cuBLAS
at M = 16 by more than `--margin`, and writes everything to `--json` (the table also to
`--tuned`, which `dense_linear.load_tuned` and the benchmarks' `--dense-tuned` read: there it
holds the module's TUNED entries for the shapes not swept beside the swept winners, so it is a
whole table).

    python -m benchmarks.gpu.dense_linear_sweep [--shapes 8b,drafter,hybrid] [--json F] [--tuned F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from memra_kernels import dense_linear as dl

from benchmarks import timing
from benchmarks.gpu import kernels_quant as kq  # copies_for: weight copies enough to defeat L2

SHAPES = {
    # Qwen3-8B target: fused q/k/v, o, fused gate/up, down, lm_head
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)],
    # its DFlash drafter beyond those: fc over 5 taps, the ingest's fused k/v
    "drafter": [(4096, 20480), (2048, 4096)],
    # Qwen3.5-4B hybrid: DeltaNet in/out, gated attention qkv, o, gate/up, down, lm_head
    "hybrid": [(12352, 2560), (2560, 4096), (10240, 2560), (18432, 2560), (2560, 9216), (248320, 2560)],
    # LLaMA-3.1-8B beyond the 8B's: fused gate/up, down, lm_head (q/k/v and o are the 8B's)
    "llama": [(28672, 4096), (4096, 14336), (128256, 4096)],
    # Qwen3-30B-A3B's dense weights: fused q/k/v, o, lm_head, the router (the experts run the MoE kernels)
    "moe-a3b": [(5120, 2048), (2048, 4096), (151936, 2048), (128, 2048)],
}
REL_TOL = 1e-2


def log(*a) -> None:
    print(*a, flush=True)


def graph_us(call, n_copies: int) -> float:
    """Median µs of one `call(i)`: CUDA-graph replays of calls cycling through the weight copies
    (benchmarks/timing.py, the quantized kernels' yardstick)."""
    return 1e3 * timing.cycled_graph_ms(call, n_copies)


def candidates(n: int, k: int) -> list[dl.KernelConfig]:
    out = []
    for bn, bk in itertools.product((32, 64, 128), (128, 256)):
        stages, warps = (3 if bn * bk >= 128 * 256 else 4), 4
        if bn * bk * 2 * stages > 200 * 1024:  # shared memory for the weight tiles alone
            continue
        n_tiles, k_tiles = -(-n // bn), -(-k // bk)
        for split in (1, 2, 4, 8, 16, 32):
            progs = n_tiles * split
            if split > 1 and k_tiles / split < 2:
                continue
            if not 100 <= progs <= 1100 and not (split == 1 and progs > 1100):
                continue
            out.append(dl.KernelConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages))
    return out


def refinements(best: dl.KernelConfig) -> list[dl.KernelConfig]:
    from dataclasses import replace

    return [replace(best, num_warps=8), replace(best, num_stages=best.num_stages + 1),
            replace(best, num_stages=best.num_stages - 1), replace(best, num_warps=2),
            replace(best, block_k=64, num_stages=6)]


def check(w: torch.Tensor, cfg: dl.KernelConfig, x: torch.Tensor) -> bool:
    y = dl.dense_linear(x, w, config=cfg)
    ref = dl.dense_linear_ref(x, w)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    inv = all(torch.equal(dl.dense_linear(x[i:i + 1], w, config=cfg), y[i:i + 1]) for i in (0, 15))
    return rel < REL_TOL and inv


def cfg_str(c: dl.KernelConfig) -> str:
    return f"n{c.block_n}_k{c.block_k}_s{c.split_k}_w{c.num_warps}_st{c.num_stages}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8b,drafter,hybrid")
    p.add_argument("--margin", type=float, default=0.03, help="kernel must beat cuBLAS at M = 16 by this fraction")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "h200-dense-linear.json")
    p.add_argument("--tuned", type=Path, default=None)
    a = p.parse_args()
    t0 = time.perf_counter()
    unknown = [name for name in a.shapes.split(",") if name not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown set(s) {', '.join(unknown)}; expected a comma-separated list of "
                f"{', '.join(SHAPES)}")
    shapes = [s for name in a.shapes.split(",") for s in SHAPES[name]]
    bw = timing.copy_gbps() * 1e9
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": bw / 1e9,
           "command": "python -m benchmarks.gpu.dense_linear_sweep " + " ".join(sys.argv[1:]), "shapes": []}
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    tuned = {}
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        nbytes = n * k * 2
        copies = kq.copies_for(nbytes)
        ws = [(torch.randn((n, k), generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
        x16 = torch.randn((16, k), generator=gen).to("cuda", torch.bfloat16)
        x1 = x16[:1].clone()
        row = {"out": n, "in": k, "bytes": nbytes,
               "cublas_m16_us": graph_us(lambda i: F.linear(x16, ws[i]), copies),
               "cublas_m1_us": graph_us(lambda i: F.linear(x1, ws[i]), copies), "candidates": {}}
        best, best_us = None, float("inf")

        def run(cfg):
            nonlocal best, best_us
            key = cfg_str(cfg)
            if key in row["candidates"] or time.perf_counter() - t0 > a.budget_s:
                return
            try:
                if not check(ws[0], cfg, x16):
                    row["candidates"][key] = "wrong"
                    return
                us = graph_us(lambda i: dl.dense_linear(x16, ws[i], config=cfg), copies)
            except Exception as exc:  # out of resources and the like: skip the candidate
                row["candidates"][key] = f"error: {type(exc).__name__}: {str(exc)[:100]}"
                return
            row["candidates"][key] = us
            if us < best_us:
                best, best_us = cfg, us

        for cfg in candidates(n, k):
            run(cfg)
        if best is not None:
            for cfg in refinements(best):
                run(cfg)
        if best is not None:
            row["best"] = cfg_str(best)
            row["best_cfg"] = {"block_n": best.block_n, "block_k": best.block_k, "split_k": best.split_k,
                               "num_warps": best.num_warps, "num_stages": best.num_stages}
            row["best_m16_us"] = best_us
            row["best_m1_us"] = graph_us(lambda i: dl.dense_linear(x1, ws[i], config=best), copies)
            row["kernel_frac_m16"] = nbytes / (best_us * 1e-6) / bw
            row["cublas_frac_m16"] = nbytes / (row["cublas_m16_us"] * 1e-6) / bw
            row["speedup_m16"] = row["cublas_m16_us"] / best_us
            row["speedup_m1"] = row["cublas_m1_us"] / row["best_m1_us"]
            if best_us < (1 - a.margin) * row["cublas_m16_us"]:
                tuned[f"{n}x{k}"] = row["best_cfg"]
        log(f"[{n:>6} x {k:>5}] cuBLAS m16 {row['cublas_m16_us']:7.2f} us  m1 {row['cublas_m1_us']:7.2f} | "
            f"kernel {row.get('best', '-')} m16 {row.get('best_m16_us', float('nan')):7.2f} "
            f"m1 {row.get('best_m1_us', float('nan')):7.2f} | frac {row.get('kernel_frac_m16', 0):.2f} vs "
            f"{row.get('cublas_frac_m16', 0):.2f}")
        res["shapes"].append(row)
        del ws
        torch.cuda.empty_cache()
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    res["tuned"] = tuned
    res["seconds"] = time.perf_counter() - t0
    a.json.write_text(json.dumps(res, indent=1))
    if a.tuned:  # a whole table: the module's entries for shapes not swept, then the winners
        swept = {f"{n}x{k}" for n, k in shapes}
        kept = {f"{n}x{k}": {"block_n": c.block_n, "block_k": c.block_k, "split_k": c.split_k,
                             "num_warps": c.num_warps, "num_stages": c.num_stages}
                for (n, k), c in dl.TUNED.items() if f"{n}x{k}" not in swept}
        a.tuned.write_text(json.dumps({**kept, **tuned}, indent=1))
    log("TUNED = {")
    for key, c in tuned.items():
        n, k = key.split("x")
        log(f"    ({n}, {k}): _C(block_n={c['block_n']}, block_k={c['block_k']}, split_k={c['split_k']}, "
            f"num_warps={c['num_warps']}, num_stages={c['num_stages']}),")
    log("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
