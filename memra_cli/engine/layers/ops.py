"""Building blocks shared by the target and the drafter (plain torch, any device).

Numerics follow HF transformers' Qwen3 modules so float32 results match them to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, exactly as HF Qwen3RMSNorm.

    Statistics in float32, then the normalized value is cast back to the input dtype *before*
    the weight multiply (the order matters in bf16: it is where HF rounds).
    """
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def linear(x: torch.Tensor, w: object) -> torch.Tensor:
    """`x @ w.T` for a plain weight `[out, in]`, or `w(x)` for a quantized linear module."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w(x)  # type: ignore[operator]


def swiglu(x: torch.Tensor, w_gate: object, w_up: object, w_down: object) -> torch.Tensor:
    """Qwen3 MLP: down(silu(gate(x)) * up(x)) for `x [t, hidden]`."""
    return linear(F.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q `[t, n_heads, head_dim]`, k/v `[n_kv, n, head_dim]`, mask `[t, n]` bool (True = attend) or
    None. The g query heads sharing a KV head are folded into the row axis, so K/V are read once
    per KV head. Returns `[t, n_heads*head_dim]`.
    """
    t, nh, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
    m = None if mask is None else mask.repeat(g, 1)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, scale=scale)
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)
