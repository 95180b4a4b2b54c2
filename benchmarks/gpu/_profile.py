"""The benchmarks' per-kernel table: what the GPU ran for one call, grouped by kernel name."""

from __future__ import annotations

import torch


def kernel_table(fn, top: int = 30) -> dict:
    """The CUDA kernels of one call of `fn` (called once before, to warm up) under the torch
    profiler, grouped by name: `kernels` (launches), `gpu_us` (summed), `top` [[name, count,
    µs]] by time. Graph replays show their kernels too. With programmatic dependent launch on,
    an early-launched kernel is charged its wait (MEMRA_PDL=0 for kernel times alone)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"kernels": sum(e.count for e in rows), "gpu_us": round(sum(e.self_device_time_total for e in rows), 1),
            "top": [[e.key[:90], e.count, round(e.self_device_time_total, 1)] for e in rows[:top]]}
