"""The one place that captures CUDA graphs (target steps: runtime/graphs.py; drafter rounds:
runtime/draft_graphs.py; graphs a state replays inside its own methods: `GraphCache`).

`capture(fn, device)` warms `fn` up twice on a side stream, which runs lazy inits such as cuBLAS
handles and workspaces outside the capture (uncounted by an MoE target's expert counter:
layers/moe.py `not_counted`, so the bench counts what the replays ran). It then records `fn` into a graph and returns
`(graph, fn's outputs)`. `graph.replay()` reruns the recorded kernels, which write into those
same output tensors.

Python's cycle collector is off from the warm-ups to the capture's end. A runner's pool dies
with its runner (runtime/pool.py), and its graphs with it; were that runner in a reference
cycle, a collection set off by the capture's own allocations would destroy a graph
mid-capture, which CUDA forbids while a stream captures (the capture fails with
cudaErrorStreamCaptureInvalidated). Dead cycles are collected after the capture instead.

Tests swap this function for an eager stand-in (`graph.replay()` calls `fn` again and copies the
results into the first outputs). The replay plumbing of every graph (input buffers, padding,
pooled storages, copies out) then runs on the CPU too.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator

import torch

from memra_cli.engine.layers.moe import not_counted


def capture(fn: Callable[[], Any], device: torch.device, pool=None) -> tuple[Any, Any]:
    """Capture `fn` (no host syncs, no host-to-device copies, static shapes) as a CUDA graph.

    `pool` (from `torch.cuda.graph_pool_handle()`): a memory pool shared with other graphs, for
    graphs that never replay at the same time and whose outputs are copied out after each
    replay (the prefill graphs): their intermediates then take one graph's memory, not the sum."""
    with no_cycle_collection():
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), not_counted():
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off inside (module docstring: a collection may free another
    graph, which a capture in progress cannot survive), back as it was after, on error too."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class GraphCache:
    """The graphs a state replays inside its own methods (models/state.py `graphed_restores`:
    Qwen35State's rollback restores), one per key: the state declares each body, this captures it
    on first use and replays it after. `StepRunner.new_state` hands every such state one, so a
    pooled storage keeps its graphs with it.

    A first use runs the body through the capture's warm-up and does not replay it: the body
    must be one whose second run changes nothing (a restore reads only its sources)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graphs: dict = {}  # key -> (graph, body): the body's tensors outlive the graph reading them

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, build: Callable[..., Callable[[], Any]], *args) -> None:
        """Replay `key`'s graph; the first time, capture `build(*args)` (the body) as it."""
        entry = self._graphs.get(key)
        if entry is not None:
            entry[0].replay()
            return
        body = build(*args)
        graph, _ = capture(body, self.device)
        self._graphs[key] = (graph, body)
