"""The benchmarks' one timing module: CUDA-event timing, graph timing, bandwidth probes, kernel
tables. Every script under benchmarks/ times through these, so two numbers in docs/perf.md are
always measured the same way.

- `median_ms(fn, reps)`: median of per-call CUDA-event times (graph replays, whole steps);
  perf_counter on the CPU, so the smoke tests run the same code path.
- `mean_ms(fn, reps)`: `reps` calls back to back between two events (no sync in between).
- `wall_ms(fn, reps)`: host wall time per call, synchronised at both ends.
- `graph_ms(fns, reps)`: the calls `fns` captured back to back in one CUDA graph, median GPU ms
  per call (no launch overhead in the number).
- `cycled_graph_ms(call, n_copies)`: one graph of calls cycling over weight copies, so each call
  reads a copy L2 no longer holds (the kernels' sweeps).
- `do_bench_ms(fn)`: triton.testing.do_bench's median (L2 flushed between eager calls).
- `copy_gbps(nbytes)`: device-to-device copy, GB/s counting bytes read plus written.
- `read_gbps(nbytes)`: a reduction over a large buffer: the read floor a weight stream can reach.
- `kernel_table(fn)`: the CUDA kernels of one call, grouped by name (torch profiler).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from memra_cli.engine.runtime.cuda_graphs import no_cycle_collection

GIB = 1 << 30


def median(xs: Sequence[float]) -> float:
    """The upper median (the middle element of the sorted list)."""
    return float(sorted(xs)[len(xs) // 2])


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU when there is one (a no-op on the CPU)."""
    if torch.device(device or "cuda").type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def _cuda(device: torch.device | str | None) -> bool:
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3,
              device: torch.device | str | None = None) -> float:
    """Median ms of one `fn()`: CUDA events around each call on CUDA, perf_counter on the CPU
    (`device` None: CUDA when available)."""
    for _ in range(warmup):
        fn()
    times = []
    if _cuda(device):
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return median(times)


def mean_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """GPU ms per call of `fn` run `reps` times back to back between two events (no host sync
    in between, so host work overlaps the GPU's as in a decode loop)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def wall_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Host wall-clock ms per call of `fn`, the device synchronised before and after the reps."""
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) * 1e3 / reps


def _warm_off_capture(fns: Sequence[Callable[[], object]]) -> None:
    """Run the calls once eagerly and once on a side stream (Triton compiles, allocator pools)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def graph_ms(fns: Callable[[], object] | Sequence[Callable[[], object]], reps: int = 20) -> float:
    """Median GPU ms per call of the calls `fns` (one callable, or e.g. one per layer over
    distinct caches) captured back to back in one CUDA graph: the engine's replayed steps, no
    host launch overhead in the number."""
    fns = [fns] if callable(fns) else list(fns)
    _warm_off_capture(fns)
    graph = torch.cuda.CUDAGraph()
    with no_cycle_collection(), torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = median_ms(graph.replay, reps, warmup=1, device="cuda") / len(fns)
    del graph
    return ms


def cycled_graph_ms(call: Callable[[int], object], n_copies: int, min_calls: int = 48) -> float:
    """Median ms of one `call(i)` (i = which weight copy), timed as graph replays of at least
    `min_calls` calls cycling through the copies: each call reads a copy that L2 no longer holds."""
    reps = n_copies * max(1, math.ceil(min_calls / n_copies))
    _warm_off_capture([lambda i=i: call(i) for i in range(n_copies)])
    graph = torch.cuda.CUDAGraph()
    with no_cycle_collection(), torch.cuda.graph(graph):
        for r in range(reps):
            call(r % n_copies)
    ms = do_bench_ms(graph.replay) / reps
    del graph
    return ms


def do_bench_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 60) -> float:
    """Median ms of one eager `fn()` by triton.testing.do_bench (L2 flushed between calls).
    Includes the host's launch overhead whenever that exceeds the GPU time."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_gbps(nbytes: int = 2 * GIB, reps: int = 50, graphed: bool = False,
              device: torch.device | str = "cuda") -> float:
    """GB/s of a device-to-device copy of `nbytes`, counting bytes read plus bytes written
    (median of `reps` event-timed calls; `graphed`: the copy replayed as a CUDA graph)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if graphed and torch.device(device).type == "cuda":
        ms = graph_ms(lambda: dst.copy_(src), reps)
    else:
        ms = median_ms(lambda: dst.copy_(src), reps, warmup=5, device=device)
    del src, dst
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def read_gbps(nbytes: int = 2 * GIB, reps: int = 50, device: torch.device | str = "cuda") -> float:
    """GB/s read by a sum over a `nbytes` bf16 buffer: one read of every byte and almost no
    writes, the floor a weight-streaming step can reach (a copy also writes)."""
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    ms = median_ms(lambda: buf.sum(dtype=torch.float32), reps, warmup=5, device=device)
    del buf
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3) / 1e9


def kernel_table(fn: Callable[[], object], top: int = 30) -> dict:
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
