"""CUDA graphs of the target's fixed-width step.

A decode or verify step of a small target is launch-bound: hundreds of kernels of a few
microseconds each, queued by Python slower than the GPU runs them. A model's `static_step`
has static shapes and takes its positions as a device tensor, so one capture replays every later
step of a session with a single launch (the step runner, runtime/steps.py, decides when).

A graph binds the addresses it was captured with: the cache storage (K/V), the rope tables (made
once at full length when graphs are switched on, never replaced), the weights, and its own input
and output buffers: nothing it reads may belong to a session. So there is one graph per state
storage and taps tuple, kept on the storage (`state.graphs`). With graphs on, states come from
the runtime's pool, so the next session reuses the storage and its graphs rather than capturing
again; a storage the pool evicts takes its graphs with it.

The warm-up and the capture write K/V at the storage's last `W` positions. That slack is never
real context: the runner adds `W` rows beyond what a session may fill. A replay runs the same
kernels on the same shapes as an eager `static_step`, so its logits are bit-identical to the
eager step's (a `gpu`-marked test checks it).
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.runtime import cuda_graphs


class StepGraph:
    """`static_step` over one cache storage, captured once, replayed per step."""

    def __init__(self, model, width: int, cache, taps: Sequence[int]):
        self.width = width
        dev = model.device
        self._arange = torch.arange(width, device=dev)
        self.ids = torch.zeros(width, dtype=torch.long, device=dev)
        # capture at the slack rows: nothing real lives there (see the module docstring)
        self.positions = self._arange + (cache.max_len - width)
        taps = tuple(taps) or None
        self.graph, (self.logits, self.taps) = cuda_graphs.capture(
            lambda: model.static_step(self.ids, self.positions, cache, taps), dev)

    def run(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step `ids [W]` at `start..start+W-1`: (logits `[W, vocab]`, taps or None), copied
        out of the graph's buffers so the caller may keep them past the next replay."""
        self.ids.copy_(ids)
        torch.add(self._arange, start, out=self.positions)
        self.graph.replay()
        return self.logits.clone(), (None if self.taps is None else self.taps.clone())
