"""RMSNorm, and the residual add fused in front of it.

`rms_norm` replaces `layers.rms_norm` (HF Qwen3RMSNorm numerics); `add_rms_norm` fuses the
residual add the decoder layer does before each norm (`x = x + attn_out; h = rms_norm(x)`), so
the sum is read once instead of written, read back and read again.

Numerics: the sum is rounded to the model dtype before the statistics (as the torch engine's
`x + residual` is); the mean of squares and rsqrt are float32; the normalized value is rounded to
the model dtype *before* the weight multiply, and that multiply is done in float32 and rounded
once, which is bit-identical to torch's model-dtype multiply for bf16/f16 (the product of two
8- or 11-bit mantissas is exact in float32). What can differ from torch is the float32 sum of
squares (a different reduction order), i.e. a last-ulp difference of the statistic that rarely
survives the rounding to bf16.

Zero-centred variant (Qwen3.5, HF `Qwen3_5RMSNorm`): `rms_norm_1p` / `add_rms_norm_1p` take
`w1p = 1 + w` in float32 (what the loader keeps) and multiply the float32 normalized value by it
in float32, rounding once at the end (no rounding before the weight multiply); the output is in
x's dtype. Against the twin, again only the sum of squares' order differs.

Embedding gather in front (`embed_rms_norm`, the first norm of a step; `embed_rms_norm_1p`, the
zero-centred one, Qwen3.5's): the program's input row is the embedding row of its id, written out
as the residual stream (a copy, `F.embedding`'s bits) and normed as `rms_norm` (`rms_norm_1p`)
norms it: one launch instead of the gather's and the norm's.

From partial sums (`rms_norm_partials`): the statistic summed from the dense kernel's per-tile
sums of squares in kernels/_sumsq.py's order, the norm that kernel folds into its next matmul
(dense_linear.py) given as a tensor, with the same bits (and its twin's).

Row invariance: one program per row; the block width depends only on the hidden size, so a row's
result never depends on the other rows or on how many there are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from ._sumsq import pairwise_rows
from .norm_ref import (add_rms_norm_1p_ref, add_rms_norm_ref, add_rms_norm_tree_ref, embed_rms_norm_1p_ref,  # noqa: F401
                       embed_rms_norm_ref, rms_norm_1p_ref, rms_norm_ref, rms_norm_tree_ref, with_first)  # (the twins)


@triton.jit
def rms_rstd(x, d, eps):
    """1 / sqrt(mean(x^2) + eps) of one float32 row `x` (zeros past its `d` values): the norms'
    statistic, shared with the MoE combine's fused norm (moe.py)."""
    return 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / d + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, d, stride_x, stride_res,
                     stride_out, stride_res_out, eps, HAS_RESIDUAL: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                     GATHER: tl.constexpr = False, ids_ptr=None, PARTIALS: tl.constexpr = False, sq_ptr=None,
                     n_parts=0, PARTS_POW2: tl.constexpr = 1, FIRST: tl.constexpr = False, first_ptr=None):
    """One row: [res_out = x + res]; out = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), or with
    ZERO_CENTRED (w is float32 1 + w) out = (x * rsqrt(mean(x^2) + eps) * w) rounded once.
    GATHER: x is an embedding table, the row's input its row ids[row], copied to res_out; with
    FIRST, row 0's id is first[0] instead of ids[0].
    PARTIALS: the sum of squares from the dense kernel's per-tile partials `sq [rows, n_parts]`,
    summed in `_sumsq`'s order (the bits of the norm that kernel folds into its next matmul)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < d
    src = row
    if GATHER:
        src = tl.load(ids_ptr + row).to(tl.int64)
        if FIRST:
            src = tl.where(row == 0, tl.load(first_ptr).to(tl.int64), src)
    raw = tl.load(x_ptr + src * stride_x + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    if GATHER:
        tl.store(res_out_ptr + row * stride_res_out + offs, raw, mask=mask)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the model dtype first: the statistics see exactly the stored residual.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        x = s.to(tl.float32)
    if PARTIALS:  # a one-row tree: the sum over its single element is that element
        cols = tl.arange(0, PARTS_POW2)
        parts = tl.load(sq_ptr + row * n_parts + cols, mask=cols < n_parts, other=0.0)
        mean_sq = tl.sum(pairwise_rows(parts[None, :], 1, PARTS_POW2), axis=0) / d
        rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
    else:
        rstd = rms_rstd(x, d, eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # HF Qwen3_5RMSNorm: float32 all the way, one rounding
        y = (x * rstd) * w
    else:
        y = w * (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF Qwen3RMSNorm rounds first
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else (8 if block_d <= 8192 else 16)


def _check_rows_out(rows_out: torch.Tensor | None, t: int, d: int, dtype: torch.dtype, ref: torch.Tensor) -> None:
    """A caller's rows `[t, d]` for a kernel's second output (a column slice of a wider buffer may
    do: only the last axis must be contiguous)."""
    if rows_out is not None:
        if rows_out.shape != (t, d) or rows_out.dtype != dtype or rows_out.stride(-1) != 1:
            raise ValueError(f"the rows' output must be a [{t}, {d}] {dtype} tensor with a contiguous last axis, got "
                             f"{tuple(rows_out.shape)} {rows_out.dtype}")
        check_tensors(ref, rows_out)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, zero_centred: bool = False, partials: dict | None = None,
            res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"expected x [t, d] and weight [d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    tensors = [x, weight] + ([residual] if residual is not None else [])
    check_tensors(*tensors)
    for name, a in zip(("x", "weight", "residual"), tensors):
        check_dtype(a, name)
        check_last_contiguous(a, name)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    if zero_centred and weight.dtype != torch.float32:
        raise TypeError(f"the zero-centred norm takes 1 + w in float32, got {weight.dtype}")
    t, d = x.shape
    out_dtype = x.dtype if zero_centred else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((t, d), dtype=out_dtype, device=x.device)
    _check_rows_out(res_out, t, d, x.dtype, x)
    if residual is None and res_out is not None:
        raise ValueError("res_out is the residual sum's output: it needs a residual")
    if residual is not None and res_out is None:
        res_out = torch.empty_like(x)
    if t == 0:
        return out, res_out
    block_d = next_pow2(d)
    res_in = residual if residual is not None else x  # unused when HAS_RESIDUAL is False
    res_o = res_out if res_out is not None else out
    _rms_norm_kernel[(t,)](
        x, res_in, weight, out, res_o, d, x.stride(0), res_in.stride(0), out.stride(0),
        res_o.stride(0), float(eps), HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred,
        BLOCK_D=block_d, **(partials or {}),
        num_warps=_num_warps(block_d), **pdl_args(x),
    )
    return out, res_out


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                   eps: float, first: torch.Tensor | None = None,
                   rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's embedding and first norm in one launch: `rows = table[ids]` and
    `rms_norm(rows, weight, eps)`, bit for bit `(rms_norm(embed_rows(ids, table), ...),
    embed_rows(ids, table))`. ids `[t]` int32/int64 in [0, V), table `[V, d]` (contiguous last
    axis), weight `[d]` -> (normed `[t, d]`, rows `[t, d]` in table's dtype).

    `first` (one int32/int64 element, on the device): row 0's id in place of `ids[0]`, read
    there: a drafter's block `[anchor, mask, ...]` from its constant mask ids and the round's
    anchor without their concatenation's launch (`norm_ref.with_first`). `rows_out` (`[t, d]`, a
    contiguous last axis: a column slice of a step's taps) receives the rows, and is returned."""
    return _embed_launch(ids, table, weight, eps, False, first, rows_out)


def embed_rms_norm_1p(ids: torch.Tensor, table: torch.Tensor, w1p: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`embed_rms_norm` with the zero-centred norm (Qwen3.5's first norm, `w1p` float32 `1 + w`):
    bit for bit `(rms_norm_1p(embed_rows(ids, table), w1p, eps), embed_rows(ids, table))`, the
    normed rows in table's dtype."""
    if w1p.dtype != torch.float32:
        raise TypeError(f"the zero-centred norm takes 1 + w in float32, got {w1p.dtype}")
    return _embed_launch(ids, table, w1p, eps, True)


def _embed_launch(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                  zero_centred: bool, first: torch.Tensor | None = None,
                  rows_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if first is not None:
        if first.numel() != 1 or first.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"first must be one int32/int64 element, got {first.dtype} {tuple(first.shape)}")
        check_tensors(ids, first)
    if table.dim() != 2 or weight.dim() != 1 or weight.shape[0] != table.shape[1]:
        raise ValueError(f"expected table [V, d] and weight [d], got {tuple(table.shape)} and {tuple(weight.shape)}")
    check_tensors(ids, table, weight)
    for name, a in (("table", table), ("weight", weight)):
        check_dtype(a, name)
        check_last_contiguous(a, name)
    t, d = ids.shape[0], table.shape[1]
    out_dtype = table.dtype if zero_centred else torch.promote_types(table.dtype, weight.dtype)
    out = torch.empty((t, d), dtype=out_dtype, device=table.device)
    _check_rows_out(rows_out, t, d, table.dtype, table)
    rows = torch.empty((t, d), dtype=table.dtype, device=table.device) if rows_out is None else rows_out
    if t:
        block_d = next_pow2(d)
        _rms_norm_kernel[(t,)](
            table, table, weight, out, rows, d, table.stride(0), table.stride(0), out.stride(0), rows.stride(0),
            float(eps), HAS_RESIDUAL=False, ZERO_CENTRED=zero_centred, BLOCK_D=block_d, GATHER=True, ids_ptr=ids,
            FIRST=first is not None, first_ptr=ids if first is None else first,
            num_warps=_num_warps(block_d), **pdl_args(table),
        )
    return out, rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x [t, d]` by `weight [d]` -> `[t, d]` (dtype: x's promoted with weight's).

    Rows may be strided; the last axis must be contiguous.
    """
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual` (rounded to the model dtype), then its RMSNorm.

    x, residual `[t, d]` (same dtype), weight `[d]` -> (normed `[t, d]`, new_residual `[t, d]`);
    `res_out` (`[t, d]`, a contiguous last axis) receives new_residual, and is returned.
    """
    normed, new_residual = _launch(x, residual, weight, eps, res_out=res_out)
    assert new_residual is not None
    return normed, new_residual


def rms_norm_partials(x: torch.Tensor, sumsq: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` of `x [t, d]` whose squares the dense kernel summed per n tile (`sumsq` float32
    `[t, tiles]`, `dense_linear.PendingNorm`): the statistic in `_sumsq`'s order, so the bits of
    the norm that kernel folds into its next matmul, where that matmul cannot take it. Twin:
    `norm_ref.rms_norm_tree_ref` (bit for bit under the interpreter)."""
    if sumsq.dim() != 2 or sumsq.shape[0] != x.shape[0] or sumsq.dtype != torch.float32 or not sumsq.is_contiguous():
        raise ValueError(f"sumsq must be a contiguous float32 [{x.shape[0]}, tiles] tensor, got "
                         f"{sumsq.dtype} {tuple(sumsq.shape)}")
    check_tensors(x, sumsq)
    return _launch(x, None, weight, eps, partials=dict(PARTIALS=True, sq_ptr=sumsq, n_parts=sumsq.shape[1],
                                                       PARTS_POW2=next_pow2(sumsq.shape[1])))[0]


def rms_norm_1p(x: torch.Tensor, w1p: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (Qwen3.5) of `x [t, d]` by `w1p [d]` (float32 `1 + w`) -> `[t, d]` in
    x's dtype: float32 statistics and weight multiply, one rounding. Rows may be strided."""
    return _launch(x, None, w1p, eps, zero_centred=True)[0]


def add_rms_norm_1p(x: torch.Tensor, residual: torch.Tensor, w1p: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual` (rounded to the model dtype), then its zero-centred RMSNorm:
    x, residual `[t, d]`, w1p `[d]` float32 -> (normed `[t, d]`, new_residual `[t, d]`)."""
    normed, new_residual = _launch(x, residual, w1p, eps, zero_centred=True)
    assert new_residual is not None
    return normed, new_residual
