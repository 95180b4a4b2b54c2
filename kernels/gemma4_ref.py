"""Gemma 4's step ops' one torch body each (no triton): the twins `gemma4.py`'s kernels are
tested against, and what the engine's torch path runs (`models/gemma4.py` and
`layers/torch_step_ops.py` `TorchStepOps` import them), so the two can never drift apart.

Semantics are transformers' `Gemma4TextAttention` / `Gemma4RMSNorm` / the softcapped lm_head
(docs/gemma4.md, "The switches")."""

from __future__ import annotations

import torch

from .rope_ref import rope_ref


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm over the last axis: `x * (mean(x^2) + eps)^-0.5 [* w]`, all in float32,
    then cast to x's dtype (`weight` None: the unweighted v norm). No `1 + w`, and the weight is
    multiplied before the cast (Qwen's norm casts first)."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def gemma_qk_norm_rope_kv_write_ref(proj: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor | None,
                                    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, n_heads: int,
                                    n_kv: int, eps: float, k_eq_v: bool) -> torch.Tensor:
    """Gemma 4's attention input from the fused projection `proj [t, (nh + nkv*(1 or 2))*hd]`
    (`[q; k]` with k_eq_v, `[q; k; v]` else, `[q]` alone on a KV-shared layer: caches None,
    n_kv 0): q and k RMSNormed with their weights and rotated by cos/sin `[S_tab, hd]` at
    `positions [t]`; v (the raw key projection with k_eq_v) RMSNormed without a weight; k and v
    written into `k_cache` / `v_cache [n_kv, S, hd]` at rows `positions % S` (a ring storage's;
    a plain storage's are the positions). Returns q `[t, nh, hd]`.
    The proportional rope of full layers is its tables (cos 1, sin 0 on the pairs it leaves)."""
    t, hd = proj.shape[0], q_norm_w.shape[0]
    c, s = cos[positions], sin[positions]
    q = rope_ref(gemma_rms_norm_ref(proj[:, :n_heads * hd].view(t, n_heads, hd), q_norm_w, eps), c, s)
    if k_cache is not None:
        k = proj[:, n_heads * hd:(n_heads + n_kv) * hd].view(t, n_kv, hd)
        v = k if k_eq_v else proj[:, (n_heads + n_kv) * hd:(n_heads + 2 * n_kv) * hd].view(t, n_kv, hd)
        rows = positions % k_cache.shape[1]
        k_cache.index_copy_(1, rows, rope_ref(gemma_rms_norm_ref(k, k_norm_w, eps), c, s).transpose(0, 1))
        v_cache.index_copy_(1, rows, gemma_rms_norm_ref(v, None, eps).transpose(0, 1))
    return q


def softcap_ref(z: torch.Tensor, cap: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`cap * tanh(z / cap)` in z's dtype (each op rounded there, as transformers computes the
    capped logits), then cast to `out_dtype` (float32: the widened logits; exact)."""
    capped = torch.tanh(z / cap) * cap
    return capped if out_dtype is None else capped.to(out_dtype)


def gemma_add_norm_ref(x: torch.Tensor, branch: torch.Tensor, w_branch: torch.Tensor, w_out: torch.Tensor,
                       eps: float, scalar: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich norm's residual add and the next norm, as a Gemma 4 layer computes them:
    `x = x + norm(branch, w_branch)` (post-attention or post-feed-forward norm), then `x * scalar`
    (the layer's `layer_scalar` `[1]`, after the feed-forward) when given, then the next norm
    `norm(x, w_out)` (pre-feed-forward, the next layer's input norm, or the final norm). Every op
    in x's dtype. `x, branch [t, hidden]` -> (new residual, normed), both `[t, hidden]`."""
    x = x + gemma_rms_norm_ref(branch, w_branch, eps)
    if scalar is not None:
        x = x * scalar
    return x, gemma_rms_norm_ref(x, w_out, eps)


def gemma_add_two_norms_ref(x: torch.Tensor, branch: torch.Tensor, w_branch: torch.Tensor, w_out: torch.Tensor,
                            w_out2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gemma_add_norm_ref` (no scalar) and a second norm of the new residual by `w_out2` (the MoE
    block's pre-feed-forward-2 norm beside the MLP's) -> (new residual, normed, normed by w_out2)."""
    x, normed = gemma_add_norm_ref(x, branch, w_branch, w_out, eps)
    return x, normed, gemma_rms_norm_ref(x, w_out2, eps)


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma 4's MLP activation on the fused gate/up projection `[t, 2*ffn]` -> `[t, ffn]`:
    `gelu_tanh(gate) * up` in the model dtype (the GELU rounded, then the product)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
