"""A round's small row gathers, the one torch body each (no triton): the twins `gather.py`'s
kernels are tested against, and what the engine's `TorchStepOps` runs."""

from __future__ import annotations

import torch


def embed_rows_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ids [n]` into `weight [V, H]` -> `[n, H]`: `F.embedding`, a copy of the rows."""
    return torch.nn.functional.embedding(ids, weight)


def confidence_raw_ref(hidden: torch.Tensor, w: torch.Tensor, b: torch.Tensor, prev: torch.Tensor | None = None,
                       w1: torch.Tensor | None = None) -> torch.Tensor:
    """DSpark's accept-rate head: float32 `[n]` = `[hidden ; w1[prev]] · w + b` (the markov
    features only when `w1` is given), the features widened to float32, one GEMV, plus the bias."""
    feats = hidden.float()
    if w1 is not None:
        feats = torch.cat([feats, w1[prev].float()], dim=-1)
    return feats @ w + b[0]


def pack_round_ref(cand: torch.Tensor, sel: torch.Tensor, raws: torch.Tensor | None = None) -> torch.Tensor:
    """A graphed round's output `[cand ; sel (; raws)]` as float64 (exact for ids < 2^53)."""
    return torch.cat([cand.double(), sel.double()] + ([raws.double()] if raws is not None else []))
