"""The norms' one torch body each (no triton): the twins `norm.py`'s kernels are tested against,
and what the engine's torch path runs (`layers/ops.py`, `layers/deltanet.py` import them), so
the CPU runtime needs no triton and the two can never drift apart."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis as HF Qwen3RMSNorm: statistics in float32, the normalized value
    cast back to the input dtype *before* the weight multiply (in bf16 that is where HF rounds).
    The twin of `norm.rms_norm`, and the engine's `layers.ops.rms_norm`."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch twin of `add_rms_norm`: the add in the model dtype (copied into `res_out` when
    given), then `rms_norm_ref`."""
    new_residual = x + residual
    if res_out is not None:
        new_residual = res_out.copy_(new_residual)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def tree_sumsq_ref(x: torch.Tensor) -> torch.Tensor:
    """Each row's float32 sum of squares of `x [t, d]` as the pairwise tree over adjacent elements
    of the row zero-padded to a power of two (kernels/_sumsq.py's order, bit for bit) -> `[t]`."""
    v = x.float() * x.float()
    width = 1 << max(v.shape[-1] - 1, 0).bit_length()
    v = torch.nn.functional.pad(v, (0, width - v.shape[-1]))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _f32(op, *args) -> torch.Tensor:
    """A float32 operation correctly rounded: done in float64 and rounded once (exact for one
    division or square root of float32 operands); torch's CPU float32 sqrt is not always."""
    return op(*(a.double() if isinstance(a, torch.Tensor) else a for a in args)).float()


def tree_rstd_ref(sumsq: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """`1 / sqrt(sumsq / d + eps)` in float32, each step rounded as the kernels' (IEEE) are."""
    mean_sq = _f32(torch.div, sumsq, d)
    return _f32(torch.div, 1.0, _f32(torch.sqrt, mean_sq + torch.tensor(eps, dtype=torch.float32)))


def rms_norm_tree_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin of `norm.rms_norm_tree` bit for bit: `rms_norm_ref`'s roundings with the tree's
    sum of squares and `1 / sqrt` (the kernel's; not `rsqrt`), `x [t, d]` -> `[t, d]`."""
    rstd = tree_rstd_ref(tree_sumsq_ref(x), x.shape[-1], eps)
    normed = (x.float() * rstd[:, None]).to(x.dtype).float()
    return (weight.float() * normed).to(torch.promote_types(x.dtype, weight.dtype))


def add_rms_norm_tree_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `norm.add_rms_norm_tree`: the add in the model dtype, then `rms_norm_tree_ref`."""
    new_residual = x + residual
    return rms_norm_tree_ref(new_residual, weight, eps), new_residual


def with_first(ids: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
    """`ids` with its element 0 replaced by `first`'s one element (None: `ids` as they are)."""
    return ids if first is None else torch.cat([first.reshape(1).to(ids.dtype), ids[1:]])


def embed_rms_norm_ref(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                       eps: float, first: torch.Tensor | None = None,
                       rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `embed_rms_norm`: the embedding's rows (of `with_first(ids, first)`; copied
    into `rows_out` when given), then `rms_norm_ref` of them."""
    rows = torch.nn.functional.embedding(with_first(ids, first), table)
    if rows_out is not None:
        rows = rows_out.copy_(rows)
    return rms_norm_ref(rows, weight, eps), rows


def embed_rms_norm_1p_ref(ids: torch.Tensor, table: torch.Tensor, w1p: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `embed_rms_norm_1p`: the embedding's rows, then `rms_norm_1p_ref` of them."""
    rows = torch.nn.functional.embedding(ids, table)
    return rms_norm_1p_ref(rows, w1p, eps), rows


def rms_norm_1p_ref(x: torch.Tensor, w1p: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm as HF Qwen3_5RMSNorm: float32 stats, `* (1 + w)` in float32, then cast.
    `w1p` is `1 + w` precomputed in float32 (the same value HF forms per call). The twin of
    `norm.rms_norm_1p`, and the engine's `layers.deltanet.rms_norm_1p`."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w1p).to(x.dtype)


def add_rms_norm_1p_ref(x: torch.Tensor, residual: torch.Tensor, w1p: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch twin of `add_rms_norm_1p`: the add in the model dtype, then `rms_norm_1p_ref`."""
    new_residual = residual + x
    return rms_norm_1p_ref(new_residual, w1p, eps), new_residual


def gated_rms_norm_body(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3_5RMSNormGated over the last axis, `x, z [..., dv]` -> `[..., dv]` in x's dtype:
    `w * normed(x).to(dtype)`, then `* silu(z)` in float32, then cast."""
    dtype = x.dtype
    xf = x.float()
    out = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (out * torch.nn.functional.silu(z.float())).to(dtype)


def gated_rms_norm_heads(core: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated norm per head: `core [t, Hv, dv]` (float32), `z [t, Hv*dv]` -> `[t, Hv*dv]` in z's
    dtype (core rounded to it first, as HF does): `qwen35.py`'s twin and `TorchStepOps`."""
    t, hv, dv = core.shape
    return gated_rms_norm_body(core.to(z.dtype), z.reshape(t, hv, dv), w, eps).reshape(t, hv * dv)
