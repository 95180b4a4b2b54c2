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

The warm-up and the capture write K/V at the positions of the step about to run (`start`, at or
past the committed length): rows no real context holds yet, which that step's replay then
rewrites, all W of them. The storage's last W positions (the slack the runner adds for padding)
would do for a storage that keeps every position, but not for a sliding layer's ring, where
every position's row is some live position's too (docs/gemma4.md, "Sliding layers' storage").
A replay runs the same kernels on the same shapes as an eager `static_step`, so its logits are
bit-identical to the eager step's (a `gpu`-marked test checks it).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch

from memra_cli.engine.models.experts import LiveRouting
from memra_cli.engine.runtime import cuda_graphs


class StepGraph:
    """`static_step` over one cache storage, captured once, replayed per step.

    A state whose fixed step can run over several arrangements of its buffers (`graph_variants`,
    e.g. the hybrid's two committed-state buffers, flipped by a commit instead of copied) gets one
    capture per arrangement, made under `cache.arranged_for_capture(v)`, sharing one memory pool
    and the input buffers; `run` replays the one `cache.graph_variant` names."""

    def __init__(self, model, width: int, cache, taps: Sequence[int], start: int):
        self.width = width
        self.cache = cache
        dev = model.device
        self._arange = torch.arange(width, device=dev)
        self.ids = torch.zeros(width, dtype=torch.long, device=dev)
        # capture at the step about to run (`start`): rows its replay rewrites (module docstring)
        self.positions = self._arange + start
        taps = tuple(taps) or None
        n = cache.graph_variants
        pool = torch.cuda.graph_pool_handle() if n > 1 and dev.type == "cuda" else None
        self.graphs, self.outputs = [], []
        for variant in range(n):
            with cache.arranged_for_capture(variant) if n > 1 else nullcontext():
                graph, out = cuda_graphs.capture(
                    lambda: model.static_step(self.ids, self.positions, cache, taps), dev, pool=pool)
            self.graphs.append(graph)
            self.outputs.append(out)

    def run(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step `ids [W]` at `start..start+W-1`: (logits `[W, vocab]`, taps or None), copied
        out of the graph's buffers so the caller may keep them past the next replay."""
        self.ids.copy_(ids)
        torch.add(self._arange, start, out=self.positions)
        variant = self.cache.graph_variant
        self.graphs[variant].replay()
        logits, taps = self.outputs[variant]
        return logits.clone(), (None if taps is None else taps.clone())

    @property
    def graph(self):
        """The capture of the state's current arrangement (benchmarks time its replay)."""
        return self.graphs[self.cache.graph_variant]


class PrefillGraph:
    """A one-chunk prefill of `rows` positions (the prompt padded up to its bucket) over one
    cache storage, captured once, replayed per session.

    Why: on a small target the prefill is an eager chain of a few hundred launches, queued by
    Python far slower than the GPU runs them, and every arm of a bench pays it once per prompt
    (docs/tuning.md#prefill-graphs).

    The prompt `ids [t]` is padded to `rows` by repeating its last id. Padding rows come after
    the real ones, so causality hides them from every real row, and their K/V land at positions
    `t..rows-1`, which the decode writes before any query reads them (the step-width argument of
    runtime/steps.py); `run` sets `cache.length = t`. Only the last real row goes through the
    lm_head (its index is a device input), and the taps of the real rows come back. A replay
    runs the kernels of an eager `model.forward` of the padded ids: the same bits (a gpu-marked
    test checks it). Every arm of a session prefills through this same graph, so the padding
    changes no comparison the exactness gate makes.
    """

    def __init__(self, model, rows: int, cache, taps: Sequence[int], pool=None):
        self.rows = rows
        self.cache = cache
        dev = model.device
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.last_row = torch.zeros(1, dtype=torch.long, device=dev)
        self.live = torch.full((1,), rows, dtype=torch.int32, device=dev)  # the real rows (`run` writes it)
        taps = tuple(taps) or None
        # an MoE target's padding rows route to no expert (models/experts.py `LiveRouting`)
        forward = model.forward if not isinstance(model, LiveRouting) else (
            lambda *a: model.padded_forward(*a, live=self.live))

        def body():
            hidden, tapped = forward(self.ids, 0, cache, taps)
            return model.logits(hidden.index_select(0, self.last_row)), tapped

        self.graph, (self.logits, self.taps) = cuda_graphs.capture(body, dev, pool=pool)

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill `ids [t]` (t <= rows) from position 0: (float32 logits of row t-1 `[1, vocab]`,
        taps of the real rows `[t, n_taps*hidden]` or None), copies safe to keep."""
        t = ids.shape[0]
        self.ids[:t].copy_(ids)
        self.ids[t:].copy_(ids[-1:].expand(self.rows - t))
        self.last_row.fill_(t - 1)
        self.live.fill_(t)
        self.graph.replay()
        self.cache.length = t
        return self.logits.clone(), (None if self.taps is None else self.taps[:t].clone())
