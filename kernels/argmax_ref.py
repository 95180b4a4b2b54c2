"""Row argmax, the one torch body (no triton): the twin `argmax.py`'s `row_argmax` is tested
against, and the engine's `TorchStepOps.argmax`."""

from __future__ import annotations

import torch


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """`x [rows, V]` -> int64 `[rows]`: each row's first index of its maximum."""
    return torch.argmax(x, dim=-1)
