"""Qwen3.5's DeltaNet gates, the one torch body (no triton): what `qwen35.py`'s `gdn_gates_ref`
(the kernel's twin) runs after its checks, and the engine's `TorchStepOps.gdn_gates`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates_body(ba: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
                   ring_idx: torch.Tensor | None = None, xs_ring: torch.Tensor | None = None,
                   mixed: torch.Tensor | None = None, replay: tuple | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ba [t, 2*Hv]` (b | a) -> g, beta `[t, Hv]` float32; with `ring_idx` the conv inputs
    `mixed` go into `xs_ring` at it, and `replay = (qkv_ring, conv, g_ring, beta_ring)` the
    recurrence inputs too."""
    hv = a_neg.shape[0]
    b, a = ba.split([hv, hv], dim=-1)
    beta = torch.sigmoid(b).float()
    g = a_neg * F.softplus(a.float() + dt_bias)
    if ring_idx is not None:
        xs_ring.index_copy_(0, ring_idx, mixed)
        if replay is not None:
            qkv_ring, conv, g_ring, beta_ring = replay
            qkv_ring.index_copy_(0, ring_idx, conv)
            g_ring.index_copy_(0, ring_idx, g)
            beta_ring.index_copy_(0, ring_idx, beta)
    return g, beta


def window_after(window: torch.Tensor, mixed: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """The conv window after a step's last row: the last K-1 rows of `cat([window [K-1, C], mixed
    [t, C]])`, or with `live` (int32 `[1]`) after row `min(t, live) - 1` (the rows after it are a
    fixed step's padding): rows `n .. n+K-2` of the concatenation, picked by a device index (no
    host read, so a CUDA graph can capture it)."""
    xs = torch.cat([window, mixed], dim=0)
    k1, t = window.shape[0], mixed.shape[0]
    if live is None:
        return xs[t:]
    n = torch.clamp(live.long(), max=t)
    return xs.index_select(0, n + torch.arange(k1, device=xs.device))
