"""The step ops' launch fusions undone: each fused op as the two step ops it fuses.

Each form takes the ops instance first (`ops`) and calls only its ops, so one function serves
as the torch ops' body for several ops (they fuse nothing), as the kernels' fallback where the
fused launch does not apply, and as what `TritonStepOps.unfused()` installs (layers/step_ops.py:
the seam's `unfused()`); the GPU benchmarks time the fusions against these forms.
"""

from __future__ import annotations

import torch

from memra_cli.engine.layers.moe import bounded_live
from memra_kernels.gemma4_ref import gemma_rms_norm_ref
from memra_kernels.moe_route_ref import router_pre_norm_ref
from memra_kernels.norm_ref import with_first


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
                           eps: float, first: torch.Tensor | None = None,
                           rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's embedding and first norm as two step ops, `(ops.rms_norm(rows, norm_w, eps), rows)`
    with `rows = ops.embed(ids, weight)` (ids with `first` as element 0, a concatenation; rows
    copied into `rows_out` when given): the unfused form `unfused()` installs."""
    rows = ops.embed(with_first(ids, first), weight)
    if rows_out is not None:
        rows = rows_out.copy_(rows)
    return ops.rms_norm(rows, norm_w, eps), rows


def unfused_qkv_rope_kv_write(ops, h: torch.Tensor, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                              v_cache, n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """The fused projection, then the (q/k norm +) rope + K/V write, as two step ops."""
    qkv = ops.linear(h, w_qkv, b_qkv)
    if q_norm is None:
        return ops.rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    return ops.qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, eps)


def unfused_linear_add_rms_norm(ops, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor,
                                eps: float, consumer=None,
                                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection and the residual add + norm after it as two step ops, `add_rms_norm` (the
    norm kernel's statistic: the folded one's order differs, so may its last ulp; the new residual
    into `out` when given); `consumer` (the next weight) is unused here."""
    return ops.add_rms_norm(ops.linear(a, w, bias), residual, norm_w, eps, res_out=out)


def unfused_linear_rms_norm(ops, a: torch.Tensor, w, norm_w: torch.Tensor, eps: float, consumer=None) -> torch.Tensor:
    """A projection and the norm of its output as two step ops, `rms_norm(linear(a, w))` (the
    norm kernel's statistic); `consumer` is unused here."""
    return ops.rms_norm(ops.linear(a, w), norm_w, eps)


def unfused_router_route(ops, x, router, k: int, normalize: bool, live=None, counts=None, scale=None,
                         pre_norm=None, bound: int | None = None):
    """`ops.linear` then `ops.moe_route`: a router's logits, then its picks (the unfused form);
    `pre_norm` `(weight, factor, eps)`: Gemma 4's router norm first, in torch (`router_pre_norm_ref`);
    rows from the host `bound` on padding too (`layers/moe.py` `bounded_live`)."""
    if pre_norm is not None:
        x = router_pre_norm_ref(x, *pre_norm)
    return ops.moe_route(ops.linear(x, router), k, normalize, bounded_live(live, bound, x), counts, scale)


def unfused_moe_swiglu_add_rms_norm(ops, x, weights, experts, w_gate_up, w_down, residual, norm_w, eps: float,
                                    activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu` then `ops.add_rms_norm`: the unfused form `unfused()` installs."""
    return ops.add_rms_norm(ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation), residual, norm_w, eps)


def unfused_moe_swiglu_shared_add_rms_norm_1p(ops, x, weights, experts, w_gate_up, w_down, shared, gate, residual,
                                              w1p, eps: float, activation: str = "silu"
                                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu`, the gated shared expert's torch ops, then `ops.add_rms_norm_1p`: the
    unfused form `unfused()` installs (the twin's ops, op for op)."""
    ff = ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation) + torch.sigmoid(gate) * shared
    return ops.add_rms_norm_1p(ff, residual, w1p, eps)


def unfused_gemma_add_two_norms(ops, x, branch, w_branch, w_out, w_out2, eps: float):
    """`ops.gemma_add_norm`, then the second norm in torch: the unfused form `unfused()` installs."""
    x, normed = ops.gemma_add_norm(x, branch, w_branch, w_out, eps)
    return x, normed, gemma_rms_norm_ref(x, w_out2, eps)


def unfused_moe_gemma_add_norm(ops, x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next,
                               eps: float, scalar) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu` (GELU-tanh), the two post norms and their sum in torch, then
    `ops.gemma_add_norm`: the unfused form `unfused()` installs (the twin's ops, op for op)."""
    post_1, post_2, post_ff = norms
    routed = ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, "gelu_tanh")
    ff = gemma_rms_norm_ref(dense, post_1, eps) + gemma_rms_norm_ref(routed, post_2, eps)
    return ops.gemma_add_norm(residual, ff, post_ff, w_next, eps, scalar)


def unfused_lm_head_argmax(ops, h: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy step's head as two step ops: `(logits, ops.argmax(logits))`, `logits = ops.linear(h, w)`."""
    logits = ops.linear(h, w)
    return logits, ops.argmax(logits)
