"""The routed experts of a few-row step: grouped GLU and the weighted combine, three launches.

A decode or verify step of M rows (M <= 32, the verify width; a longer call runs in row tiles)
with top-k routing already computed (`experts [M, k]`, `weights [M, k]`) reads, per sparse
layer, the union of the experts its rows chose. The kernels read each routed expert's weights
once per step however many rows chose it, and never touch the others:

1. `_moe_gate_up_kernel`, one work item per (routed expert, `I` tile): the rows that picked the
   expert (found on the device, from `experts`) form one tile of x; gate and up are two dots over the
   same weight stream, act·mul in the epilogue (`activation.silu_mul_rounded`, or
   `gelu_tanh_mul_rounded` with `activation="gelu_tanh"`: Gemma 4's experts), written to the
   row's (row, slot) line of an `[M*k, I]` buffer.
2. `_moe_down_kernel`, one work item per (routed expert, hidden tile): the down matmul of those
   lines, written to `[M*k, hidden]` (model dtype).
3. `_moe_combine_kernel`, one program per (row, hidden tile): the row's k expert outputs times
   their routing weights, added in ascending expert index from zeros; in
   `moe_swiglu_add_rms_norm` (a step's sparse-layer end) one program per row, which then adds
   the residual and norms the sum as `norm.add_rms_norm` does; in
   `moe_swiglu_shared_add_rms_norm_1p` (the Qwen3.5 MoE hybrid's layer end) it first adds the
   gated shared expert's output and norms as `norm.add_rms_norm_1p` (zero-centred) does; in
   `moe_gemma_add_norm` (Gemma 4's MoE layer end) it runs the layer's sandwich norms: its own
   post norm, the dense MLP's, their sum's, the residual add, the layer scalar and the next norm.

The two matmuls run a program per (expert, tile) of every expert for each row tile
(`MoeConfig.programs_per_sm = 0`, `CONFIG`'s); a program whose expert no row of its tile picked
exits after reading the ids. A step's router hands over its ranked expert list (`routed`:
`moe_route.router_route`'s, the live rows' experts in ascending index, then E): the grid is then
(tile, rank, row tile), so the routed experts' programs come first in launch order and none of
them waits for the block scheduler to get through the exiting programs of the experts no row
picked (most of them, at one live row); a rank past the list exits. Where the router was told
that at most `bound` rows are live (a plain decode step reads one), the list holds at most
`bound * k` experts and the grid has that many ranks (`max_routed`): no program is launched for
the experts no row could have picked. Without a bound the grid still holds no more ranks than
the call's rows can fill, `t * k` (a 16-row step of a 256-expert top-8 model: 128, not 256).
`programs_per_sm` > 0 runs that many programs per multiprocessor instead, each finding the
tile's routed experts from the ids and looping over its share of their work items (no program
for an unrouted expert; slower where measured, kept for the A/B). Nothing is read on the host
and the launches take the same arguments every step (a CUDA graph can hold them).

Exactness (the fixed-width rule, extended to any row count): a token's output never depends on
which or how many other rows share its experts, nor on M. The tiles are a function of the weight
shapes alone, and a work item's arithmetic does not depend on the program that runs it; every
dot is one row of x against the weight tile over the same K loop (a row's place in the row tile
does not change its products or their order); a row's combine reads only its own k lines, in its
own fixed order. Roundings are the twin's (`moe_ref.moe_swiglu_ref`,
op for op in the model dtype), so kernel and twin differ only in float32 summation order.

Preconditions (what `moe_route` produces): expert ids in [0, E), distinct within a row; or a
padding row (a fixed step's, `moe_route`'s live rows), every id E: no program finds it among its
expert's rows, so it costs no weight read, and its combine writes zeros.

Public API: `MoeConfig`, `CONFIG`, `BLOCK_M`, `ACTIVATIONS`, `eligible`, `norm_eligible`,
`shared_eligible`, `gemma_eligible`, `multiprocessors`, `moe_swiglu`, `moe_swiglu_add_rms_norm`,
`moe_swiglu_shared_add_rms_norm_1p`, `moe_gemma_add_norm`, and the twins `moe_swiglu_ref`,
`moe_swiglu_add_rms_norm_ref`, `moe_swiglu_shared_add_rms_norm_1p_ref`, `moe_gemma_add_norm_ref`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_tensors, interpreting
from ._pdl import pdl_args, pdl_wait
from .activation import gelu_tanh_mul_rounded, silu_mul_rounded
from .moe_ref import (ACTIVATIONS, check_activation, moe_gemma_add_norm_ref, moe_swiglu_add_rms_norm_ref,  # noqa: F401
                      moe_swiglu_ref, moe_swiglu_shared_add_rms_norm_1p_ref)  # (the twins)
from .gemma4 import _row_norm
from .norm import _num_warps as _norm_warps, add_rms_norm, rms_rstd

__all__ = ["MoeConfig", "CONFIG", "BLOCK_M", "ACTIVATIONS", "eligible", "norm_eligible", "shared_eligible",
           "gemma_eligible", "multiprocessors", "moe_swiglu", "moe_swiglu_add_rms_norm",
           "moe_swiglu_shared_add_rms_norm_1p", "moe_gemma_add_norm", "moe_swiglu_ref", "moe_swiglu_add_rms_norm_ref",
           "moe_swiglu_shared_add_rms_norm_1p_ref", "moe_gemma_add_norm_ref"]

_ACT_CODE = {"silu": 0, "gelu_tanh": 1}  # the gate/up kernel's ACT switch, by ACTIVATIONS' names

# Rows a program multiplies: a step of up to BLOCK_M rows (the verify width) reads each routed
# expert once; a longer call (a prefill chunk) runs row tiles of BLOCK_M, each reading its own.
BLOCK_M = 32
COMBINE_BLOCK = 1024  # hidden columns a combine program adds
NORM_MAX = 16384  # the widest hidden the combine's fused norm holds in one program


@dataclass(frozen=True)
class MoeConfig:
    """Tiles: block_i gate/up rows (and as many up rows) and block_n down rows per work item,
    block_k reduction columns per loop step; warps and pipeline stages of the two matmuls;
    `programs_per_sm`: the two matmuls' programs per multiprocessor, each looping over the work
    items (routed expert, tile) of its row tile; 0: one program per (expert, tile) of every
    expert instead, those of an expert no row picked exiting at once."""

    block_i: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 0

    def check(self) -> "MoeConfig":
        for name in ("block_i", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.programs_per_sm < 0:
            raise ValueError(f"programs_per_sm must be >= 0, got {self.programs_per_sm}")
        return self


# The launch tiles (not M-dependent: changing them changes no row's order across M) and the grid
# (a program per (expert, tile): faster than the work items at every row count measured), chosen
# by the sweeps in docs/moe.md "Kernel tiles".
CONFIG = MoeConfig()
# Whether the matmuls take a call's ranked expert list (`routed`, the router kernel's) when handed
# one: the A/B knob of that grid order (docs/moe.md#the-expert-kernels); the same bits either way.
TAKE_ROUTED = True


@triton.jit
def _rows_of_expert(ids_ptr, e, m0, M, K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row tile starting at m0: its row ids [BLOCK_M], whether each row picked expert `e`,
    and the top-k slot it sits in (0 where it did not pick `e`)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, KP)
    valid = (rows[:, None] < M) & (slots[None, :] < K_TOP)
    ids = tl.load(ids_ptr + rows.to(tl.int64)[:, None] * K_TOP + slots[None, :], mask=valid, other=-1)
    hit = ids == e
    picked = tl.max(hit.to(tl.int32), axis=1) > 0
    slot = tl.sum(tl.where(hit, slots[None, :], 0), axis=1)
    return rows, picked, slot


@triton.jit
def _routed_experts(ids_ptr, m0, M, E, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The experts some row of the row tile at m0 picked: (whether each of `BLOCK_E` experts was,
    int32 [BLOCK_E]; how many were; each one's rank among them, ascending by index). A padding
    row's ids (E) and the rows past M pick none."""
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    picks = tl.zeros((BLOCK_M, BLOCK_E), tl.int32)
    for j in tl.static_range(K_TOP):
        ids = tl.load(ids_ptr + rows.to(tl.int64) * K_TOP + j, mask=rows < M, other=-1)
        picks += (ids[:, None] == cols[None, :]).to(tl.int32)
    hit = ((tl.max(picks, axis=0) > 0) & (cols < E)).to(tl.int32)
    return hit, tl.sum(hit, axis=0), tl.cumsum(hit, axis=0) - 1


@triton.jit
def _nth_expert(hit, rank, u, BLOCK_E: tl.constexpr):
    """The expert of rank `u` among the routed ones (`_routed_experts`)."""
    cols = tl.arange(0, BLOCK_E)
    return tl.sum(tl.where((hit > 0) & (rank == u), cols, 0), axis=0)


@triton.jit
def _dot(w, x, acc, PREC: tl.constexpr, WIDEN: tl.constexpr):
    """acc [BLOCK_W, BLOCK_M] += w [BLOCK_W, BLOCK_K] @ x[BLOCK_M, BLOCK_K].T in float32: the
    weight tile is the left operand, whose large side fills the matrix units even for one row."""
    if WIDEN:  # the interpreter multiplies bf16/f16 raw bits: widen (the products are equal)
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc, input_precision=PREC)


@triton.jit
def _gate_up_item(x_ptr, wgu_ptr, act_ptr, e, tile, rows, picked, slot, H, I, stride_xm, stride_we, stride_wr,
                  K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_I: tl.constexpr, PREC: tl.constexpr, WIDEN: tl.constexpr,
                  ACT: tl.constexpr):
    """One work item: act [(row, slot), I tile `tile`] of expert e for the `picked` rows."""
    offs_i = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = wgu_ptr + e.to(tl.int64) * stride_we + offs_i[:, None] * stride_wr + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wr
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros((BLOCK_I, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_M), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        if EVEN_K and EVEN_I:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            g = tl.load(g_ptrs, mask=i_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=i_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=picked[:, None] & k_ok[None, :], other=0.0)
        acc_g = _dot(g, x, acc_g, PREC, WIDEN)
        acc_u = _dot(u, x, acc_u, PREC, WIDEN)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dt = act_ptr.dtype.element_ty
    # gate and up rounded to the model dtype first, as the twin's matmul output is
    if ACT == 1:
        act = gelu_tanh_mul_rounded(tl.trans(acc_g).to(dt), tl.trans(acc_u).to(dt), dt)  # [BLOCK_M, BLOCK_I]
    else:
        act = silu_mul_rounded(tl.trans(acc_g).to(dt), tl.trans(acc_u).to(dt), dt)
    line = (rows * K_TOP + slot).to(tl.int64)
    tl.store(act_ptr + line[:, None] * I + offs_i[None, :], act, mask=picked[:, None] & i_ok[None, :])


@triton.jit
def _routed_count(routed_ptr, E, BLOCK_E: tl.constexpr):
    """How many experts the call's `routed [E]` list holds (its entries below E)."""
    cols = tl.arange(0, BLOCK_E)
    return tl.sum((tl.load(routed_ptr + cols, mask=cols < E, other=0x7FFFFFFF) < E).to(tl.int32), axis=0)


@triton.jit
def _grid_expert(routed_ptr, ROUTED: tl.constexpr):
    """A grid program's (expert, tile): program (tile, rank, row tile) takes the expert of its
    rank in the call's `routed` list (E past the list), program (expert, tile, row tile) its own."""
    if ROUTED:
        return tl.load(routed_ptr + tl.program_id(1)), tl.program_id(0)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit(do_not_specialize=["M"])
def _moe_gate_up_kernel(x_ptr, ids_ptr, wgu_ptr, act_ptr, M, H, I, E, stride_xm, stride_we, stride_wr,
                        K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_I: tl.constexpr, PREC: tl.constexpr,
                        WIDEN: tl.constexpr, ACT: tl.constexpr = 0, ITEMS: tl.constexpr = False,
                        BLOCK_E: tl.constexpr = 16, routed_ptr=None, ROUTED: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """act [(row, slot), I tile] = a(x_row @ gate_e.T) * (x_row @ up_e.T) for the rows of a row
    tile that picked expert e; `wgu [E, 2I, H]` (gate rows first); a = silu (ACT 0) or
    gelu_tanh (ACT 1). ITEMS: program (p, row tile) takes the work items p, p + P, ... of the
    routed (expert, I tile) pairs, experts ascending; else program (e, I tile, row tile), or with
    ROUTED program (I tile, rank, row tile) for the expert of that rank in the call's `routed`
    list (the routed experts' programs first in launch order; a rank past the list exits)."""
    pdl_wait(PDL)
    if ITEMS and ROUTED:  # the items of the call's routed list; an expert none of this tile's rows picked skips
        m0 = tl.program_id(1) * BLOCK_M
        n_tiles = tl.cdiv(I, BLOCK_I)
        for w in range(tl.program_id(0), _routed_count(routed_ptr, E, BLOCK_E) * n_tiles, tl.num_programs(0)):
            e = tl.load(routed_ptr + w // n_tiles)
            rows, picked, slot = _rows_of_expert(ids_ptr, e, m0, M, K_TOP, KP, BLOCK_M)
            if tl.max(picked.to(tl.int32), axis=0) > 0:
                _gate_up_item(x_ptr, wgu_ptr, act_ptr, e, w % n_tiles, rows, picked, slot, H, I, stride_xm,
                              stride_we, stride_wr, K_TOP, BLOCK_M, BLOCK_I, BLOCK_K, EVEN_K, EVEN_I, PREC, WIDEN,
                              ACT)
    elif ITEMS:
        m0 = tl.program_id(1) * BLOCK_M
        hit, n_routed, rank = _routed_experts(ids_ptr, m0, M, E, K_TOP, BLOCK_M, BLOCK_E)
        n_tiles = tl.cdiv(I, BLOCK_I)
        for w in range(tl.program_id(0), n_routed * n_tiles, tl.num_programs(0)):
            e = _nth_expert(hit, rank, w // n_tiles, BLOCK_E)
            rows, picked, slot = _rows_of_expert(ids_ptr, e, m0, M, K_TOP, KP, BLOCK_M)
            _gate_up_item(x_ptr, wgu_ptr, act_ptr, e, w % n_tiles, rows, picked, slot, H, I, stride_xm, stride_we,
                          stride_wr, K_TOP, BLOCK_M, BLOCK_I, BLOCK_K, EVEN_K, EVEN_I, PREC, WIDEN, ACT)
    else:
        e, tile = _grid_expert(routed_ptr, ROUTED)
        if e < E:  # a rank past the routed list: none
            rows, picked, slot = _rows_of_expert(ids_ptr, e, tl.program_id(2) * BLOCK_M, M, K_TOP, KP, BLOCK_M)
            if tl.max(picked.to(tl.int32), axis=0) > 0:
                _gate_up_item(x_ptr, wgu_ptr, act_ptr, e, tile, rows, picked, slot, H, I, stride_xm, stride_we,
                              stride_wr, K_TOP, BLOCK_M, BLOCK_I, BLOCK_K, EVEN_K, EVEN_I, PREC, WIDEN, ACT)


@triton.jit
def _down_item(act_ptr, wd_ptr, y_ptr, e, tile, rows, picked, slot, H, I, stride_we, stride_wr,
               K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr, WIDEN: tl.constexpr):
    """One work item: y [(row, slot), hidden tile `tile`] of expert e for the `picked` rows."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    line = (rows * K_TOP + slot).to(tl.int64)
    w_ptrs = wd_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wr + offs_k[None, :]
    a_ptrs = act_ptr + line[:, None] * I + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = (k0 + offs_k) < I
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=picked[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(w, a, acc, PREC, WIDEN)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = tl.trans(acc).to(y_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_N]
    tl.store(y_ptr + line[:, None] * H + offs_n[None, :], y, mask=picked[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _moe_down_kernel(act_ptr, ids_ptr, wd_ptr, y_ptr, M, H, I, E, stride_we, stride_wr,
                     K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr,
                     WIDEN: tl.constexpr, ITEMS: tl.constexpr = False, BLOCK_E: tl.constexpr = 16,
                     routed_ptr=None, ROUTED: tl.constexpr = False, PDL: tl.constexpr = False):
    """y [(row, slot), hidden tile] = act[(row, slot)] @ down_e.T for the rows of a row tile that
    picked expert e; `wd [E, H, I]`; ITEMS and ROUTED as the gate/up kernel's, over (expert,
    hidden tile)."""
    pdl_wait(PDL)
    if ITEMS and ROUTED:
        m0 = tl.program_id(1) * BLOCK_M
        n_tiles = tl.cdiv(H, BLOCK_N)
        for w in range(tl.program_id(0), _routed_count(routed_ptr, E, BLOCK_E) * n_tiles, tl.num_programs(0)):
            e = tl.load(routed_ptr + w // n_tiles)
            rows, picked, slot = _rows_of_expert(ids_ptr, e, m0, M, K_TOP, KP, BLOCK_M)
            if tl.max(picked.to(tl.int32), axis=0) > 0:
                _down_item(act_ptr, wd_ptr, y_ptr, e, w % n_tiles, rows, picked, slot, H, I, stride_we, stride_wr,
                           K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, PREC, WIDEN)
    elif ITEMS:
        m0 = tl.program_id(1) * BLOCK_M
        hit, n_routed, rank = _routed_experts(ids_ptr, m0, M, E, K_TOP, BLOCK_M, BLOCK_E)
        n_tiles = tl.cdiv(H, BLOCK_N)
        for w in range(tl.program_id(0), n_routed * n_tiles, tl.num_programs(0)):
            e = _nth_expert(hit, rank, w // n_tiles, BLOCK_E)
            rows, picked, slot = _rows_of_expert(ids_ptr, e, m0, M, K_TOP, KP, BLOCK_M)
            _down_item(act_ptr, wd_ptr, y_ptr, e, w % n_tiles, rows, picked, slot, H, I, stride_we, stride_wr,
                       K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, PREC, WIDEN)
    else:
        e, tile = _grid_expert(routed_ptr, ROUTED)
        if e < E:  # a rank past the routed list: none
            rows, picked, slot = _rows_of_expert(ids_ptr, e, tl.program_id(2) * BLOCK_M, M, K_TOP, KP, BLOCK_M)
            if tl.max(picked.to(tl.int32), axis=0) > 0:
                _down_item(act_ptr, wd_ptr, y_ptr, e, tile, rows, picked, slot, H, I, stride_we, stride_wr,
                           K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, PREC, WIDEN)


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, wts_ptr, out_ptr, H, E, stride_om, res_ptr, norm_w_ptr, res_out_ptr, eps,
                        K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr = False,
                        shared_ptr=None, gate_ptr=None, SHARED: tl.constexpr = False,
                        ZERO_CENTRED: tl.constexpr = False, dense_ptr=None, post1_ptr=None, post2_ptr=None,
                        post_ff_ptr=None, scalar_ptr=None, GEMMA: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[row, tile] = Σ_j weights[row, j] · y[(row, j)], the j taken in ascending expert index,
    each product and each add rounded to the model dtype, from zeros (the twin's order); zeros
    for a padding row (ids E), whose lines no expert wrote. SHARED: then out += sigmoid(gate[row])
    · shared[row] (Qwen3.5 MoE's gated shared expert; the sigmoid, the product and the add each
    rounded). NORM (one tile holds the row): then res_out = out + residual and out = the RMSNorm
    of res_out by norm_w, `norm.add_rms_norm`'s arithmetic (HF Qwen3RMSNorm), or with
    ZERO_CENTRED `norm.add_rms_norm_1p`'s (norm_w the float32 1 + w, one rounding). GEMMA (one
    tile holds the row; not with NORM): Gemma 4's layer end, `moe_gemma_add_norm_ref`'s roundings:
    ff = norm(dense, post1) + norm(out, post2); res_out = (residual + norm(ff, post_ff)) * scalar;
    out = norm(res_out, norm_w), each Gemma's norm (`gemma4._row_norm`)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    slots = tl.arange(0, KP)
    valid = slots < K_TOP
    ids = tl.load(ids_ptr + row * K_TOP + slots, mask=valid, other=0x7FFFFFFF)  # padding slots rank last
    wts = tl.load(wts_ptr + row * K_TOP + slots, mask=valid, other=0.0).to(tl.float32)
    rank = tl.sum((ids[None, :] < ids[:, None]).to(tl.int32), axis=1)  # [KP]: experts of the row below slot j's
    real = tl.min(ids, axis=0) < E  # a padding row's ids are all E: nothing of it is read
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), tl.float32)
    for q in range(K_TOP):
        here = rank == q
        slot = tl.sum(tl.where(here, slots, 0), axis=0)
        w = tl.sum(tl.where(here, wts, 0.0), axis=0)  # one term: exact
        y = tl.load(y_ptr + (row * K_TOP + slot) * H + offs, mask=ok & real, other=0.0).to(tl.float32)
        acc = (acc + (y * w).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    if SHARED:  # a padding row too: its shared expert ran (the dense matmuls skip no row)
        g = tl.load(gate_ptr + row).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        sh = tl.load(shared_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        acc = (acc + (sig * sh).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    if GEMMA:  # Gemma 4's sandwich norms: every op rounded to the model dtype, as its twin's
        dense = tl.load(dense_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        ff = (_row_norm(dense, post1_ptr, eps, offs, ok, H, dt) + _row_norm(acc, post2_ptr, eps, offs, ok, H, dt))
        ff = ff.to(dt).to(tl.float32)
        r = tl.load(res_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        s = (r + _row_norm(ff, post_ff_ptr, eps, offs, ok, H, dt)).to(dt).to(tl.float32)
        s = (s * tl.load(scalar_ptr).to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * H + offs, s, mask=ok)
        acc = _row_norm(s.to(tl.float32), norm_w_ptr, eps, offs, ok, H, dt)
    if NORM:  # the residual add rounded to the model dtype first, then the norm of that sum
        r = tl.load(res_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        s = (acc + r).to(dt)
        tl.store(res_out_ptr + row * H + offs, s, mask=ok)
        x = s.to(tl.float32)
        nw = tl.load(norm_w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if ZERO_CENTRED:  # HF Qwen3_5RMSNorm: float32 all the way, one rounding
            acc = (x * rms_rstd(x, H, eps)) * nw
        else:
            acc = nw * (x * rms_rstd(x, H, eps)).to(dt).to(tl.float32)  # HF Qwen3RMSNorm rounds before the weight
    tl.store(out_ptr + row * stride_om + offs, acc.to(dt), mask=ok)


# Multiprocessors the interpreter's programs stand for: a few, so a step's items spread over
# several programs and some programs find none (what the tests exercise).
INTERPRETED_SMS = 3


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (CUDA), or `INTERPRETED_SMS` elsewhere (the interpreter)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else INTERPRETED_SMS


def eligible(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the step ops take the kernels: one float dtype for x and both weights, each
    weight's rows contiguous."""
    return (x.dim() == 2 and x.dtype == w_gate_up.dtype == w_down.dtype
            and w_gate_up.dim() == 3 and w_down.dim() == 3 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1)


def _check(x, weights, experts, w_gate_up, w_down) -> None:
    check_tensors(x, weights, experts, w_gate_up, w_down)
    check_dtype(x, "x")
    if x.dim() != 2 or weights.shape != experts.shape or weights.dim() != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(f"x [t, hidden] {tuple(x.shape)}, weights {tuple(weights.shape)} and experts "
                         f"{tuple(experts.shape)} [t, k] do not match")
    n_exp, two_i, h = w_gate_up.shape
    if h != x.shape[1] or two_i % 2 or tuple(w_down.shape) != (n_exp, h, two_i // 2):
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} are not "
                         f"[E, 2I, {x.shape[1]}] and [E, {x.shape[1]}, I]")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but the expert weights are {w_gate_up.dtype} / {w_down.dtype}")
    if w_gate_up.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("the expert weights' rows must be contiguous")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"experts: dtype {experts.dtype}, expected int32 or int64")


def moe_swiglu(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, activation: str = "silu", *, config: MoeConfig | None = None,
               routed: torch.Tensor | None = None, max_routed: int | None = None) -> torch.Tensor:
    """`moe_swiglu_ref` on the kernels: `x [t, hidden]`, `weights [t, k]`, `experts [t, k]`
    (ids in [0, E), distinct in a row; all E in a padding row), `w_gate_up [E, 2I, hidden]`, `w_down [E, hidden, I]`
    -> `[t, hidden]` in x's dtype (float32 accumulation); `activation` the gate's (`ACTIVATIONS`:
    silu, gelu_tanh). `config` overrides the tiles (tests, benchmarks). `routed` (int32 `[E]`):
    the call's routed experts ascending, then E (`moe_route.router_route`'s; the twin
    `routed_experts_ref`): the matmuls launch those experts' programs first; the same bits.
    `max_routed` (with `routed`): the list holds at most this many experts (`router_route`'s
    `bound` times k), so the grid has that many ranks, not E (a plain decode step's 8, not 128)."""
    out = torch.empty_like(x)
    lines = _expert_lines(x, weights, experts, w_gate_up, w_down, activation, config, routed, max_routed)
    if lines is None:
        return out.zero_()
    y, ids, wts = lines
    m, h = x.shape
    _moe_combine_kernel[(m, triton.cdiv(h, COMBINE_BLOCK))](
        y, ids, wts, out, h, w_gate_up.shape[0], out.stride(0), out, out, out, 0.0, K_TOP=ids.shape[1],
        KP=triton.next_power_of_2(ids.shape[1]), BLOCK=COMBINE_BLOCK, num_warps=4, **pdl_args(x))
    return out


def norm_eligible(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether `moe_swiglu_add_rms_norm` takes the residual and norm weight: x's shape and dtype,
    contiguous, one tile of a row (hidden up to `NORM_MAX`)."""
    return (residual.shape == x.shape and residual.dtype == x.dtype == norm_weight.dtype and residual.is_contiguous()
            and norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous() and x.shape[1] <= NORM_MAX)


def moe_swiglu_add_rms_norm(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            activation: str = "silu", *, config: MoeConfig | None = None,
                            routed: torch.Tensor | None = None, max_routed: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_swiglu_add_rms_norm_ref` on the kernels: `moe_swiglu`, then `new_residual = out +
    residual` and its RMSNorm by `norm_weight` in the combine's launch (a program per row, the
    norm's arithmetic) -> (normed, new_residual), `[t, hidden]` each. Needs `norm_eligible`.
    `routed` as `moe_swiglu`'s."""
    if not norm_eligible(x, residual, norm_weight):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} and norm weight "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} do not fit x {tuple(x.shape)} {x.dtype} "
                         f"(contiguous, x's dtype, hidden <= {NORM_MAX})")
    lines = _expert_lines(x, weights, experts, w_gate_up, w_down, activation, config, routed, max_routed)
    if lines is None:
        return add_rms_norm(torch.zeros_like(x), residual, norm_weight, eps)
    y, ids, wts = lines
    m, h = x.shape
    normed, new_residual = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _moe_combine_kernel[(m, 1)](
        y, ids, wts, normed, h, w_gate_up.shape[0], normed.stride(0), residual, norm_weight, new_residual, float(eps),
        K_TOP=ids.shape[1], KP=triton.next_power_of_2(ids.shape[1]), BLOCK=block, NORM=True,
        num_warps=_norm_warps(block), **pdl_args(x))
    return normed, new_residual


def shared_eligible(x: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                    w1p: torch.Tensor) -> bool:
    """Whether `moe_swiglu_shared_add_rms_norm_1p` takes these: `shared` and `residual` of x's
    shape and dtype, `gate [t, 1]` of x's dtype, `w1p [hidden]` float32, all contiguous, hidden up
    to `NORM_MAX`."""
    return (shared.shape == residual.shape == x.shape and shared.dtype == residual.dtype == gate.dtype == x.dtype
            and gate.shape == (x.shape[0], 1) and w1p.shape == (x.shape[1],) and w1p.dtype == torch.float32
            and all(v.is_contiguous() for v in (shared, gate, residual, w1p)) and x.shape[1] <= NORM_MAX)


def moe_swiglu_shared_add_rms_norm_1p(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                      w_gate_up: torch.Tensor, w_down: torch.Tensor, shared: torch.Tensor,
                                      gate: torch.Tensor, residual: torch.Tensor, w1p: torch.Tensor, eps: float,
                                      activation: str = "silu", *, config: MoeConfig | None = None,
                                      routed: torch.Tensor | None = None, max_routed: int | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_swiglu_shared_add_rms_norm_1p_ref` on the kernels (the Qwen3.5 MoE hybrid's layer
    end): `moe_swiglu`, whose combine (a program per row) also adds the gated shared expert
    (`shared [t, hidden]`, `gate [t, 1]`), the residual, and norms the sum by the float32 `w1p`
    (zero-centred) -> (normed, new_residual), `[t, hidden]` each. Needs `shared_eligible`.
    `routed` as `moe_swiglu`'s."""
    if not shared_eligible(x, shared, gate, residual, w1p):
        raise ValueError(f"shared {tuple(shared.shape)} {shared.dtype}, gate {tuple(gate.shape)} {gate.dtype}, "
                         f"residual {tuple(residual.shape)} {residual.dtype} and w1p {tuple(w1p.shape)} {w1p.dtype} "
                         f"do not fit x {tuple(x.shape)} {x.dtype} (contiguous; gate [t, 1]; w1p float32 [hidden]; "
                         f"hidden <= {NORM_MAX})")
    lines = _expert_lines(x, weights, experts, w_gate_up, w_down, activation, config, routed, max_routed)
    m, h = x.shape
    normed, new_residual = torch.empty_like(x), torch.empty_like(x)
    if m == 0:
        return normed, new_residual
    if lines is None:  # k = 0: no routed expert, the lines' buffer never read
        lines = (x, torch.zeros((m, 0), dtype=torch.int64, device=x.device), weights)
    y, ids, wts = lines
    block = triton.next_power_of_2(h)
    _moe_combine_kernel[(m, 1)](
        y, ids, wts, normed, h, w_gate_up.shape[0], normed.stride(0), residual, w1p, new_residual, float(eps),
        K_TOP=ids.shape[1], KP=max(1, triton.next_power_of_2(ids.shape[1])), BLOCK=block, NORM=True,
        shared_ptr=shared, gate_ptr=gate, SHARED=True, ZERO_CENTRED=True, num_warps=_norm_warps(block),
        **pdl_args(x))
    return normed, new_residual


def gemma_eligible(x: torch.Tensor, dense: torch.Tensor, residual: torch.Tensor, norms, w_next: torch.Tensor,
                   scalar: torch.Tensor) -> bool:
    """Whether `moe_gemma_add_norm` takes these: `dense` and `residual` of x's shape, the four
    norm weights `[hidden]` and `scalar [1]`, all in x's dtype and contiguous, hidden up to `NORM_MAX`."""
    vecs = (*norms, w_next)
    return (dense.shape == residual.shape == x.shape and len(norms) == 3 and scalar.shape == (1,)
            and all(v.shape == (x.shape[1],) for v in vecs) and x.shape[1] <= NORM_MAX
            and all(v.dtype == x.dtype and v.is_contiguous() for v in (dense, residual, scalar, *vecs)))


def moe_gemma_add_norm(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor, dense: torch.Tensor, residual: torch.Tensor, norms, w_next: torch.Tensor,
                       eps: float, scalar: torch.Tensor, *, config: MoeConfig | None = None,
                       routed: torch.Tensor | None = None, max_routed: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_gemma_add_norm_ref` on the kernels (Gemma 4's MoE layer end): the GELU-tanh experts,
    whose combine (a program per row) also norms their sum and the dense MLP's output `dense`,
    adds them, adds the post-feed-forward-normed sum to `residual`, scales by `scalar` and norms
    by `w_next` -> (new residual, normed), `[t, hidden]` each. Needs `gemma_eligible`. `routed`
    as `moe_swiglu`'s."""
    if not gemma_eligible(x, dense, residual, norms, w_next, scalar):
        raise ValueError(f"dense {tuple(dense.shape)}, residual {tuple(residual.shape)}, the norm weights and scalar "
                         f"do not fit x {tuple(x.shape)} {x.dtype} (x's dtype, contiguous, weights [hidden], "
                         f"scalar [1], hidden <= {NORM_MAX})")
    m, h = x.shape
    new_residual, normed = torch.empty_like(x), torch.empty_like(x)
    lines = _expert_lines(x, weights, experts, w_gate_up, w_down, "gelu_tanh", config, routed, max_routed)
    if m == 0:
        return new_residual, normed
    if lines is None:  # k = 0: no routed expert, the lines' buffer never read
        lines = (x, torch.zeros((m, 0), dtype=torch.int64, device=x.device), weights)
    y, ids, wts = lines
    block = triton.next_power_of_2(h)
    post_1, post_2, post_ff = norms
    _moe_combine_kernel[(m, 1)](
        y, ids, wts, normed, h, w_gate_up.shape[0], normed.stride(0), residual, w_next, new_residual, float(eps),
        K_TOP=ids.shape[1], KP=max(1, triton.next_power_of_2(ids.shape[1])), BLOCK=block, dense_ptr=dense,
        post1_ptr=post_1, post2_ptr=post_2, post_ff_ptr=post_ff, scalar_ptr=scalar, GEMMA=True,
        num_warps=_norm_warps(block), **pdl_args(x))
    return new_residual, normed


def _check_routed(routed, n_exp: int, device) -> None:
    if routed is not None and (routed.shape != (n_exp,) or routed.dtype != torch.int32 or not routed.is_contiguous()
                               or routed.device != device):
        raise ValueError(f"routed must be a contiguous int32 [{n_exp}] tensor on {device} (the routed experts "
                         f"ascending, then {n_exp}), got {routed.dtype} {tuple(routed.shape)} on {routed.device}")


def _expert_lines(x, weights, experts, w_gate_up, w_down, activation: str, config: MoeConfig | None, routed=None,
                  max_routed: int | None = None):
    """The gate/up and down launches: `(y [t*k, hidden], ids, weights)`, each (row, slot) line
    the row's output of that slot's expert (unwritten for a padding row); None when t or k is 0.
    `routed`: the call's routed experts, ranked (`routed_experts_ref`; taken while TAKE_ROUTED),
    at most `max_routed` of them."""
    check_activation(activation)
    _check(x, weights, experts, w_gate_up, w_down)
    _check_routed(routed, w_gate_up.shape[0], x.device)
    if max_routed is not None and (routed is None or isinstance(max_routed, bool) or not isinstance(max_routed, int)
                                   or max_routed < 1):
        raise ValueError(f"max_routed {max_routed!r}: expected a positive int, with a routed list")
    routed = routed if TAKE_ROUTED else None
    cfg = (config or CONFIG).check()
    m, h = x.shape
    n_exp, two_i, _ = w_gate_up.shape
    inter, k = two_i // 2, experts.shape[1]
    if m == 0 or k == 0:
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, wts = experts.contiguous(), weights.contiguous()
    act = torch.empty((m * k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((m * k, h), dtype=x.dtype, device=x.device)
    common = dict(K_TOP=k, KP=triton.next_power_of_2(k), BLOCK_M=BLOCK_M, BLOCK_K=cfg.block_k,
                  PREC="ieee" if x.dtype == torch.float32 else "tf32",  # f32 x: a true f32 product
                  WIDEN=interpreting() and x.device.type != "cuda", num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    row_tiles = triton.cdiv(m, BLOCK_M)
    programs = cfg.programs_per_sm * multiprocessors(x.device)
    tiles_i, tiles_n = triton.cdiv(inter, cfg.block_i), triton.cdiv(h, cfg.block_n)
    common.update(BLOCK_E=max(16, triton.next_power_of_2(n_exp)), ROUTED=routed is not None,
                  routed_ptr=ids if routed is None else routed)
    if programs:  # each program loops over its row tile's routed (expert, tile) items
        grid_gu = grid_down = (programs, row_tiles)
        common.update(ITEMS=True)
    elif routed is not None:  # a program per (tile, rank): the routed experts' programs launch first
        # a call's rows route to at most m * k experts (k distinct a row): a 16-row step of a
        # 256-expert top-8 model lists at most 128
        ranks = min(n_exp, m * k, max_routed or n_exp)
        grid_gu, grid_down = (tiles_i, ranks, row_tiles), (tiles_n, ranks, row_tiles)
    else:
        grid_gu = (n_exp, tiles_i, row_tiles)
        grid_down = (n_exp, tiles_n, row_tiles)
    _moe_gate_up_kernel[grid_gu](
        x, ids, w_gate_up, act, m, h, inter, n_exp, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        BLOCK_I=cfg.block_i, EVEN_K=h % cfg.block_k == 0, EVEN_I=inter % cfg.block_i == 0,
        ACT=_ACT_CODE[activation], **common, **pdl_args(x))
    _moe_down_kernel[grid_down](
        act, ids, w_down, y, m, h, inter, n_exp, w_down.stride(0), w_down.stride(1),
        BLOCK_N=cfg.block_n, EVEN_K=inter % cfg.block_k == 0, EVEN_N=h % cfg.block_n == 0, **common, **pdl_args(x))
    return y, ids, wts
