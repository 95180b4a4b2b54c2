"""The defaults of a target state's optional capabilities (models/base.py `TargetState`): a leaf
module, so a state class (models/kv_cache.py, models/qwen3_5.py) and the registry's load-time
check (`check_family`) share it without an import cycle."""

from __future__ import annotations

from contextlib import nullcontext


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
