"""RoPE's one torch body and the fused q/k norm + rope + K/V write's (no triton): the twins
`rope.py`'s kernel is tested against, and what the engine's torch path runs
(`layers/rope.py` `apply_rope`, `layers/torch_step_ops.py` `TorchStepOps.qk_norm_rope_kv_write`)."""

from __future__ import annotations

import torch

from .norm_ref import rms_norm_ref


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., t, heads, head_dim]` by cos/sin `[..., t, head_dim]`: NeoX rotate-half, in
    the model dtype."""
    cos, sin = cos[..., :, None, :], sin[..., :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_kv_write_ref(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int,
                              n_kv: int, eps: float) -> torch.Tensor:
    """`qkv [t, (n_heads + 2 n_kv) hd]` -> q `[t, n_heads, hd]` normed and rotated; k (normed,
    rotated) and v written into `k_cache` / `v_cache [n_kv, S, hd]` at `positions [t]`."""
    t, hd = qkv.shape[0], q_norm_w.shape[0]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    c, s = cos[positions], sin[positions]
    q = rope_ref(rms_norm_ref(q.reshape(t, n_heads, hd), q_norm_w, eps), c, s)
    k = rope_ref(rms_norm_ref(k.reshape(t, n_kv, hd), k_norm_w, eps), c, s)
    k_cache.index_copy_(1, positions, k.transpose(0, 1))
    v_cache.index_copy_(1, positions, v.reshape(t, n_kv, hd).transpose(0, 1))
    return q


def rope_kv_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """Torch twin of `rope_kv_write` (a target without q/k norm, LLaMA): rope on q and k at
    `positions`, k and v written into the caches `[n_kv, S, hd]`; returns q `[t, n_heads, hd]`."""
    t, hd = qkv.shape[0], cos.shape[1]
    q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    c, s = cos[positions], sin[positions]
    q = rope_ref(q.reshape(t, n_heads, hd), c, s)
    k = rope_ref(k.reshape(t, n_kv, hd), c, s)
    k_cache.index_copy_(1, positions, k.transpose(0, 1))
    v_cache.index_copy_(1, positions, v.reshape(t, n_kv, hd).transpose(0, 1))
    return q
