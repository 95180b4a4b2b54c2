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

`router_route` (its twin `router_route_ref`: `F.linear` then `moe_route_ref`) also computes the
router's logits for a step's rows, in the same launch: a program per (ROUTER_N experts,
ROUTER_CHUNK hidden columns) dots its router tile with every live row's chunk of x (one float32
dot a row tile, whatever the row count; a padding row routes to no expert, so its x is never
read) and stores the partial logits; the last program to arrive
(an arrival counter, as `_splitk`'s) sums each row's chunks in chunk order, rounds the sum to
the model dtype and routes every row with the routing body above. A program asks L2 for its
router tile before its PDL wait (`_prefetch_router_then_wait`, as the dense kernel's weights),
so the router's read overlaps the kernel before, and its chain of dependent loads is one chunk
long, not the whole hidden size. With a pre-norm (Gemma 4's router: `router_pre_norm_ref`) each
program first sums every row's squares over one ROUTER_K-column loop of the whole hidden size,
then norms, scales and rounds its chunk of x (the twin's three roundings), so the norm costs no
launch of its own. With `routed`, the last program also writes the union of the live rows'
experts in ascending index (then E; `routed_experts_ref`): the expert kernels' grid puts the
programs of those experts first (`memra_kernels.moe`), so none of them waits behind the programs
of experts no row picked.

Kernel and twin differ only in the float32 order of the softmax's and the normalisation's sums
(and the exponential's last bit; `router_route`: and of the logits' dots); ties of equal
probabilities go to the lower index in both.

Public API: `moe_route`, `moe_route_ref`, `router_route`, `router_route_ref`, `routed_experts_ref`, `eligible`,
`router_eligible`, `BLOCK_T`, `COUNT_ROWS`, `MAX_EXPERTS`, `ROUTER_N`, `ROUTER_K`, `ROUTER_CHUNK`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_tensors, interpreting
from ._pdl import pdl_args, pdl_wait, prefetch_l2
from ._splitk import counters
from .moe_route_ref import (count_experts, moe_route_ref, routed_experts_ref,  # noqa: F401  (the twins)
                            router_pre_norm_ref, router_route_ref)

__all__ = ["moe_route", "moe_route_ref", "router_route", "router_route_ref", "router_pre_norm_ref",
           "routed_experts_ref", "eligible",
           "router_eligible",
           "BLOCK_T", "COUNT_ROWS", "MAX_EXPERTS", "ROUTER_N", "ROUTER_K", "ROUTER_CHUNK"]

BLOCK_T = 16  # rows a tile holds (a fixed-width step's 16 in one tile)
COUNT_ROWS = 64  # calls up to this many rows run as one program that counts their experts itself
MAX_EXPERTS = 1024  # a tile holds BLOCK_T rows of every expert's logit
# The router kernel's tiles, which depend on nothing but these constants, never on the row count:
# experts per program; hidden columns per program (32 programs for a 128-expert router of hidden
# 2048; each row's logit is the sum of its chunks in chunk order); the pre-norm's sum-of-squares step.
ROUTER_N = 16
ROUTER_CHUNK = 512
ROUTER_K = 128
# The router kernel's row tiles as an unrolled run of ceil(t / BLOCK_T) tiles, each skipped at run
# time past the live rows (a step's width is fixed, so one compile a width), rather than a loop
# whose trip count is the live-row count read from memory; and the router kernel's pipeline
# stages (None: Triton's default). Both are A/B knobs of the same arithmetic (docs/moe.md#the-routing-kernel).
STATIC_ROW_TILES = True
ROUTER_STAGES: int | None = None
# A routing tile's float32 logits per thread: with more, the tile spills registers
# (docs/moe.md, "Measured: the Qwen3.5-35B-A3B step").
TILE_PER_THREAD = 16


def route_warps(block_e: int) -> int:
    """Warps of a program that routes a `[BLOCK_T, block_e]` tile: enough that each thread holds
    TILE_PER_THREAD logits (4 for 128 experts, 8 for 256, 32 for 1024: a block's most). A
    function of the expert count alone, so no row's arithmetic depends on the row count."""
    return min(32, max(4, BLOCK_T * block_e // (32 * TILE_PER_THREAD)))


def eligible(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these router logits `[t, E]`: a float dtype, E up to MAX_EXPERTS."""
    return logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and 1 <= logits.shape[1] <= MAX_EXPERTS


@triton.jit
def _route_tiles(logits_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l, first, step,
                 K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 NORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIVE: tl.constexpr, COUNT: tl.constexpr,
                 PARTS: tl.constexpr = 0, ROW_TILES: tl.constexpr = 0, routed_ptr=None, ROUTED: tl.constexpr = False,
                 OUT_T=None):
    """Routes the row tiles first, first + step, ... of `logits [T, E]`; with COUNT (every tile
    here) adds the call and the union of its live rows' experts to `counts`. PARTS > 0 (the router
    kernel's last program): `logits_ptr` is float32 partial logits `[PARTS, T, E]` the programs
    wrote (read through L2), summed in part order and rounded to the weights' dtype. ROW_TILES > 0
    (first 0, step 1): the ROW_TILES tiles unrolled, not a loop (STATIC_ROW_TILES). ROUTED (every
    tile here): `routed [E]` int32 gets that union in ascending index, then E in the slots left
    (`routed_experts_ref`). OUT_T (the router kernel's, with a host bound): the call's rows, of
    which the first T are routed and the rest padding whatever `live` says (None: T)."""
    if OUT_T is None:
        OUT_T = T
    live = T
    if HAS_LIVE:
        live = tl.minimum(tl.load(live_ptr), T)
    hit = tl.zeros((BLOCK_E,), tl.int32)  # experts some live row picked
    if ROW_TILES:
        for tile in tl.static_range(ROW_TILES):
            hit = _route_tile(tile * BLOCK_T, live, hit, logits_ptr, scale_ptr, w_ptr, ids_ptr, T, OUT_T, E,
                              stride_l, K_TOP, KP, BLOCK_T, BLOCK_E, NORMALIZE, HAS_SCALE, COUNT or ROUTED, PARTS)
    else:
        for t0 in range(first * BLOCK_T, OUT_T, step * BLOCK_T):
            hit = _route_tile(t0, live, hit, logits_ptr, scale_ptr, w_ptr, ids_ptr, T, OUT_T, E, stride_l,
                              K_TOP, KP, BLOCK_T, BLOCK_E, NORMALIZE, HAS_SCALE, COUNT or ROUTED, PARTS)
    if COUNT:
        tl.atomic_add(counts_ptr, 1)
        tl.atomic_add(counts_ptr + 1, tl.sum(hit, axis=0).to(tl.int64))
    if ROUTED:  # the union, ranked by index: its slots below n, E in the others (disjoint stores)
        cols = tl.arange(0, BLOCK_E)
        n = tl.sum(hit, axis=0)
        tl.store(routed_ptr + tl.cumsum(hit, axis=0) - 1, cols, mask=hit > 0)
        tl.store(routed_ptr + cols, tl.zeros((BLOCK_E,), tl.int32) + E, mask=(cols >= n) & (cols < E))


@triton.jit
def _route_tile(t0, live, hit, logits_ptr, scale_ptr, w_ptr, ids_ptr, T, OUT_T, E, stride_l,
                K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                NORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, COUNT: tl.constexpr, PARTS: tl.constexpr):
    """Routes rows t0 .. t0 + BLOCK_T - 1 (the module docstring's arithmetic) and stores their
    weights and ids (rows below OUT_T; those from T on as padding); -> `hit` with the experts
    their live rows picked added (COUNT)."""
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    slots = tl.arange(0, KP)
    rows = t0 + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    live_row = row_ok & (rows < live)
    # a padding row's logits are never read (it routes to no expert whatever they hold):
    # it computes on zeros, and its picks are replaced below
    read_ok = live_row[:, None] & col_ok[None, :]
    if PARTS:  # the logits: each row's K chunks in chunk order, whatever the row count
        raw = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
        for part in tl.static_range(PARTS):  # unrolled: the loads go out together
            raw += tl.load(logits_ptr + (part * T + rows.to(tl.int64))[:, None] * stride_l + cols[None, :],
                           mask=read_ok, other=0.0, cache_modifier=".cg")
        raw = raw.to(w_ptr.dtype.element_ty).to(tl.float32)
    else:
        raw = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                      mask=read_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    x = tl.where(col_ok[None, :], raw, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
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
    ok = (rows < OUT_T)[:, None] & slot_ok
    tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)
    return hit


@triton.jit
def _moe_route_kernel(logits_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l,
                      K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      NORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIVE: tl.constexpr,
                      COUNT: tl.constexpr, PDL: tl.constexpr = False):
    """Program p routes the row tiles p, p + P, ...; with COUNT (one program) it adds the call and
    the union of its live rows' experts to `counts`."""
    pdl_wait(PDL)
    _route_tiles(logits_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l, tl.program_id(0),
                 tl.num_programs(0), K_TOP, KP, BLOCK_T, BLOCK_E, NORMALIZE, HAS_SCALE, HAS_LIVE, COUNT)


@triton.jit
def _prefetch_router_then_wait(PDL: tl.constexpr, router_ptr, H, E, stride_r, ROUTER_N: tl.constexpr,
                               CHUNK: tl.constexpr):
    """The router kernel's start under programmatic dependent launch (kernels/_pdl.py), where it
    may run while the previous kernel still does: ask L2 for the lines of this program's router
    tile (the router's weights, which no kernel writes; no register is written and nothing is
    waited for), then wait for the previous kernel, before any access to x. Without PDL: nothing."""
    if PDL:
        LINE: tl.constexpr = 1024 // router_ptr.dtype.element_ty.primitive_bitwidth  # elements a line
        experts = tl.minimum(tl.program_id(0) * ROUTER_N + tl.arange(0, ROUTER_N), E - 1)
        cols = tl.minimum(tl.program_id(1) * CHUNK + tl.arange(0, CHUNK // LINE) * LINE, H - 1)
        prefetch_l2(router_ptr + experts.to(tl.int64)[:, None] * stride_r + cols[None, :])
        tl.extra.cuda.gdc_wait()


@triton.jit
def _router_dot_tile(t0, n_live, w, offs_k, k_ok, experts, e_ok, x_ptr, parts_ptr, T, H, E, stride_x,
                     BLOCK_T: tl.constexpr, ROUTER_N: tl.constexpr, ROUTER_K: tl.constexpr, PREC: tl.constexpr,
                     WIDEN: tl.constexpr, pre_w_ptr, pw, pre_factor, eps, PRE_NORM: tl.constexpr):
    """The partial logits `w [ROUTER_N, CHUNK] @ x[rows, chunk].T` of rows t0 .. t0 + BLOCK_T - 1
    (those below n_live; float32, one dot), stored to this program's chunk of `parts`."""
    dt = x_ptr.dtype.element_ty
    rows = t0 + tl.arange(0, BLOCK_T)
    r_ok = rows < n_live
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_k[None, :],
                mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    if PRE_NORM:  # each row's float32 sum of squares over the same K loop, whatever the row count
        offs_s = tl.arange(0, ROUTER_K)
        sq = tl.zeros((BLOCK_T,), tl.float32)
        for s0 in range(0, H, ROUTER_K):
            xs = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + (s0 + offs_s)[None, :],
                         mask=r_ok[:, None] & ((s0 + offs_s) < H)[None, :], other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt_rn(sq / H + eps)
        # the twin's roundings: the norm, the weight's product, the factor's product
        x = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
        x = ((x * pw[None, :]).to(dt).to(tl.float32) * pre_factor).to(dt)
    acc = tl.zeros((ROUTER_N, BLOCK_T), tl.float32)
    if WIDEN:  # the interpreter multiplies bf16/f16 raw bits: widen (the products are equal)
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    tl.store(parts_ptr + (tl.program_id(1) * T + rows.to(tl.int64))[None, :] * E + experts[:, None], acc,
             mask=e_ok[:, None] & r_ok[None, :])


@triton.jit
def _router_route_kernel(x_ptr, router_ptr, parts_ptr, cnt_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr,
                         T, H, E, stride_x, stride_r, K_TOP: tl.constexpr, KP: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ROUTER_N: tl.constexpr,
                         ROUTER_K: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr, NORMALIZE: tl.constexpr,
                         HAS_SCALE: tl.constexpr, HAS_LIVE: tl.constexpr, COUNT: tl.constexpr, PREC: tl.constexpr,
                         WIDEN: tl.constexpr, pre_w_ptr=None, pre_factor=1.0, eps=0.0, PRE_NORM: tl.constexpr = False,
                         ROW_TILES: tl.constexpr = 0, routed_ptr=None, ROUTED: tl.constexpr = False,
                         OUT_T=None, PDL: tl.constexpr = False):
    """Program (p, c): the float32 partial logits of experts p*ROUTER_N ... over hidden columns
    c*CHUNK ... (one of the PARTS chunks) for every row tile, one dot a row tile, stored to
    `parts [PARTS, T, E]`; the last program to arrive (an arrival counter, put back to 0) sums each
    row's chunks in chunk order, rounds them to the model dtype and routes every row. The router
    tile's lines are asked of L2 before the PDL wait (no earlier kernel writes the router), so
    its read overlaps the kernel before. PRE_NORM: x is `router_pre_norm_ref(x, pre_w,
    pre_factor, eps)`, each row's statistic over one ROUTER_K-column loop of the whole hidden size.
    ROW_TILES > 0: the row tiles unrolled (STATIC_ROW_TILES), not a loop over the live rows.
    ROUTED: the last program also writes the live rows' experts, ranked, to `routed` (`_route_tiles`).
    OUT_T: the call's rows (None: T), of which only the first T are read and routed (a host
    bound: `router_route`'s `bound`), the rest stored as padding."""
    _prefetch_router_then_wait(PDL, router_ptr, H, E, stride_r, ROUTER_N, CHUNK)
    experts = tl.program_id(0) * ROUTER_N + tl.arange(0, ROUTER_N)
    e_ok = experts < E
    offs_k = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    k_ok = offs_k < H
    w = tl.load(router_ptr + experts.to(tl.int64)[:, None] * stride_r + offs_k[None, :],
                mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    pw = 0.0
    if PRE_NORM:
        pw = tl.load(pre_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    # only the live rows' logits: a padding row routes to no expert, so its x is never read
    # and its partials never written (tiles past the last live row are not visited at all)
    n_live = T
    if HAS_LIVE:
        n_live = tl.minimum(tl.load(live_ptr), T)
    if ROW_TILES:  # unrolled, each tile skipped at run time past the live rows
        for tile in tl.static_range(ROW_TILES):
            if tile * BLOCK_T < n_live:
                _router_dot_tile(tile * BLOCK_T, n_live, w, offs_k, k_ok, experts, e_ok, x_ptr, parts_ptr, T, H, E,
                                 stride_x, BLOCK_T, ROUTER_N, ROUTER_K, PREC, WIDEN, pre_w_ptr, pw, pre_factor, eps,
                                 PRE_NORM)
    else:
        for t0 in range(0, n_live, BLOCK_T):
            _router_dot_tile(t0, n_live, w, offs_k, k_ok, experts, e_ok, x_ptr, parts_ptr, T, H, E, stride_x,
                             BLOCK_T, ROUTER_N, ROUTER_K, PREC, WIDEN, pre_w_ptr, pw, pre_factor, eps, PRE_NORM)
    # every thread's partials are stored before one thread announces them (release) ...
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * PARTS - 1:  # ... and the last program reads them through L2
        _route_tiles(parts_ptr, scale_ptr, live_ptr, w_ptr, ids_ptr, counts_ptr, T, E, E, 0, 1, K_TOP, KP,
                     BLOCK_T, BLOCK_E, NORMALIZE, HAS_SCALE, HAS_LIVE, COUNT, PARTS, ROW_TILES, routed_ptr, ROUTED,
                     OUT_T)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def _check_routing(n_exp: int, k: int, live, counts, scale) -> None:
    if not 1 <= k <= n_exp:
        raise ValueError(f"top-k {k} must lie in [1, {n_exp}] (the router's experts)")
    if live is not None and (live.shape != (1,) or live.dtype != torch.int32):
        raise ValueError(f"live rows must be an int32 [1] tensor, got {live.dtype} {tuple(live.shape)}")
    if counts is not None and (counts.shape != (2,) or counts.dtype != torch.int64):
        raise ValueError(f"counts must be an int64 [2] tensor, got {counts.dtype} {tuple(counts.shape)}")
    if scale is not None and scale.shape != (n_exp,):
        raise ValueError(f"scale must be [{n_exp}], got {tuple(scale.shape)}")


def moe_route(logits: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref` in one launch (module docstring): `logits [t, E]` (model dtype; rows
    contiguous), `k` in [1, E], `live` int32 `[1]` or None, `counts` int64 `[2]` or None, `scale
    [E]` or None -> weights `[t, k]` (logits' dtype), ids `[t, k]` int64."""
    check_tensors(*(x for x in (logits, live, counts, scale) if x is not None))
    check_dtype(logits, "logits")
    t, n_exp = logits.shape
    _check_routing(n_exp, k, live, counts, scale)
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
        HAS_LIVE=live is not None, COUNT=fused, num_warps=route_warps(triton.next_power_of_2(n_exp)),
        **pdl_args(logits))
    if counts is not None and not fused:
        count_experts(counts, ids, n_exp)
    return weights, ids


def router_eligible(x: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether `router_route` takes `x [t, hidden]` and `router [E, hidden]`: a step's rows (up
    to COUNT_ROWS), one float dtype, the router's rows contiguous, E up to MAX_EXPERTS."""
    return (x.dim() == 2 and router.dim() == 2 and x.shape[0] <= COUNT_ROWS and x.shape[1] == router.shape[1]
            and x.dtype == router.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and 1 <= router.shape[0] <= MAX_EXPERTS and router.stride(1) == 1)


def router_route(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 pre_norm: tuple[torch.Tensor, float, float] | None = None, *,
                 routed: torch.Tensor | None = None, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_route_ref` in one launch: the router's logits `x @ router.T` (`x [t, hidden]`, t up
    to COUNT_ROWS; `router [E, hidden]`; float32 dots, rounded to the model dtype), a program per
    ROUTER_N experts, and the last program to arrive routes every row from them as `moe_route`
    does (its picks, weights, padding rows and count). `pre_norm` `(weight [hidden] in x's dtype,
    factor, eps)`: x normed first (`router_pre_norm_ref`), in the same launch. `routed` (int32
    `[E]`, written): the live rows' experts in ascending index, then E (`routed_experts_ref`), for
    the expert kernels' grid (`memra_kernels.moe`). `bound` (a host int >= 1, or None): rows from
    it on are padding too, whatever `live` says (a plain decode step reads one row: it routes at
    most k experts, and `routed` lists at most `bound * k`). -> weights `[t, k]`, ids `[t, k]` int64."""
    pre_w, factor, eps = pre_norm if pre_norm is not None else (None, 1.0, 0.0)
    check_tensors(*(v for v in (x, router, live, counts, scale, pre_w) if v is not None))
    if pre_w is not None and (pre_w.shape != (x.shape[-1],) or pre_w.dtype != x.dtype or pre_w.stride(0) != 1):
        raise ValueError(f"pre-norm weight {tuple(pre_w.shape)} {pre_w.dtype}: expected [{x.shape[-1]}] {x.dtype}, "
                         "contiguous")
    if not router_eligible(x, router):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and router {tuple(router.shape)} {router.dtype}: expected "
                         f"[t <= {COUNT_ROWS}, hidden] and [E <= {MAX_EXPERTS}, hidden] of one float dtype, "
                         "the router's rows contiguous")
    t, n_exp = x.shape[0], router.shape[0]
    _check_routing(n_exp, k, live, counts, scale)
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
        raise ValueError(f"bound must be a positive int or None, got {bound!r}")
    if routed is not None and (routed.shape != (n_exp,) or routed.dtype != torch.int32 or not routed.is_contiguous()
                               or routed.device != x.device):
        raise ValueError(f"routed must be a contiguous int32 [{n_exp}] tensor on {x.device}, got {routed.dtype} "
                         f"{tuple(routed.shape)} on {routed.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    chunks = triton.cdiv(x.shape[1], ROUTER_CHUNK)
    # with a bound, only the first rows are read and routed: the launch is a call of those rows
    # (its row count a constant where it is 1) that stores the others as padding
    rows = t if bound is None else min(t, bound)
    parts = torch.empty((chunks, rows, n_exp), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, k), dtype=x.dtype, device=x.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=x.device)
    if t == 0:
        if routed is not None:
            routed.fill_(n_exp)
        return weights, ids
    _router_route_kernel[(triton.cdiv(n_exp, ROUTER_N), chunks)](
        x, router, parts, counters("moe_router", x.device, 1), x if scale is None else scale,
        x if live is None else live, weights, ids, ids if counts is None else counts, rows, x.shape[1], n_exp,
        x.stride(0), router.stride(0), K_TOP=k, KP=triton.next_power_of_2(k), BLOCK_T=BLOCK_T,
        BLOCK_E=triton.next_power_of_2(n_exp), ROUTER_N=ROUTER_N, ROUTER_K=ROUTER_K, CHUNK=ROUTER_CHUNK,
        PARTS=chunks, NORMALIZE=normalize,
        HAS_SCALE=scale is not None, HAS_LIVE=live is not None, COUNT=counts is not None,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=interpreting() and x.device.type != "cuda",
        pre_w_ptr=x if pre_w is None else pre_w, pre_factor=float(factor), eps=float(eps), PRE_NORM=pre_w is not None,
        ROW_TILES=triton.cdiv(t, BLOCK_T) if STATIC_ROW_TILES else 0,
        routed_ptr=ids if routed is None else routed, ROUTED=routed is not None, OUT_T=None if rows == t else t,
        num_warps=route_warps(triton.next_power_of_2(n_exp)),
        **({} if ROUTER_STAGES is None else {"num_stages": ROUTER_STAGES}), **pdl_args(x))
    return weights, ids
