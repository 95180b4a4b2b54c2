"""Small row gathers of a round: embedding lookups, and DSpark's confidence head.

PyTorch's `index_select` kernel and DSpark's confidence head as torch ops (casts, a gather, a
concatenation, a GEMV, an add) cost a graphed round of a small pair far more than their few
kilobytes (docs/tuning.md#row-gathers). Each here is one launch of one program per row:

- `embed_rows(ids [n], weight [V, H]) -> [n, H]`: `F.embedding` exactly (a copy of the rows);
- `confidence_raw(hidden [n, H], w [F], b [1], prev [n] | None, w1 [V, r] | None) -> f32 [n]`:
  the pre-sigmoid accept-rate score of each slot, `hidden[k] · w[:H] (+ w1[prev[k]] · w[H:]) + b`,
  the features widened to float32 as the torch head widens them. The dot is summed in another
  order than torch's GEMV, so a score can differ in its last bits; a score only sizes the verify
  window (how many verified rows count), never what the target commits.
  `hidden` may be a residual stream whose final norm the head applies as it loads it (a
  `dense_linear.PendingNorm`: a drafter's last layer left its norm to the heads).

Each row is read and written by its own program, so a row's result never depends on the row
count. No host sync: capturable in a CUDA graph.

And the round's output: `pack_round(cand, sel, raws=None) -> f64` writes a graphed round's one
host read in one launch (four with `.double()` of each part and a concatenation).

Public API: `embed_rows`, `confidence_raw`, `pack_round` and their twins `embed_rows_ref`,
`confidence_raw_ref`, `pack_round_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from ._sumsq import pairwise_rows
from .gather_ref import confidence_raw_ref, embed_rows_ref, pack_round_ref  # noqa: F401  (the twins: one torch body each)

MAX_BLOCK = 4096  # columns per loop step
CONF_BLOCK = 1024  # the confidence head's columns per loop step (its slots' tiles, BLOCK_S x this, stay in registers)


@triton.jit
def _embed_kernel(ids_ptr, w_ptr, out_ptr, H, stride_w, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < H
        v = tl.load(w_ptr + tok * stride_w + cols, mask=ok)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, v, mask=ok)


def embed_rows(ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight[ids]`: ids `[n]` (int32/int64, each in [0, V)), weight `[V, H]` with a contiguous
    last axis -> `[n, H]` in weight's dtype (into `out` if given)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be 2-D [V, H] with a contiguous last axis, got {tuple(weight.shape)}")
    n, H = ids.shape[0], weight.shape[1]
    if out is None:
        out = torch.empty((n, H), dtype=weight.dtype, device=weight.device)
    elif out.shape != (n, H) or out.dtype != weight.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{n}, {H}] {weight.dtype} with a contiguous last axis")
    check_tensors(ids, weight, out)
    if n:
        _embed_kernel[(n,)](ids, weight, out, H, weight.stride(0), out.stride(0),
                            BLOCK=min(MAX_BLOCK, next_pow2(H)), num_warps=4, **pdl_args(ids))
    return out


@triton.jit
def confidence_rows(rows, ok, prevs, h_ptr, w_ptr, b_ptr, w1_ptr, H, R, stride_h, stride_w1,
                    WITH_MARKOV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                    NORM_IN: tl.constexpr, sq_ptr, nw_ptr, n_parts, PARTS_POW2: tl.constexpr, eps):
    """Pre-sigmoid scores float32 `[BLOCK_S]` of draft rows `rows [BLOCK_S]` (where `ok`):
    `hidden[row] · w[:H] (+ w1[prev] · w[H:]) + b`, `prevs [BLOCK_S]` each slot's previous token
    (WITH_MARKOV). NORM_IN: the row is a residual stream whose RMSNorm (weight nw) is applied as
    it is loaded, its statistic summed from the dense kernel's per-tile partials `sq [rows,
    n_parts]` in _sumsq's order and each value rounded where the norm kernel rounds it (the bits
    of `norm.rms_norm_partials`). Each dot is summed lane by lane over BLOCK_H-column chunks, then
    as the adjacent-pair tree over the lanes (`pairwise_rows`): the same order whatever BLOCK_S
    and the warps, so `_confidence_kernel` (one row a program) and the chain's launch that scores
    all its slots at once (markov.py) give a row the same bits."""
    rows64 = rows.to(tl.int64)
    if NORM_IN:
        pc = tl.arange(0, PARTS_POW2)
        parts = tl.load(sq_ptr + rows64[:, None] * n_parts + pc[None, :], mask=ok[:, None] & (pc[None, :] < n_parts),
                        other=0.0)
        rstd = 1.0 / tl.sqrt_rn(pairwise_rows(parts, BLOCK_S, PARTS_POW2) / H + eps)
    acc = tl.zeros((BLOCK_S, BLOCK_H), tl.float32)
    for c0 in range(0, H, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        raw = tl.load(h_ptr + rows64[:, None] * stride_h + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                      other=0.0)
        if NORM_IN:  # the norm kernel's roundings: to the rows' dtype before the weight, then once more
            nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            raw = (nw[None, :] * (raw.to(tl.float32) * rstd[:, None]).to(raw.dtype).to(tl.float32)).to(raw.dtype)
        acc += raw.to(tl.float32) * tl.load(w_ptr + cols, mask=col_ok, other=0.0)[None, :]
    total = pairwise_rows(acc, BLOCK_S, BLOCK_H)
    if WITH_MARKOV:
        prev64 = prevs.to(tl.int64)
        acc_r = tl.zeros((BLOCK_S, BLOCK_R), tl.float32)
        for c0 in range(0, R, BLOCK_R):
            cols = c0 + tl.arange(0, BLOCK_R)
            col_ok = cols < R
            m = tl.load(w1_ptr + prev64[:, None] * stride_w1 + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            acc_r += m * tl.load(w_ptr + H + cols, mask=col_ok, other=0.0)[None, :]
        total += pairwise_rows(acc_r, BLOCK_S, BLOCK_R)
    return total + tl.load(b_ptr)


@triton.jit
def _confidence_kernel(h_ptr, w_ptr, b_ptr, prev_ptr, w1_ptr, out_ptr, H, R, stride_h, stride_w1,
                       WITH_MARKOV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False,
                       NORM_IN: tl.constexpr = False, sq_ptr=None, nw_ptr=None, n_parts=1,
                       PARTS_POW2: tl.constexpr = 1, eps=0.0):
    """One row's score a program (`confidence_rows` of one row)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) + tl.arange(0, 1)
    ok = rows >= 0
    prevs = tl.zeros((1,), tl.int64)
    if WITH_MARKOV:
        prevs = tl.load(prev_ptr + rows).to(tl.int64)
    tl.store(out_ptr + rows, confidence_rows(rows, ok, prevs, h_ptr, w_ptr, b_ptr, w1_ptr, H, R, stride_h, stride_w1,
                                             WITH_MARKOV, 1, BLOCK_H, BLOCK_R, NORM_IN, sq_ptr, nw_ptr, n_parts,
                                             PARTS_POW2, eps))


def confidence_args(hidden, w: torch.Tensor, b: torch.Tensor, prev_n: int | None = None,
                    w1: torch.Tensor | None = None) -> tuple[int, dict]:
    """`confidence_raw`'s checks, and the launch arguments `confidence_rows` takes (besides the
    rows, their mask and their previous tokens): `(n rows, kwargs)`. `prev_n`: the rows the
    previous tokens cover (the markov features), None without them."""
    norm_in = dict(NORM_IN=False, sq_ptr=None, nw_ptr=None, n_parts=1, PARTS_POW2=1, eps=0.0)
    if not isinstance(hidden, torch.Tensor):  # a PendingNorm: (rows, sumsq, weight, eps)
        rows, sq, nw, eps = hidden
        if sq.dtype != torch.float32 or not sq.is_contiguous() or sq.dim() != 2 or sq.shape[0] != rows.shape[0] \
                or nw.shape != (rows.shape[-1],) or nw.dtype != rows.dtype or nw.stride(0) != 1:
            raise ValueError("a pending norm takes sumsq float32 [n, tiles] and a contiguous weight of the rows' dtype")
        check_tensors(rows, sq, nw)
        norm_in = dict(NORM_IN=True, sq_ptr=sq, nw_ptr=nw, n_parts=sq.shape[1], PARTS_POW2=next_pow2(sq.shape[1]),
                       eps=float(eps))
        hidden = rows
    if hidden.dim() != 2 or hidden.dtype not in FLOAT_DTYPES or hidden.stride(-1) != 1:
        raise ValueError(f"hidden must be 2-D float with a contiguous last axis, got {hidden.dtype} {tuple(hidden.shape)}")
    n, H = hidden.shape
    R = 0
    if (prev_n is None) != (w1 is None):
        raise ValueError("prev and w1 come together (the markov features) or not at all")
    if w1 is not None:
        if w1.dim() != 2 or w1.stride(-1) != 1 or prev_n != n:
            raise ValueError(f"w1 must be 2-D [V, r] (contiguous last axis) and prev [{n}]")
        R = w1.shape[1]
    if w.dtype != torch.float32 or w.shape != (H + R,) or not w.is_contiguous():
        raise ValueError(f"w must be a contiguous float32 [{H + R}], got {w.dtype} {tuple(w.shape)}")
    if b.dtype != torch.float32 or b.numel() != 1:
        raise ValueError(f"b must be one float32 value, got {b.dtype} {tuple(b.shape)}")
    check_tensors(*([hidden, w, b] + ([w1] if w1 is not None else [])))
    return n, dict(h_ptr=hidden, w_ptr=w, b_ptr=b, w1_ptr=w1 if w1 is not None else w, H=H, R=R,
                   stride_h=hidden.stride(0), stride_w1=w1.stride(0) if w1 is not None else 0,
                   WITH_MARKOV=w1 is not None, BLOCK_H=min(CONF_BLOCK, next_pow2(H)),
                   BLOCK_R=min(CONF_BLOCK, next_pow2(max(R, 1))), **norm_in)


def confidence_raw(hidden, w: torch.Tensor, b: torch.Tensor, prev: torch.Tensor | None = None,
                   w1: torch.Tensor | None = None) -> torch.Tensor:
    """Pre-sigmoid scores float32 `[n]` of draft rows `hidden [n, H]` (any float dtype): `w`
    float32 `[H]` or, with the markov features, `[H + r]` with `prev [n]` ids into `w1 [V, r]`;
    `b` float32 `[1]`. `hidden` may be a `dense_linear.PendingNorm` (a drafter's final norm left to
    its heads): its rows are normed as they are loaded, the scores those of
    `norm.rms_norm_partials(...)`'s rows, bit for bit."""
    if prev is not None and prev.dim() != 1:
        raise ValueError(f"prev must be 1-D [n], got {tuple(prev.shape)}")
    n, args = confidence_args(hidden, w, b, None if prev is None else prev.shape[0], w1)
    if prev is not None:
        check_tensors(args["h_ptr"], prev)
    out = torch.empty(n, dtype=torch.float32, device=args["h_ptr"].device)
    if n:
        _confidence_kernel[(n,)](prev_ptr=prev if prev is not None else args["b_ptr"], out_ptr=out, num_warps=4,
                                 **args, **pdl_args(args["h_ptr"]))
    return out


@triton.jit
def _pack_kernel(a_ptr, b_ptr, c_ptr, out_ptr, NA, NB, NC, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i, mask=i < NA, other=0).to(tl.float64)
    tl.store(out_ptr + i, a, mask=i < NA)
    b = tl.load(b_ptr + i, mask=i < NB, other=0).to(tl.float64)
    tl.store(out_ptr + NA + i, b, mask=i < NB)
    if NC > 0:
        c = tl.load(c_ptr + i, mask=i < NC, other=0.0).to(tl.float64)
        tl.store(out_ptr + NA + NB + i, c, mask=i < NC)


def pack_round(cand: torch.Tensor, sel: torch.Tensor, raws: torch.Tensor | None = None) -> torch.Tensor:
    """A graphed round's one host read, `[cand ; sel ; raws]` as float64 `[2W (+ n)]` in one
    launch (ids < 2^53 and float32 scores are exact in float64), where `.double()` of each part
    and a concatenation took four. 1-D contiguous int64 `cand`, `sel`; float32 `raws`."""
    parts = [cand, sel] + ([raws] if raws is not None else [])
    for x, name, dtype in zip(parts, ("cand", "sel", "raws"), (torch.int64, torch.int64, torch.float32)):
        if x.dim() != 1 or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D {dtype} tensor, got {x.dtype} {tuple(x.shape)}")
    check_tensors(*parts)
    na, nb, nc = cand.shape[0], sel.shape[0], 0 if raws is None else raws.shape[0]
    out = torch.empty(na + nb + nc, dtype=torch.float64, device=cand.device)
    _pack_kernel[(1,)](cand, sel, raws if raws is not None else cand, out, na, nb, nc,
                       BLOCK=next_pow2(max(na, nb, nc, 1)), num_warps=1, **pdl_args(cand))
    return out
