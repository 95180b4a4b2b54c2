"""The defaults of a target state's optional capabilities (models/base.py `TargetState`): a leaf
module, so a state class (models/kv_cache.py, models/qwen3_5.py) and the registry's load-time
check (`check_family`) share it without an import cycle."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


class StateBase:
    """Defaults for a state's optional capabilities: all off, so a family opts in to each by
    overriding it (and `check_family` refuses a capability claimed without its methods)."""

    host_bookkeeping = False
    round_graphs_ok = False
    settles_on_device = False
    graph_variants = 1
    # Graphs replayed inside the state's own methods (Qwen35State's rollback restores): the state
    # builds each body, the runtime's cache (runtime/cuda_graphs.py `GraphCache`) captures it.
    graphed_restores = False

    @property
    def graph_variant(self) -> int:
        return 0

    # At most this many of a fixed step's first rows are read (a host int; None: any): `reading_rows`.
    live_bound: int | None = None

    @contextmanager
    def reading_rows(self, n: int):
        """Context manager: a fixed step run (or captured) inside has only its first `n` rows'
        outputs read (a plain decode step reads one), so a family may treat the others as padding
        whatever the live-row count says, and size its launches by `n` (an MoE family's routing
        and expert grid: models/experts.py `LiveRouting`). A host value, fixed in a graph captured
        inside: sound at every replay, because the body around the step reads those rows only."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a fixed step reads at least one row, got {n!r}")
        saved, self.live_bound = self.live_bound, n
        try:
            yield
        finally:
            self.live_bound = saved

    def set_live_rows(self, n: int | None) -> None:
        """The next fixed steps' real rows (None: all of them); the rest are padding. A state
        that carries nothing from padding rows (a KV cache: causality hides them) ignores it."""

    def live_rows_from(self, rows):
        """Context manager: a fixed step run (or captured) inside it takes its live-row count
        from the device tensor `rows` (int32 `[1]`, a round body's own); a KV cache ignores it."""
        return nullcontext()

    def arranged_for_capture(self, variant: int):
        return nullcontext()

    def attach_graph_cache(self, cache) -> None:
        raise NotImplementedError(f"{type(self).__name__} replays no graphs of its own")

    def restore_round(self, live=None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not settle rounds on the device")

    def settled_on_device(self, end: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not settle rounds on the device")


class LiveRows:
    """A fixed step's live-row count held on the device (`live`, int32 `[1]`), for a state whose
    model skips work for padding rows: the hybrid's recurrence (models/qwen3_5.py), an MoE
    family's routed experts (models/experts.py `LiveRouting`). Set before a step launches
    (`set_live_rows`, a graph replay reads it) or taken from a round body's own tensor
    (`live_rows_from`); nothing reads it on the host."""

    ALL_ROWS = 2**31 - 1  # `live` when every row of a fixed step is real

    def _init_live_rows(self, device: torch.device) -> None:
        self.live = torch.full((1,), self.ALL_ROWS, dtype=torch.int32, device=device)
        self._live_host: int | None = None  # what `live` holds (None: every row)

    @contextmanager
    def live_rows_from(self, rows: torch.Tensor):
        """A fixed step run or captured inside reads its live rows from `rows` (int32 `[1]` on the
        device; a round body writes it from its window before the step, so a replay needs no host
        value), not from `live`, which keeps what `set_live_rows` wrote."""
        if rows.shape != (1,) or rows.dtype != torch.int32 or rows.device != self.live.device:
            raise ValueError(f"live rows must be an int32 [1] tensor on {self.live.device}")
        saved, self.live = self.live, rows
        try:
            yield
        finally:
            self.live = saved

    def set_live_rows(self, n: int | None) -> None:
        """The next fixed steps' first `n` rows are real (None: all of them); the rest are padding.
        The device value changes (one small launch, in stream order) only when `n` does."""
        if n is not None and n < 1:
            raise ValueError(f"a fixed step has at least one live row, got {n}")
        if n == self._live_host:
            return
        self.live.fill_(self.ALL_ROWS if n is None else n)
        self._live_host = n
