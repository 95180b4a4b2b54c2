"""A mixture-of-experts router's picks from its logits in one launch: softmax, top-k, the
renormalisation, a per-expert scale, the cast, the padding rows and the expert count.

`moe_route_ref.moe_route_ref` is the twin (the arithmetic, op for op): per row of `logits [t, E]`
softmax in float32 (`exp(l - max) / Σ exp`), k picks of the largest probability with ties to the
lower expert index, divided by their float32 sum when `normalize`, times `scale[e]` in float32
when given, cast to the logits' dtype; rows from `live` on get ids E and weights 0; `counts`
(int64 `[2]`) gains 1 and the distinct experts of the live rows. In the torch body that is about
fourteen small launches a sparse layer (softmax, sort, slices, sum, divide, cast, the mask, the
counter's fill, scatter, sum and add); in a graphed few-row step those launches, not the bytes
they move, are what they cost.

One program holds a tile of `BLOCK_T` rows x every expert and loops over the call's row tiles.
Each row's arithmetic is its own (reductions along the expert axis only, one tile shape whatever
the row count), so a row's picks and weights are the same bits in a call of 1 row or 16: the
fixed-width rule. A call of up to `COUNT_ROWS` rows runs as one program, which counts the union
of its live rows' experts itself; a longer one (a prefill chunk) runs a program per row tile and
the wrapper counts with the twin's torch counter.

The k picks take one reduction each: an int64 key per (row, expert), the probability's bits
(non-negative, so ordered as the values) above the column's complement, whose maximum is the
largest probability and, among equal ones, the lowest index; the count's union is one reduction
over the rows after the picks (the keys taken out).

Kernel and twin differ only in the float32 order of the softmax's and the normalisation's sums
(and the exponential's last bit); ties of equal probabilities go to the lower index in both.

Public API: `moe_route`, `moe_route_ref`, `eligible`, `BLOCK_T`, `COUNT_ROWS`, `MAX_EXPERTS`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_tensors
from ._pdl import pdl_args, pdl_wait
from .moe_route_ref import count_experts, moe_route_ref  # noqa: F401  (the twin)

__all__ = ["moe_route", "moe_route_ref", "eligible", "BLOCK_T", "COUNT_ROWS", "MAX_EXPERTS"]

BLOCK_T = 16  # rows a tile holds (a fixed-width step's 16 in one tile)
COUNT_ROWS = 64  # calls up to this many rows run as one program that counts their experts itself
MAX_EXPERTS = 1024  # a tile holds BLOCK_T rows of every expert's logit


def eligible(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these router logits `[t, E]`: a float dtype, E up to MAX_EXPERTS."""
    return logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and 1 <= logits.shape[1] <= MAX_EXPERTS


@triton.jit
def _moe_route_kernel(logits_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l,
                      K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      NORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIVE: tl.constexpr,
                      COUNT: tl.constexpr, PDL: tl.constexpr = False):
    """Program p routes the row tiles p, p + P, ...; with COUNT (one program) it adds the call and
    the union of its live rows' experts to `counts`."""
    pdl_wait(PDL)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    slots = tl.arange(0, KP)
    live = T
    if HAS_LIVE:
        live = tl.load(live_ptr)
    hit = tl.zeros((BLOCK_E,), tl.int32)  # experts some live row picked
    for t0 in range(tl.program_id(0) * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        raw = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                      mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        x = tl.where(col_ok[None, :], raw, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        probs = p / tl.sum(p, axis=1)[:, None]
        live_row = row_ok & (rows < live)
        # one int64 key per (row, expert): the probability's bits (>= 0, so ordered as the
        # values) over the complement of the column, so one maximum gives the largest
        # probability and, among equal ones, the lowest index; a pick is taken out as -1
        keys = tl.where(col_ok[None, :], (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32)
                        | (BLOCK_E - 1 - cols)[None, :].to(tl.int64), -1)
        vals = tl.zeros((BLOCK_T, KP), tl.float32)
        ids = tl.zeros((BLOCK_T, KP), tl.int32)
        for j in tl.static_range(K_TOP):
            key = tl.max(keys, axis=1)
            i = (BLOCK_E - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
            v = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)  # the probability, bit for bit
            vals = tl.where(slots[None, :] == j, v[:, None], vals)
            ids = tl.where(slots[None, :] == j, i[:, None], ids)
            keys = tl.where(cols[None, :] == i[:, None], -1, keys)
        if COUNT:  # the experts some live row picked: the keys taken out, in a column that exists
            taken = (keys == -1) & col_ok[None, :] & live_row[:, None]
            hit = tl.maximum(hit, tl.max(taken.to(tl.int32), axis=0))
        slot_ok = slots[None, :] < K_TOP
        if NORMALIZE:
            vals = vals / tl.sum(tl.where(slot_ok, vals, 0.0), axis=1)[:, None]
        if HAS_SCALE:
            vals = vals * tl.load(scale_ptr + ids, mask=slot_ok, other=0.0).to(tl.float32)
        ids = tl.where(live_row[:, None], ids, E)  # padding rows (and rows past t, not stored): no expert
        vals = tl.where(live_row[:, None], vals, 0.0)
        out = rows.to(tl.int64)[:, None] * K_TOP + slots[None, :]
        ok = row_ok[:, None] & slot_ok
        tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=ok)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)
    if COUNT:
        tl.atomic_add(counts_ptr, 1)
        tl.atomic_add(counts_ptr + 1, tl.sum(hit, axis=0).to(tl.int64))


def moe_route(logits: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref` in one launch (module docstring): `logits [t, E]` (model dtype; rows
    contiguous), `k` in [1, E], `live` int32 `[1]` or None, `counts` int64 `[2]` or None, `scale
    [E]` or None -> weights `[t, k]` (logits' dtype), ids `[t, k]` int64."""
    check_tensors(*(x for x in (logits, live, counts, scale) if x is not None))
    check_dtype(logits, "logits")
    t, n_exp = logits.shape
    if not 1 <= k <= n_exp:
        raise ValueError(f"top-k {k} must lie in [1, {n_exp}] (the router's experts)")
    if live is not None and (live.shape != (1,) or live.dtype != torch.int32):
        raise ValueError(f"live rows must be an int32 [1] tensor, got {live.dtype} {tuple(live.shape)}")
    if counts is not None and (counts.shape != (2,) or counts.dtype != torch.int64):
        raise ValueError(f"counts must be an int64 [2] tensor, got {counts.dtype} {tuple(counts.shape)}")
    if scale is not None and scale.shape != (n_exp,):
        raise ValueError(f"scale must be [{n_exp}], got {tuple(scale.shape)}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    weights = torch.empty((t, k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    fused = counts is not None and t <= COUNT_ROWS
    grid = 1 if fused else triton.cdiv(t, BLOCK_T)
    _moe_route_kernel[(grid,)](
        logits, logits if scale is None else scale, logits if live is None else live, weights, ids,
        ids if counts is None else counts, t, n_exp, logits.stride(0), K_TOP=k, KP=triton.next_power_of_2(k),
        BLOCK_T=BLOCK_T, BLOCK_E=triton.next_power_of_2(n_exp), NORMALIZE=normalize, HAS_SCALE=scale is not None,
        HAS_LIVE=live is not None, COUNT=fused, num_warps=4, **pdl_args(logits))
    if counts is not None and not fused:
        count_experts(counts, ids, n_exp)
    return weights, ids
