"""Per-session target state: the static KV cache of a dense (full-attention) model.

Rollback belongs to the state: `rollback(n_keep)` is how the round loop forgets rejected rows.
For K/V that only moves `length` (rows past it are stale and the next write overwrites them); a
recurrent model's state restores a kept snapshot instead, behind the same call
(models/qwen3_5.py `Qwen35State`). `commit(end)` is how the step runner keeps the real rows of a
fixed-width step.
"""

from __future__ import annotations

import torch

from memra_cli.engine.models.state import LiveRows, StateBase


class KVCache(StateBase):
    """Static K/V for one session: `kv [n_layers, 2, n_kv, max_len, head_dim]`.

    Heads before positions so each layer's `kv[l, 0, :, :end]` is what attention reads, with no
    transpose. `length` (a python int) is how many leading positions are valid. `graphs` holds
    the CUDA graphs captured over this storage (runtime/graphs.py): they live and die with it.
    """

    host_bookkeeping = True  # commit / rollback only move `length` (padding rows leave no trace)
    round_graphs_ok = True  # a commit after a round graph's replay needs no host read of the device
    # Set by the step runner around an eager fixed-width step: the positions `[0, live_keys)` it
    # can attend (its last row + 1), so the CPU's attention reads only those; None (a graph
    # body): the whole storage.
    live_keys: int | None = None

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.kv = torch.zeros(n_layers, 2, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.graphs: dict = {}

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def rollback(self, n_keep: int) -> None:
        """Keep the first `n_keep` positions (no copy: later rows are simply overwritten)."""
        if not 0 <= n_keep <= self.length:
            raise ValueError(f"cannot roll a KV cache of length {self.length} back to {n_keep}")
        self.length = n_keep

    def commit(self, end: int, step_continues: bool = False) -> None:
        """After a fixed-width step at `length`: positions up to `end` hold real rows (the
        padding rows' K/V past it are stale and overwritten later). `step_continues` (another
        chunk of the same step follows) matters only to a recurrent state."""
        if not self.length <= end <= self.max_len:
            raise ValueError(f"cannot commit a KV cache of length {self.length} to {end} (storage {self.max_len})")
        self.length = end

    def reset(self) -> None:
        self.length = 0


def ring_rows(window: int, span: int) -> int:
    """Rows of a ring storage for a sliding window of `window` keys whose writes come at most
    `span` rows at a time (a prefill chunk, or a fixed-width step with its padding rows). A
    write of positions p..p+span-1 lands on the rows of positions p-R..p+span-1-R, and a
    written row at p+i reads back to p+i-window+1 >= p-window+1; so R >= window + span - 1
    keeps every key a written row reads, and a rolled-back row's stale values sit at
    positions the next write overwrites first. One row more than that bound."""
    return window + span


class LayerKVCache(StateBase):
    """Static K/V for one session of a model whose layers differ in K/V shape (Gemma 4: sliding
    and full layers with their own head dims and head counts, KV-shared layers with none).

    `kv[l]` is layer l's `[2, n_kv_l, rows_l, head_dim_l]`, or None for a layer that reads
    another's. `rows_l` is `max_len`, or `rows_of[l]` when that is smaller: a ring holding
    position j at row j % rows_l, so that a sliding layer keeps its window (and the rows one
    write adds: `ring_rows`) rather than every position. Bookkeeping is `KVCache`'s: `length`
    only (a later write overwrites a rolled-back row, in a ring too), so rollback and commit
    only move it.
    """

    host_bookkeeping = True
    round_graphs_ok = True

    def __init__(self, shapes: list[tuple[int, int] | None], max_len: int, dtype: torch.dtype, device: torch.device,
                 rows_of: list[int | None] | None = None):
        rows = [max_len if r is None or r >= max_len else r for r in (rows_of or [None] * len(shapes))]
        self.kv = [None if s is None else torch.zeros(2, s[0], n, s[1], dtype=dtype, device=device)
                   for s, n in zip(shapes, rows)]
        self.max_len = max_len
        self.length = 0
        self.graphs: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv if t is not None)

    rollback = KVCache.rollback
    commit = KVCache.commit
    reset = KVCache.reset


class LiveKVCache(LiveRows, KVCache):
    """`KVCache` with a fixed step's live-row count on the device (`LiveRows`): a mixture-of-experts
    family routes its padding rows to no expert (models/experts.py `LiveRouting`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_live_rows(self.kv.device)

    def reset(self) -> None:
        KVCache.reset(self)
        self.set_live_rows(None)


class LiveLayerKVCache(LiveRows, LayerKVCache):
    """`LayerKVCache` with a fixed step's live-row count on the device (as `LiveKVCache`)."""

    def __init__(self, shapes, max_len: int, dtype: torch.dtype, device: torch.device,
                 rows_of: list[int | None] | None = None):
        super().__init__(shapes, max_len, dtype, device, rows_of)
        self._init_live_rows(device)

    def reset(self) -> None:
        LayerKVCache.reset(self)
        self.set_live_rows(None)
