"""Building blocks shared by the target and the drafter (plain torch, any device).

Numerics follow HF transformers' Qwen3 modules so float32 results match them to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memra_kernels.norm_ref import rms_norm_ref as rms_norm  # noqa: F401  HF Qwen3RMSNorm: the op's one body


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
    out = sdpa(qf, k, v, m, scale)
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         scale: float | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)` for `q [B, m, hd]`
    over `k, v [B, n, hd]`, `mask` boolean (True = attend) broadcast to `[B, m, n]`, or None.
    Every caller's rows attend at least one key (their own position).

    A float32 call on the CPU takes SDPA's math backend (3-D inputs never reach its flash
    kernel), and this writes that backend's arithmetic out op for op: q and k^T each scaled by
    sqrt(scale), one bmm, the mask added as 0 / -inf, softmax, one bmm; the same bits
    (tests/engine/test_sdpa.py). What it leaves out is what SDPA wraps around that for cases
    that never arise here: the boolean mask's conversion (`logical_not`, `where`) and the guard
    for a row whose every key is masked (`eq`, `all`, `where` over the scores). Each of those is
    a pass over the scores and an op's overhead: on the 2-core dev CPU they were ~40% of a
    16-row step's attention. Anywhere else (CUDA, where SDPA may pick a fused backend; other
    dtypes, which the math backend widens first) it is SDPA itself.
    """
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = math.sqrt(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # SDPA's sqrt of its scale
    attn = torch.matmul(q * s, k.transpose(-2, -1) * s)
    if mask is not None:
        attn.add_(torch.where(mask, 0.0, -math.inf))
    return torch.matmul(torch.softmax(attn, -1), v)
