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


class LayerKVCache(StateBase):
    """Static K/V for one session of a model whose layers differ in K/V shape (Gemma 4: sliding
    and full layers with their own head dims and head counts, KV-shared layers with none).

    `kv[l]` is layer l's `[2, n_kv_l, max_len, head_dim_l]`, or None for a layer that reads
    another's. Bookkeeping is `KVCache`'s: `length` only (a sliding layer keeps every position;
    its window is the attention mask's), so rollback and commit only move it.
    """

    host_bookkeeping = True
    round_graphs_ok = True

    def __init__(self, shapes: list[tuple[int, int] | None], max_len: int, dtype: torch.dtype, device: torch.device):
        self.kv = [None if s is None else torch.zeros(2, s[0], max_len, s[1], dtype=dtype, device=device)
                   for s in shapes]
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

    def __init__(self, shapes, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__(shapes, max_len, dtype, device)
        self._init_live_rows(device)

    def reset(self) -> None:
        LayerKVCache.reset(self)
        self.set_live_rows(None)
