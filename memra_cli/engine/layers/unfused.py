"""The step ops' launch fusions undone: each fused op as the two step ops it fuses.

Each form takes the ops instance first (`ops`) and calls only its ops, so one function serves
as the torch ops' body for several ops (they fuse nothing), as the kernels' fallback where the
fused launch does not apply, and as what `TritonStepOps.unfused()` installs (layers/step_ops.py:
the seam's `unfused()`); the GPU benchmarks time the fusions against these forms.
"""

from __future__ import annotations

import torch


def unfused_swiglu(ops, x: torch.Tensor, w_gate_up) -> torch.Tensor:
    """The MLP's SwiGLU as two step ops, `ops.silu_mul(ops.linear(x, w_gate_up))`: the torch path's
    `swiglu`, the kernels' fallback where the fused launch does not apply, and what the benchmarks'
    unfused variants (`--no-glu`, target_step's `noglu`) install as `swiglu` to time the epilogue
    against. `x [t, hidden]`, `w_gate_up` `[2*ffn, hidden]` (or a linear module) -> `[t, ffn]`."""
    return ops.silu_mul(ops.linear(x, w_gate_up))


def unfused_embed_rms_norm_1p(ops, ids: torch.Tensor, weight: torch.Tensor, w1p: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`unfused_embed_rms_norm` with the zero-centred norm (`ops.rms_norm_1p`; Qwen3.5's first norm)."""
    rows = ops.embed(ids, weight)
    return ops.rms_norm_1p(rows, w1p, eps), rows


def unfused_embed_rms_norm(ops, ids: torch.Tensor, weight: torch.Tensor, norm_w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's embedding and first norm as two step ops, `(ops.rms_norm(rows, norm_w, eps), rows)`
    with `rows = ops.embed(ids, weight)`: the unfused form `unfused()` installs."""
    rows = ops.embed(ids, weight)
    return ops.rms_norm(rows, norm_w, eps), rows


def unfused_qkv_rope_kv_write(ops, h: torch.Tensor, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                              v_cache, n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """The fused projection, then the (q/k norm +) rope + K/V write, as two step ops."""
    qkv = ops.linear(h, w_qkv, b_qkv)
    if q_norm is None:
        return ops.rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    return ops.qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, eps)


def unfused_linear_add_rms_norm(ops, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor,
                                eps: float, consumer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection and the residual add + norm after it as two step ops, `add_rms_norm` (the
    norm kernel's statistic: the folded one's order differs, so may its last ulp); `consumer`
    (the next weight) is unused here."""
    return ops.add_rms_norm(ops.linear(a, w, bias), residual, norm_w, eps)


def unfused_router_route(ops, x, router, k: int, normalize: bool, live=None, counts=None, scale=None):
    """`ops.linear` then `ops.moe_route`: a router's logits, then its picks (the unfused form)."""
    return ops.moe_route(ops.linear(x, router), k, normalize, live, counts, scale)


def unfused_moe_swiglu_add_rms_norm(ops, x, weights, experts, w_gate_up, w_down, residual, norm_w, eps: float,
                                    activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu` then `ops.add_rms_norm`: the unfused form `unfused()` installs."""
    return ops.add_rms_norm(ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation), residual, norm_w, eps)


def unfused_lm_head_argmax(ops, h: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy step's head as two step ops: `(logits, ops.argmax(logits))`, `logits = ops.linear(h, w)`."""
    logits = ops.linear(h, w)
    return logits, ops.argmax(logits)
