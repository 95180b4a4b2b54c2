"""`cuda_graphs.capture` holds Python's cycle collector off from its warm-ups to its capture's end:
a collection there could destroy another (dead) graph mid-capture, which CUDA forbids while a
stream captures (runtime/cuda_graphs.py's docstring).

On the CPU, torch.cuda is a stand-in that records whether the collector ran while `fn` ran; the
gpu-marked test builds the failure itself: a captured graph in a dead reference cycle, and a
capture whose allocations set off collections."""

from __future__ import annotations

import contextlib
import gc
import types

import pytest
import torch

from memra_cli.engine.runtime import cuda_graphs


def _fake_cuda(seen: list[str]):
    """torch.cuda as far as `capture` uses it, logging the collector's state at each stage."""

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.append(f"capture begins, collector {'on' if gc.isenabled() else 'off'}")
        yield
        seen.append("capture ends")

    stream = types.SimpleNamespace(wait_stream=lambda s: None)
    return types.SimpleNamespace(Stream=lambda device: stream, current_stream=lambda device: stream,
                                 stream=lambda s: contextlib.nullcontext(), CUDAGraph=lambda: "graph", graph=graph)


@pytest.fixture
def collector_on():
    """The collector on for the test (pytest may run with it either way) and as it was after."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_through_warm_ups_and_capture_and_back_on_after(monkeypatch, collector_on):
    seen: list[str] = []
    monkeypatch.setattr(cuda_graphs.torch, "cuda", _fake_cuda(seen))

    def fn():
        seen.append(f"fn, collector {'on' if gc.isenabled() else 'off'}")
        return "out"

    assert cuda_graphs.capture(fn, "cpu") == ("graph", "out")
    assert seen == ["fn, collector off", "fn, collector off", "capture begins, collector off",
                    "fn, collector off", "capture ends"]
    assert gc.isenabled()


def test_a_failing_capture_turns_the_collector_back_on(monkeypatch, collector_on):
    monkeypatch.setattr(cuda_graphs.torch, "cuda", _fake_cuda([]))

    def fn():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        cuda_graphs.capture(fn, "cpu")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(monkeypatch):
    monkeypatch.setattr(cuda_graphs.torch, "cuda", _fake_cuda([]))
    was = gc.isenabled()
    gc.disable()
    try:
        cuda_graphs.capture(lambda: None, "cpu")
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


class _Cycle:
    """An object that refers to itself, so only the cycle collector frees it (and what it holds)."""

    def __init__(self, held):
        self.held = held
        self.me = self


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_dead_graph_in_a_cycle_survives_a_capture_that_allocates(collector_on):
    """The capture's third run (the recorded one) drops the last reference to a cycle holding an
    earlier graph, then makes enough objects to set the collector off: with the collector on, the
    earlier graph's destruction would land inside the capture and invalidate it."""
    x = torch.zeros(1024, device="cuda")
    earlier, _ = cuda_graphs.capture(lambda: x.add_(1), x.device)
    parked = [earlier]
    del earlier
    runs = []

    def fn():
        runs.append(1)
        if len(runs) == 3:  # inside the capture
            _Cycle(parked.pop())
            junk = [[] for _ in range(200_000)]  # many collections' worth of allocations
            assert len(junk) == 200_000
        return x * 2

    graph, out = cuda_graphs.capture(fn, x.device)
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 6))
    gc.collect()  # the cycle, and the earlier graph, go now
