"""CUDA graphs of the drafter's side of a round: the proposal, and the ingest of kept rows.

Once the target's steps are graphed, an eager drafter round costs more than the graphed target
step it feeds. The forward is a few layers, then the lm_head, a 16-step markov chain and the
confidence head, and the ingest comes after. Each is hundreds of launches of microsecond
kernels. Both parts have static shapes in `Drafter.static_round` / `static_ingest`. Row index
equals position in a session's draft cache, and the committed length arrives as a device tensor.
So each part is captured once per cache storage and replayed every round.

- `ProposeGraph`: `last [1]`, `start` -> drafts `[n_drafts]` (+ confidence raws). It runs the
  same ops as `DrafterProposer.propose` (spec/proposer.py `static_proposal`), with the static
  round in place of `forward_round`. Keyed on the storage by program and whether raws are
  wanted; it reads the drafter, the target and its own buffers, never a session's.
- `IngestGraph`: exactly `b` tap rows at `start..start+b-1`. The session keeps `m+1 <= b` of
  them. The padding rows land at positions the next round's block K/V overwrite before any
  query can see them. The prompt's ingest is one too, over its prefill bucket's rows (the
  same padding argument: a block at `t` attends keys up to `t+b-1` only, and later ingests
  overwrite the rest before any block reaches them).

A quantized drafter's graphs are captured with every kernel in plain stream order (the step ops'
`plain_launches`): on the H200 its side of a round was slower with programmatic dependent launch
than without, where a bf16 drafter's was level (docs/tuning.md#quantized-drafter-launches).

Warm-up and capture write at the storage's block slack `[cap, cap+b)`, which never holds
committed rows. Drafts never decide a committed token: the target does. So a graphed proposal
that differed from an eager one in the last bits would cost acceptance, never exactness.
`tests/engine/test_step_width.py` checks that the static path drafts what the eager one does.
"""

from __future__ import annotations

import contextlib

import torch

from memra_cli.engine.runtime import cuda_graphs


def _launch_order(drafter):
    """The launch order a drafter's graphs are captured in (see the module docstring)."""
    return drafter.step_ops.plain_launches() if drafter.quantized else contextlib.nullcontext()


class ProposeGraph:
    """One round's proposal over one draft cache storage, captured once."""

    def __init__(self, body, drafter, target, program, kv, want_raws: bool):
        """`body(drafter, target, program, kv, last, mask_ids, start, want_raws)` is the static
        proposal (spec/proposer.py `static_proposal`), passed in so runtime never imports spec."""
        dev = target.device
        # Every tensor the graph reads must outlive it: the graph stays with the pooled storage
        # while the session that captured it ends. So the graph owns its inputs, the block's
        # mask ids included.
        cfg = drafter.cfg
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.mask_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.start = torch.tensor(kv.cap, dtype=torch.long, device=dev)  # capture in the slack
        with _launch_order(drafter):
            self.graph, self.out = cuda_graphs.capture(
                lambda: body(drafter, target, program, kv, self.last, self.mask_ids, self.start, want_raws), dev)

    def run(self, last: torch.Tensor, start: int):
        self.last.copy_(last.reshape(1))
        self.start.fill_(start)
        self.graph.replay()
        drafts, raws = self.out[:2]  # the body's Heads: drafts, raws, ...
        return drafts.clone(), (None if raws is None else raws.clone())


class IngestGraph:
    """The ingest of `rows` rows of taps (default: a block) over one draft cache storage,
    captured once.

    A round's ingest captures in the block slack. The prompt's ingest (`rows` a prefill bucket,
    larger than the slack) captures at row 0: it is captured when a session starts on an empty
    cache, and its first replay, right after, overwrites those rows with the prompt's."""

    def __init__(self, drafter, kv, taps_width: int, rows: int | None = None, capture_start: int | None = None):
        dev = drafter.device
        rows = drafter.cfg.block_size if rows is None else rows
        self.taps = torch.zeros(rows, taps_width, dtype=drafter.dtype, device=dev)
        self.start = torch.tensor(kv.cap if capture_start is None else capture_start, dtype=torch.long, device=dev)
        with _launch_order(drafter):
            self.graph, _ = cuda_graphs.capture(lambda: drafter.static_ingest(kv, self.taps, self.start), dev)

    def run(self, taps: torch.Tensor, start: int) -> None:
        n = taps.shape[0]
        self.taps[:n].copy_(taps)
        if n < self.taps.shape[0]:
            self.taps[n:].copy_(taps[-1:].expand(self.taps.shape[0] - n, -1))
        self.start.fill_(start)
        self.graph.replay()
