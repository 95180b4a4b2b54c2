"""Quantized linear kernels on the GPU: correctness, bandwidth, and a per-shape tile sweep.

Run with no arguments on a CUDA machine (written for an H200, PyTorch 2.11, Triton 3.6):

    python -m benchmarks.gpu.kernels_quant

In one process it
  1. measures copy bandwidth: a 2 GiB device-to-device copy, bytes read + written, median;
  2. for the drafter's matrices (weights [out, in] as stored) and M in {1, 16, 32}: checks the
     q8_0 / q4_0 kernels against `quant_linear_ref` with bf16 x (relative error, NaN, every
     element written, row invariance), times them with `triton.testing.do_bench` (median,
     rotating among enough weight copies that L2 never holds the one being read) and a bf16
     cuBLAS `F.linear` of the same shape, and reports achieved bandwidth
     (weight + x + out bytes / time) and its fraction of the copy bandwidth;
  3. sweeps tile configurations per (qtype, shape) at M = 16 under a time budget and reports the
     best next to the default (a config is chosen per shape, never per M: every M of a shape
     runs the same one), with a `TUNED` table to paste into kernels/quant_tuning.py.
The table is printed last; JSON goes to $OUT/kernels_quant.json when OUT is set. Per-shape and
per-config failures are caught and reported. Env: QUANT_BENCH_BUDGET_S (sweep budget, default
300), QUANT_BENCH_SWEEP=0 to skip the sweep.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import triton

from memra_kernels import quant_linear as ql
from memra_kernels import quant_pack as qp
from memra_kernels import quant_tuning as qt

from benchmarks import timing

# [out, in] as stored; the drafter's "in -> out" matrices: 4096->4096, 4096->1024, 4096->12288,
# 12288->4096, 20480->4096
SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (4096, 20480)]
MS = (1, 16, 32)
QTYPES = ("q8_0", "q4_0")
# QUANT_BENCH_SHAPES="4096x4096,6144x4096" and QUANT_BENCH_QTYPES="q8_0" narrow a run (the fused
# drafter's stacks are 6144x4096 qkv, 2048x4096 kv and 24576x4096 gate_up)
if os.environ.get("QUANT_BENCH_SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["QUANT_BENCH_SHAPES"].split(",")]
if os.environ.get("QUANT_BENCH_QTYPES"):
    QTYPES = tuple(os.environ["QUANT_BENCH_QTYPES"].split(","))
SWEEP_M = 16
# bf16 x against an f32 reference of the same bf16-rounded weights: only the accumulation order
# and the final bf16 rounding differ, so the relative L2 error sits near bf16's 2^-9
REL_TOL = 1e-2
L2_BYTES = 60 * 2**20  # H200: 60 MB (read from the device below when possible)


def log(*a) -> None:
    print(*a, flush=True)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    return timing.copy_gbps(2 * timing.GIB) * 1e9


def random_packed(qtype: str, n: int, k: int, gen: torch.Generator, device: str = "cuda") -> qp.Packed:
    """Random weights straight in the packed layout (what repacking real blocks gives), with
    scales so that the weights' magnitudes resemble a trained model's (~0.02), on `device`."""
    if qtype == "q8_0":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
        scale = 0.02 / 64
    else:
        q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int16).to(torch.uint8)
        scale = 0.02 / 4
    s = (torch.rand((n, k // 32), generator=gen) * scale + scale / 2).to(torch.float16)
    return qp.Packed(qtype, (n, k), q.to(device), s.to(device))


def copies_for(nbytes: int) -> int:
    """Enough copies that the rotation spans over 3x the L2 (each call reads a cold one)."""
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def check(qtype: str, packed: qp.Packed, cfg: qt.KernelConfig | None, gen) -> dict:
    """Kernel vs reference for every M, NaN-poisoned outputs, and row invariance (on the
    weight's device)."""
    n, k = packed.shape
    res = {}
    x_all = torch.randn((max(MS), k), generator=gen).to(packed.device, torch.bfloat16)
    y_all = None
    for m in MS:
        x = x_all[:m]
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=packed.device)
        y = ql.quant_linear(x, packed, config=cfg, out=out)
        ref = ql.quant_linear_ref(x, packed)
        rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        res[f"rel_err_m{m}"] = rel
        res[f"nan_m{m}"] = bool(torch.isnan(y).any())
        if m == max(MS):
            y_all = y
    # row invariance: each row alone (M = 1) is bit-identical to the same row inside M = 32
    inv = all(torch.equal(ql.quant_linear(x_all[i:i + 1], packed, config=cfg), y_all[i:i + 1])
              for i in (0, 7, max(MS) - 1))
    res["row_invariant"] = inv
    res["ok"] = (inv and not any(v for key, v in res.items() if key.startswith("nan_"))
                 and all(v < REL_TOL for key, v in res.items() if key.startswith("rel_err_")))
    return res


# one call(i) (i = which weight copy) as graph replays cycling through the copies: no launch
# overhead, and each call reads a copy that L2 no longer holds
graph_ms = timing.cycled_graph_ms


def time_kernel(copies: list[qp.Packed], m: int, cfg: qt.KernelConfig | None) -> float:
    k = copies[0].shape[1]
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    return graph_ms(lambda i: ql.quant_linear(x, copies[i], config=cfg), len(copies))


def eager_ms(copies: list[qp.Packed], m: int) -> tuple[float, float]:
    """(do_bench median of one eager call, host microseconds per call): launch overhead."""
    k = copies[0].shape[1]
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    i = [0]

    def step():
        i[0] = (i[0] + 1) % len(copies)
        ql.quant_linear(x, copies[i[0]])

    dev = timing.do_bench_ms(step)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        step()
    host_us = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    return dev, host_us


def time_cublas(n: int, k: int, m: int, ws: list[torch.Tensor]) -> float:
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
    return graph_ms(lambda i: F.linear(x, ws[i]), len(ws))


def kernel_info(packed: qp.Packed, cfg: qt.KernelConfig) -> dict:
    """Registers, spills, shared memory and a few markers of what Triton generated."""
    n, k = packed.shape
    x = torch.randn((16, k), device="cuda", dtype=torch.bfloat16)
    out = torch.empty((16, n), device="cuda", dtype=torch.bfloat16)
    kern = ql._launch(x, packed, cfg, out)
    torch.cuda.synchronize()
    info = {"regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None),
            "shared": getattr(getattr(kern, "metadata", None), "shared", None)}
    asm = getattr(kern, "asm", {}) or {}
    ttgir, ptx = asm.get("ttgir", ""), asm.get("ptx", "")
    for key, text, pat in [("async_copy", ttgir, "async_copy_global_to_local"),
                           ("convert_layout", ttgir, "convert_layout"),
                           ("wgmma", ptx, "wgmma.mma_async"), ("mma_sync", ptx, "mma.sync"),
                           ("ld_v4", ptx, "ld.global.v4"), ("cp_async", ptx, "cp.async.cg"),
                           ("ldmatrix", ptx, "ldmatrix")]:
        info[key] = text.count(pat)
    return info


def traffic(packed: qp.Packed, m: int) -> int:
    n, k = packed.shape
    return packed.nbytes + m * k * 2 + m * n * 2


def candidates(qtype: str, n: int, k: int) -> list[qt.KernelConfig]:
    """A few tile shapes and variants for one weight, each with the split count that gives
    about two programs per multiprocessor (all fixed per shape, never per M)."""
    out = []
    # narrow tiles, little or no split: enough programs from the output axis alone, so a call
    # pays no split-K reduction (its atomics and the last program's sum), which dominates the
    # small matrices (a fixed cost per call: docs/tuning.md#quantized-linear); tried first
    for bn in (16, 32):
        for bk in (256, 512):
            for split in (1, 2, 4):
                if split * bk <= k and (n // bn) * split >= 128 and (split == 1 or (n // bn) * split // 2 < 128):
                    out.append(qt.KernelConfig(block_m=16, block_n=bn, block_k=bk, split_k=split,
                                               num_warps=4))
    # dequantize-first (one FMA a weight), both orientations
    grid = [(bn, bk, sw, False) for bn in (64, 128) for bk in (128, 256) for sw in (False, True)]
    if qtype == "q4_0":  # and a few scale-after-dot (packed nibble conversion) shapes
        grid += [(64, 128, False, True), (128, 128, True, True), (128, 256, False, True)]
    for bn, bk, sw, sa in grid:
        n_tiles, k_tiles, split = -(-n // bn), k // bk, 1
        while n_tiles * split < 264 and split * 2 <= k_tiles:
            split *= 2
        out.append(qt.KernelConfig(block_m=16, block_n=bn, block_k=bk, split_k=split,
                                   scale_after_dot=sa, swap_ab=sw,
                                   num_warps=8 if bn == 256 else 4))
    return out


def refinements(best: qt.KernelConfig, k: int) -> list[qt.KernelConfig]:
    """Neighbours of the sweep's best: warps, stages, block_m, split halved/doubled."""
    def with_(**kw):
        return best.__class__(**{**best.__dict__, **kw})

    r = [with_(num_warps=4 if best.num_warps == 8 else 8), with_(num_stages=2),
         with_(num_stages=4), with_(block_m=32 if best.block_m == 16 else 16)]
    if best.split_k > 1:
        r.append(with_(split_k=best.split_k // 2))
    if best.split_k * 2 <= k // best.block_k:
        r.append(with_(split_k=best.split_k * 2))
    return r


def cfg_str(c: qt.KernelConfig | None) -> str:
    if c is None:
        return "-"
    return (f"m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} "
            f"st{c.num_stages}{' sa' if c.scale_after_dot else ''}{' sw' if c.swap_ab else ''}")


def sweep(qtype, n, k, copies, deadline, gen) -> tuple[qt.KernelConfig | None, list]:
    """Time the current config and the candidates at M = SWEEP_M until the deadline; each must
    pass `check` (reference, NaN, row invariance) to count."""
    tried, done = [], set()

    def run(c):
        if time.time() > deadline or c in done:
            return
        done.add(c)
        try:
            ok = check(qtype, copies[0], c, gen)
            if not ok["ok"]:
                tried.append({"config": c.__dict__, "error": f"check failed: {ok}"})
                return
            tried.append({"config": c.__dict__, "ms": time_kernel(copies, SWEEP_M, c)})
        except Exception as e:  # a config that does not compile or run is reported, not fatal
            tried.append({"config": c.__dict__, "error": f"{type(e).__name__}: {str(e)[:300]}"})

    for c in [qt.config_for(qtype, n, k)] + candidates(qtype, n, k):
        run(c)
    timed = [t for t in tried if "ms" in t]
    if timed:
        best = qt.KernelConfig(**min(timed, key=lambda t: t["ms"])["config"])
        for c in refinements(best, k):
            run(c)
    timed = [t for t in tried if "ms" in t]
    if not timed:
        return None, tried
    return qt.KernelConfig(**min(timed, key=lambda t: t["ms"])["config"]), tried


def main() -> int:
    global L2_BYTES
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 1
    props = torch.cuda.get_device_properties(0)
    L2_BYTES = getattr(props, "L2_cache_size", L2_BYTES) or L2_BYTES
    budget = float(os.environ.get("QUANT_BENCH_BUDGET_S", "300"))
    do_sweep = os.environ.get("QUANT_BENCH_SWEEP", "1") != "0"
    log(f"device {props.name}, {props.multi_processor_count} SMs, L2 {L2_BYTES / 2**20:.0f} MiB, "
        f"torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    log(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    t_start = time.time()
    results = []
    n_jobs = len(SHAPES) * len(QTYPES)
    for qi, qtype in enumerate(QTYPES):
        for si, (n, k) in enumerate(SHAPES):
            job = qi * len(SHAPES) + si
            rec = {"qtype": qtype, "out": n, "in": k}
            try:
                first = random_packed(qtype, n, k, gen)
                copies = [first] + [qp.Packed(qtype, (n, k), first.qweight.clone(),
                                              first.scales.clone())
                                    for _ in range(copies_for(first.nbytes) - 1)]
                default = qt.config_for(qtype, n, k)
                rec["default_config"] = default.__dict__
                rec["check"] = check(qtype, first, None, gen)
                log(f"{qtype} [{n}, {k}] default {cfg_str(default)}: check {rec['check']}")
                best, tried = default, []
                if do_sweep:
                    # share the remaining budget among the remaining (qtype, shape) jobs
                    left = budget - (time.time() - t_start)
                    deadline = time.time() + max(0.0, left / (n_jobs - job))
                    found, tried = sweep(qtype, n, k, copies, deadline, gen)
                    rec["sweep"] = tried
                    if found is not None:
                        best = found
                    for t in tried:
                        log(f"    {cfg_str(qt.KernelConfig(**t['config'])):36s} "
                            + (f"{t['ms'] * 1e3:8.1f} us" if "ms" in t else t["error"][:160]))
                rec["best_config"] = best.__dict__
                for name, c in (("default", default), ("best", best)):
                    try:
                        rec[f"{name}_info"] = kernel_info(first, c)
                        log(f"  {name} {cfg_str(c)}: {rec[f'{name}_info']}")
                    except Exception as e:
                        log(f"  {name} kernel_info failed: {type(e).__name__}: {e}")
                dev, host = eager_ms(copies, 16)
                rec["eager_m16"] = {"do_bench_us": dev * 1e3, "host_us_per_call": host}
                log(f"  eager M=16 (default): do_bench {dev * 1e3:.1f} us, host {host:.1f} us/call")
                rec["m"] = {}
                for m in MS:
                    td = time_kernel(copies, m, None)
                    tb = td if best == default else time_kernel(copies, m, best)
                    b = traffic(first, m)
                    rec["m"][m] = {"default_us": td * 1e3, "best_us": tb * 1e3, "bytes": b,
                                   "default_frac": b / (td * 1e-3) / bw,
                                   "best_frac": b / (tb * 1e-3) / bw}
                del copies, first
                torch.cuda.empty_cache()
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                log(f"{qtype} [{n}, {k}] FAILED: {rec['error']}")
                traceback.print_exc()
            results.append(rec)

    # cuBLAS bf16 of the same shapes, for scale
    cublas = {}
    for n, k in SHAPES:
        try:
            w0 = torch.randn((n, k), device="cuda", dtype=torch.bfloat16)
            ws = [w0] + [w0.clone() for _ in range(copies_for(w0.numel() * 2) - 1)]
            for m in MS:
                t = time_cublas(n, k, m, ws)
                b = n * k * 2 + m * k * 2 + m * n * 2
                cublas[(n, k, m)] = (t * 1e3, b / (t * 1e-3) / bw)
            del ws, w0
            torch.cuda.empty_cache()
        except Exception as e:
            log(f"cuBLAS [{n}, {k}] FAILED: {type(e).__name__}: {e}")

    # ---- the table, last -------------------------------------------------------------------
    log("")
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s; frac = (weight + x + out bytes) / time / copy bw")
    log(f"{'qtype':5s} {'[out, in]':>13s} {'M':>3s} {'default us':>10s} {'frac':>5s} "
        f"{'best us':>8s} {'frac':>5s} {'bf16 cuBLAS us':>14s} {'frac':>5s}  check  best config")
    tuned = []
    for rec in results:
        n, k = rec["out"], rec["in"]
        if "error" in rec:
            log(f"{rec['qtype']:5s} {str([n, k]):>13s}  FAILED: {rec['error'][:100]}")
            continue
        for m in MS:
            r = rec["m"][m]
            cb = cublas.get((n, k, m), (float("nan"), float("nan")))
            log(f"{rec['qtype']:5s} {str([n, k]):>13s} {m:3d} {r['default_us']:10.1f} "
                f"{r['default_frac']:5.2f} {r['best_us']:8.1f} {r['best_frac']:5.2f} "
                f"{cb[0]:14.1f} {cb[1]:5.2f}  {'ok' if rec['check']['ok'] else 'FAIL':5s}  "
                f"{cfg_str(qt.KernelConfig(**rec['best_config']))}")
        tuned.append(f"    ({rec['qtype']!r}, {n}, {k}): KernelConfig(" + ", ".join(
            f"{key}={val!r}" for key, val in rec["best_config"].items()) + "),")
    log("")
    log("TUNED = {")
    for line in tuned:
        log(line)
    log("}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        payload = {
            "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
            "copy_bw_gbs": bw / 1e9, "results": results,
            "cublas_bf16": [{"out": n, "in": k, "m": m, "us": v[0], "frac": v[1]}
                            for (n, k, m), v in cublas.items()],
        }
        with open(os.path.join(out_dir, "kernels_quant.json"), "w") as f:
            json.dump(payload, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
