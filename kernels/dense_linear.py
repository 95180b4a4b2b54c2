"""Dense linear for the few rows of a decode step: y = x @ W.T with W in bf16 / f16 / f32.

A decode, verify or drafter step multiplies 1..32 rows by a large weight, so its cost is reading
W once. cuBLAS does that well for the widest matrices but not for the middle-sized ones a layer
has, well below the copy speed of the same bytes (docs/tuning.md#dense-linear).
This kernel streams the weight in tiles through a software pipeline (the loads feed `tl.dot`
directly, so they become asynchronous copies several tiles ahead) and splits `in` over enough
programs to keep every multiprocessor reading.

Layout of the work: program (n tile, k split, m tile) computes acc [BLOCK_N, BLOCK_M] = W[tile,
split] @ x[rows, split].T: the weight tile is the dot's left operand, whose large side fills the
matrix units' 64-row instruction shape even when x has one row. x rows beyond M are zeros.

Determinism (the engine's fixed-width exactness rests on it): the tile sizes and the split count
are a function of (out, in) alone (`config_for`), never of M; a row's products and their
summation order do not depend on the other rows (each output element is its own dot); the
split partials are summed in split order by the last program of a tile (an arrival counter, no
float atomics). So a row's output is bit-identical whether it is multiplied alone or with up to
any number of other rows, and from call to call.

Where it is used: the Triton step ops' `linear` (engine/layers/triton_step_ops.py) for a bf16 / f16
weight whose (out, in) is in `TUNED` (the engine's shapes, chosen by measuring the whole step on
the H200) and a call of at most `MAX_ROWS` rows; everything else keeps `F.linear`. Under
programmatic dependent launch it starts while the previous kernel runs and asks L2 for its first
`PDL_PREFETCH` weight tiles before waiting (`_prefetch_then_wait`).

SwiGLU epilogue (`glu=True`, the step ops' `swiglu`): for the MLP's fused [gate; up] weight a
program's tile takes gate rows and the up rows of the same output columns (`_splitk.tile_rows`, by
pointer: the weight keeps its layout), and its epilogue writes silu(gate) * up with the SiLU·mul
kernel's code (`activation.silu_mul_rounded`), so the result is that of the two launches bit for
bit, without the [rows, 2 I] round trip and the second launch.

Argmax epilogue (`argmax_out=`, the step ops' `lm_head_argmax`): each program also folds its
tile's rounded outputs into one int64 key a row (argmax.py's keys: the largest value, the first
column among equals, NaN the largest), `atomic_max`es it into the row's slot, and the last program
of an m tile (an arrival counter) writes each row's column and resets the slots. An integer
maximum is exact in any order, so the picks are `row_argmax(dense_linear(x, w))` bit for bit, for
any row count, without the two argmax launches and the logits' re-read.

Residual add and folded norm (`dense_linear_add_norm`, a `PendingNorm` as x; the step ops'
`linear_add_rms_norm`): a layer's o or down projection writes the residual stream
`h + round(x @ W.T)` (rounded as the two launches round) and, per row and n tile, the float32 sum of
squares of its tile of that sum (`sq [M, n tiles]`); the next matmul (gate/up, the next layer's
q/k/v, the lm_head) sums a row's partials, computes its `rstd` as the norm kernel does, and
multiplies each x tile by it and the norm weight as it loads it, rounding where the norm kernel
rounds. The squares are summed as one pairwise tree over the row in index order (kernels/_sumsq.py),
whatever the tile widths of either matmul, so a row's statistic depends on its own values only
(row invariance) and equals its twin's (`norm_ref.add_rms_norm_tree_ref`) bit for bit; against
`norm.add_rms_norm`, whose `tl.sum` follows the thread layout, only that sum's order differs. The
add + norm launch between the matmuls and the normed rows' round trip are gone.

Public API: `KernelConfig`, `PendingNorm`, `TUNED`, `config_for`, `dense_linear`,
`dense_linear_add_norm`, `dense_linear_norm`, `dense_linear_ref`, `eligible`, `eligible_rows`, `load_tuned`, `MAX_ROWS`,
`PDL_PREFETCH`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_tensors, interpreting, next_pow2
from ._pdl import pdl_args, prefetch_l2
from ._splitk import counters, split_for, store_or_reduce, tile_rows
from ._sumsq import pairwise_rows
from .argmax import _column_of, _keys
from .rope import qkv_rope_epilogue

__all__ = ["KernelConfig", "PendingNorm", "TUNED", "config_for", "dense_linear", "dense_linear_add_norm",
           "dense_linear_norm", "dense_linear_ref", "eligible", "eligible_rows", "load_tuned", "MAX_ROWS"]

# Rows a call may have for the step ops to take the kernel (each 16-row tile re-reads W, so past
# a couple of tiles cuBLAS's large-M kernels win; full prefill chunks never come here).
MAX_ROWS = 32
BLOCK_M = 16


@dataclass(frozen=True)
class KernelConfig:
    """Tiles of one launch: block_n output features and block_k `in` columns per loop step,
    split_k programs sharing a tile's `in` range, warps and pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def check(self) -> "KernelConfig":
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        return self


# (out, in) -> tiles: the engine's shapes at the fastest tiles of the H200 sweep at M = 16
# (benchmarks/gpu/dense_linear_sweep.py); a shape absent here runs F.linear in the step ops.
# Fused q/k/v and gate/up tie cuBLAS alone but keep the layer one chain of early launches.
# Per-shape numbers: docs/tuning.md#dense-linear.
_C = KernelConfig
TUNED: dict[tuple[int, int], KernelConfig] = {
    (6144, 4096): _C(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4),
    (24576, 4096): _C(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    (4096, 4096): _C(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=5),
    (4096, 12288): _C(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4),
    (151936, 4096): _C(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
    (4096, 20480): _C(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4),
    (2048, 4096): _C(block_n=64, block_k=256, split_k=4, num_warps=4, num_stages=3),
    # Qwen3.5-4B (hybrid); the attention's o shares the DeltaNet out's shape (docs/tuning.md#dense-linear)
    (12352, 2560): _C(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    (2560, 4096): _C(block_n=32, block_k=128, split_k=4, num_warps=2, num_stages=4),
    (10240, 2560): _C(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    (18432, 2560): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3),
    (2560, 9216): _C(block_n=32, block_k=128, split_k=4, num_warps=4, num_stages=4),
    (248320, 2560): _C(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # LLaMA-3.1-8B's down and lm_head, from an H100 sweep (its gate/up ties cuBLAS there and stays
    # on F.linear; docs/tuning.md#dense-linear)
    (4096, 14336): _C(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4),
    (128256, 4096): _C(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4),
    # Qwen3-30B-A3B's q/k/v and lm_head, from an H100 sweep: alone each ties cuBLAS, in the step
    # the q/k/v's rope rides its epilogue (unsplit, as that and the argmax need;
    # docs/moe.md#the-a3b-weights-on-the-dense-kernel)
    (5120, 2048): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4),
    (151936, 2048): _C(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4),
    # the embedded pair (memra_cli/assets, hidden 256): q/k/v, o (and the drafters' fused k/v),
    # gate/up, down (and the drafters' fc over 3 taps), lm_head. Its step is a chain of tiny
    # launches, and on the dense kernel every launch fusion of the step ops applies; the whole
    # bench decided (docs/bench.md#the-embedded-pair-on-the-dense-kernel). block_n 32 lies inside
    # a 64-wide head (the q/k/v epilogue's rule); the lm_head unsplit for its argmax.
    (512, 256): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2),
    (256, 256): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2),
    (1536, 256): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2),
    (256, 768): _C(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=2),
    (4096, 256): _C(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=2),
}

# Weight tiles a program asks L2 for before it waits for the previous kernel, when kernels launch
# with programmatic dependent launch (kernels/_pdl.py); chosen in the 8B step: docs/tuning.md#pdl-prefetch.
PDL_PREFETCH = 2

def _heuristic(n: int, k: int) -> KernelConfig:
    """Tiles for a shape outside TUNED (direct calls only): 64 x 128 tiles, `in` split until
    there are about two programs per multiprocessor, keeping >= 2 loop steps per program."""
    block_n, block_k = 64, 128
    return KernelConfig(block_n=block_n, block_k=block_k, split_k=split_for(-(-n // block_n), -(-k // block_k)))


def config_for(n: int, k: int, itemsize: int = 2) -> KernelConfig:
    """The fixed tiles for a weight [n, k] of `itemsize`-byte floats (the same for every M).
    TUNED is measured in bf16; wider floats drop pipeline stages until the weight and x tiles fit
    the shared memory the bf16 stages take (float32 weights run on the GPU only when called
    directly: the step ops send them to cuBLAS)."""
    cfg = (TUNED.get((int(n), int(k))) or _heuristic(int(n), int(k))).check()
    budget = 2 * cfg.num_stages * (cfg.block_n + BLOCK_M) * cfg.block_k
    stages = cfg.num_stages
    while stages > 2 and itemsize * stages * (cfg.block_n + BLOCK_M) * cfg.block_k > budget:
        stages -= 1
    if stages != cfg.num_stages:
        cfg = KernelConfig(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, stages)
    if itemsize * stages * (cfg.block_n + BLOCK_M) * cfg.block_k > budget:
        cfg = KernelConfig(cfg.block_n, max(16, cfg.block_k // 2), cfg.split_k, cfg.num_warps, stages)
    return cfg


@triton.jit
def _prefetch_then_wait(PDL: tl.constexpr, PREFETCH: tl.constexpr, w_ptr, N, K, stride_wn, SPLIT_K,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr):
    """The kernel's start under programmatic dependent launch (kernels/_pdl.py), where it may run
    while the previous kernel still does: ask L2 for the lines of this program's first PREFETCH
    weight tiles (weights, which no kernel writes; no register is written and nothing is waited
    for), then wait for the previous kernel, before any access to x. Without PDL: nothing."""
    if PDL:
        if PREFETCH > 0:
            LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements a line
            rows, _ = tile_rows(tl.program_id(0), N, BLOCK_N, GLU)
            k0 = tl.program_id(1) * tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
            cols = tl.minimum(k0 + tl.arange(0, PREFETCH * BLOCK_K // LINE) * LINE, K - 1)
            prefetch_l2(w_ptr + rows[:, None] * stride_wn + cols[None, :])
        tl.extra.cuda.gdc_wait()


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _dense_linear_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                         stride_om, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                         PREC: tl.constexpr, WIDEN: tl.constexpr, PREFETCH: tl.constexpr = 0,
                         GLU: tl.constexpr = False, PDL: tl.constexpr = False, ARGMAX: tl.constexpr = False,
                         keys_ptr=None, picks_ptr=None, acnt_ptr=None, ROPE: tl.constexpr = False,
                         NORM: tl.constexpr = False, HD: tl.constexpr = 0, q_w_ptr=None, k_w_ptr=None,
                         cos_ptr=None, sin_ptr=None, pos_ptr=None, q_out_ptr=None, k_cache_ptr=None,
                         v_cache_ptr=None, stride_cos=0, stride_sin=0, stride_qo=0, stride_kc_h=0, stride_kc_s=0,
                         stride_vc_h=0, stride_vc_s=0, n_heads=0, n_kv=0, eps=0.0, RESID: tl.constexpr = False,
                         res_ptr=None, stride_res=0, sq_ptr=None, NORM_IN: tl.constexpr = False, sq_in_ptr=None,
                         nw_ptr=None, NT_IN=0, NT_POW2: tl.constexpr = 1, norm_eps=0.0,
                         PLAIN_SQUARE: tl.constexpr = False, ADD_RES: tl.constexpr = True):
    """out [M, N] = x [M, K] @ w [N, K].T for one (n tile, k split, m tile) per program; with GLU,
    out [M, N / 2] = silu(x @ gate.T) * (x @ up.T) for w = [gate; up] (`_splitk.tile_rows`).

    With SPLIT (SPLIT_K > 1, a run-time count) the tile's partials meet in ws [SPLIT_K, M, N]
    and the last program to arrive sums them in split order (kernels/_splitk.py).

    With PDL the kernel starts early (`_prefetch_then_wait`) and lets the next kernel launch only
    once its loop is done (a kernel launched earlier would hold multiprocessor slots idle while
    this one streams the weight).

    RESID: the residual add and the next norm's partial sums of squares in the epilogue
    (`_splitk._store_out`; without ADD_RES the sums of squares of the product alone). NORM_IN: x
    is a residual stream whose RMSNorm (weight nw, eps norm_eps) is applied to each x tile as it
    is loaded, with each row's statistic summed from the producer's NT_IN partials
    `sq_in [M, NT_IN]` (`_norm_rstd`).
    """
    _prefetch_then_wait(PDL, PREFETCH, w_ptr, N, K, stride_wn, SPLIT_K, BLOCK_N, BLOCK_K, GLU)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n, n_mask = tile_rows(pid_n, N, BLOCK_N, GLU)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M

    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_begin = pid_k * per_split
    t_end = tl.minimum(t_begin + per_split, k_tiles)
    k0 = t_begin * BLOCK_K
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if NORM_IN:
        rstd = _norm_rstd(sq_in_ptr, offs_m, m_mask, NT_IN, K, norm_eps, BLOCK_M, NT_POW2)
        nw_ptrs = nw_ptr + k0 + offs_k
    for t in range(t_begin, t_end):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            if NORM_IN:
                x = _normed(x, rstd, tl.load(nw_ptrs))
        else:
            k_ok = (t * BLOCK_K + offs_k) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            if NORM_IN:
                x = _normed(x, rstd, tl.load(nw_ptrs, mask=k_ok, other=0.0))
        if NORM_IN:
            nw_ptrs += BLOCK_K
        if WIDEN:  # the interpreter multiplies bf16/f16 raw bits: widen (the products are equal)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]

    # the weight rows name the tile's columns of the split-K workspace (one per row, gate or up)
    if ROPE:  # q/k norm + rope + the K/V write by each head's last program (rope.qkv_rope_epilogue)
        qkv_rope_epilogue(acc, ws_ptr, cnt_ptr, offs_m, m_mask, M, N, SPLIT_K, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                          pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_qo,
                          stride_kc_h, stride_kc_s, stride_vc_h, stride_vc_s, n_heads, n_kv, eps,
                          HD, BLOCK_M, BLOCK_N, NORM)
    else:
        store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, rows_n, m_mask, n_mask, M, N, stride_om, SPLIT_K,
                        SPLIT, BLOCK_M, BLOCK_N, GLU, RESID, res_ptr, stride_res, sq_ptr, PLAIN_SQUARE, ADD_RES)
        if ARGMAX:
            _argmax_epilogue(acc.to(out_ptr.dtype.element_ty).to(tl.float32), rows_n, offs_m, m_mask, n_mask,
                             keys_ptr, picks_ptr, acnt_ptr)


@triton.jit
def _norm_rstd(sq_ptr, offs_m, m_mask, NT, K, eps, BLOCK_M: tl.constexpr, NT_POW2: tl.constexpr):
    """Each row's `1 / sqrt(mean(x^2) + eps)` from its NT partial sums of squares `sq [M, NT]`,
    summed in _sumsq's order, then rounded step by step as the norm kernel's (norm.py) -> [BLOCK_M]."""
    cols = tl.arange(0, NT_POW2)
    parts = tl.load(sq_ptr + offs_m.to(tl.int64)[:, None] * NT + cols[None, :],
                    mask=m_mask[:, None] & (cols < NT)[None, :], other=0.0)
    mean_sq = pairwise_rows(parts, BLOCK_M, NT_POW2) / K
    return 1.0 / tl.sqrt_rn(mean_sq + eps)


@triton.jit
def _normed(x, rstd, nw):
    """The RMSNorm of x tile `[BLOCK_M, BLOCK_K]` with the rows' `rstd [BLOCK_M]` and the weight's
    tile `nw [BLOCK_K]` (x's dtype), rounded as the norm kernel rounds (to x's dtype before the
    weight multiply, that product in float32, rounded once)."""
    dt = x.dtype
    return (nw.to(tl.float32)[None, :] * (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _argmax_epilogue(vals, cols, offs_m, m_mask, n_mask, keys_ptr, picks_ptr, acnt_ptr):
    """Fold a tile's rounded outputs `vals [BLOCK_M, BLOCK_N]` (float32) into each row's key slot;
    the m tile's last program writes the rows' columns to picks and resets slots and counter."""
    best = tl.max(_keys(vals, cols[None, :], m_mask[:, None] & n_mask[None, :]), axis=1)
    tl.atomic_max(keys_ptr + offs_m, best, mask=m_mask, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # every row's max is in before one thread announces the tile
    arrived = tl.atomic_add(acnt_ptr + tl.program_id(2), 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        top = tl.atomic_xchg(keys_ptr + offs_m, -1, mask=m_mask, sem="acq_rel", scope="gpu")  # read and reset
        tl.store(picks_ptr + offs_m, _column_of(top), mask=m_mask)
        tl.atomic_xchg(acnt_ptr + tl.program_id(2), 0, sem="relaxed", scope="gpu")


class PendingNorm(NamedTuple):
    """A residual stream whose RMSNorm the next dense matmul applies as it loads it (module
    docstring, "Residual add and folded norm"): `rows [t, d]` (the stream: also the layer's new
    residual), `sumsq` float32 `[t, tiles]` (the producing matmul's per-n-tile sums of squares),
    the norm's `weight [d]` (rows' dtype) and `eps`. `norm.rms_norm_partials(rows, sumsq, weight,
    eps)` is the normed tensor, bit for bit, where a consumer cannot fold it."""

    rows: torch.Tensor
    sumsq: torch.Tensor
    weight: torch.Tensor
    eps: float


def _norm_in_args(x) -> tuple[torch.Tensor, dict]:
    """`x` (a tensor, or a PendingNorm) -> (the rows the kernel reads, the NORM_IN launch arguments)."""
    if not isinstance(x, PendingNorm):
        return x, {}
    rows, sq, nw = x.rows, x.sumsq, x.weight
    if rows.dim() != 2 or sq.dim() != 2 or sq.shape[0] != rows.shape[0] or sq.dtype != torch.float32 \
            or not sq.is_contiguous() or nw.shape != (rows.shape[1],) or nw.dtype != rows.dtype or nw.stride(0) != 1:
        raise ValueError(f"a pending norm takes rows [t, d], sumsq float32 [t, tiles] and a contiguous weight [d] of "
                         f"the rows' dtype, got {tuple(rows.shape)} {rows.dtype}, {tuple(sq.shape)} {sq.dtype}, "
                         f"{tuple(nw.shape)} {nw.dtype}")
    check_tensors(rows, sq, nw)
    return rows, dict(NORM_IN=True, sq_in_ptr=sq, nw_ptr=nw, NT_IN=sq.shape[1], NT_POW2=next_pow2(sq.shape[1]),
                      norm_eps=float(x.eps))


def eligible(x, w: torch.Tensor) -> bool:
    """Whether the step ops route `x @ w.T` here: a TUNED weight shape, the same 16-bit float
    dtype on both sides (TUNED is measured in bf16), contiguous rows, at most MAX_ROWS rows. `x`
    may be a PendingNorm (its rows; its weight of their dtype)."""
    if isinstance(x, PendingNorm):
        if x.weight.dtype != x.rows.dtype:
            return False
        x = x.rows
    return eligible_rows(x.numel() // max(x.shape[-1], 1), x.shape[-1], x.dtype, w)


def eligible_rows(rows: int, width: int, dtype: torch.dtype, w: torch.Tensor) -> bool:
    """`eligible` for an x of `rows` rows of `width` in `dtype`, told by its shape alone."""
    return (w.dim() == 2 and (w.shape[0], w.shape[1]) in TUNED and dtype == w.dtype
            and w.element_size() == 2 and width == w.shape[1] and w.stride(1) == 1 and rows <= MAX_ROWS)


def dense_linear(x, w: torch.Tensor, *, config: KernelConfig | None = None,
                 out: torch.Tensor | None = None, glu: bool = False,
                 argmax_out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 sumsq_out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., out] = x [..., in] @ w [out, in].T on the kernel, in x's dtype (float32
    accumulation). `config` overrides the shape's tiles (benchmarks, tests); `out` (x's dtype,
    contiguous, or 2-D rows with a contiguous last axis: a column slice of a wider buffer, such
    as a step's concatenated taps) receives the result if given.

    glu: `w` is a fused [gate; up] weight [2 I, in] and the result is the SwiGLU middle
    y [..., I] = silu(x @ gate.T) * (x @ up.T), computed in the same launch and equal bit for bit
    to `activation.silu_mul(dense_linear(x, w))` (the same tiles, each product rounded to x's
    dtype before the activation), one launch and one [.., 2 I] round trip fewer.

    argmax_out: int64 `[rows]` (x 2-D) that receives each row's `row_argmax` of the result (the
    argmax epilogue, module docstring); a shape whose tiles split `in` is refused (its outputs
    exist only after the split sum).

    x a PendingNorm: its rows are normed as they are loaded (`_normed`: the bits of
    `norm.rms_norm_partials`), module docstring. residual (`[rows, out]`, x's dtype,
    plain weights only): the result is `residual + x @ w.T`, each rounded as the two launches
    round, and `sumsq_out` (float32 `[rows, n tiles]`, n tiles = ceil(out / block_n)) receives each
    row's per-tile sums of squares of it: `dense_linear_add_norm`. `sumsq_out` without a residual:
    the sums of squares of the result itself (`dense_linear_norm`)."""
    x, norm_in = _norm_in_args(x)
    check_tensors(x, w)
    check_dtype(x, "x")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match a weight {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {w.dtype}")
    if w.stride(1) != 1:
        raise ValueError("the weight's rows must be contiguous")
    n, k = w.shape
    if glu and n % 2:
        raise ValueError(f"glu needs a fused [gate; up] weight with an even row count, got {tuple(w.shape)}")
    n_out = n // 2 if glu else n
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (*lead, n_out) or out.dtype != x.dtype or not (
            out.is_contiguous() or (out.dim() == 2 and out.stride(1) == 1)):
        raise ValueError(f"out must be a {(*lead, n_out)} {x.dtype} tensor, contiguous or 2-D rows with a "
                         "contiguous last axis")
    if m == 0:
        return out
    cfg = config.check() if config is not None else config_for(n, k, x.element_size())
    epilogue = {}  # the argmax or residual epilogue's launch arguments
    if argmax_out is not None:
        epilogue = _argmax_args(argmax_out, x2, glu, cfg, triton.cdiv(m, BLOCK_M))
    if residual is not None or sumsq_out is not None:
        epilogue = _residual_args(residual, sumsq_out, out, glu or argmax_out is not None,
                                  triton.cdiv(n, cfg.block_n))
    # a GLU tile holds block_n / 2 output columns (their gate and up rows)
    grid = (triton.cdiv(n_out, cfg.block_n // 2 if glu else cfg.block_n), cfg.split_k, triton.cdiv(m, BLOCK_M))
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        cnt = counters("dense_linear", x.device, grid[0] * grid[2])
    else:
        ws, cnt = out, out  # never touched: the split-K branch is compiled out
    _dense_linear_kernel[grid](
        x2, w, out, ws, cnt, m, n, k, x2.stride(0), w.stride(0), out.stride(-2) if out.dim() > 1 else n_out,
        cfg.split_k,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split_k > 1,
        EVEN_K=k % cfg.block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",  # f32 x: a true f32 product
        WIDEN=interpreting() and x.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, GLU=glu,
        PREFETCH=PDL_PREFETCH, **epilogue, **norm_in, **pdl_args(x),  # the prefetch runs only with PDL (_prefetch_then_wait)
    )
    return out


def _residual_args(residual: torch.Tensor | None, sumsq: torch.Tensor | None, out: torch.Tensor,
                   other_epilogue: bool, n_tiles: int) -> dict:
    """The residual epilogue's launch arguments (RESID; no residual: the sums of squares alone),
    its tensors checked."""
    if other_epilogue:
        raise ValueError("residual and sumsq_out take a plain weight (no glu, no argmax_out)")
    if out.dim() != 2:
        raise ValueError(f"residual and sumsq_out take 2-D rows, got {tuple(out.shape)}")
    if residual is not None and (residual.shape != out.shape or residual.dtype != out.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be a {tuple(out.shape)} {out.dtype} tensor with contiguous rows, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if sumsq is None or sumsq.shape != (out.shape[0], n_tiles) or sumsq.dtype != torch.float32 \
            or not sumsq.is_contiguous():
        raise ValueError(f"residual needs sumsq_out, a contiguous float32 [{out.shape[0]}, {n_tiles}] tensor")
    check_tensors(out, sumsq, *([] if residual is None else [residual]))
    return dict(RESID=True, res_ptr=out if residual is None else residual,
                stride_res=0 if residual is None else residual.stride(0), sq_ptr=sumsq,
                PLAIN_SQUARE=interpreting(), ADD_RES=residual is not None)


def dense_linear_add_norm(x, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, *,
                          config: KernelConfig | None = None, out: torch.Tensor | None = None) -> PendingNorm:
    """`add_rms_norm(dense_linear(x, w), residual, norm_w, eps)` with the norm left pending (its
    statistic in kernels/_sumsq.py's order: twin `norm_ref.add_rms_norm_tree_ref`):
    one launch writes the new residual stream `residual + x @ w.T` (the rows) and its per-tile sums
    of squares; the next `dense_linear` / `dense_qkv_rope_kv_write` given the PendingNorm applies
    the norm as it loads the rows. x `[t, in]` (or itself a PendingNorm), w `[d, in]`, residual
    `[t, d]`, norm_w `[d]` of x's dtype; `config` overrides the shape's tiles (tests); `out`
    (`dense_linear`'s) receives the new residual stream, the PendingNorm's rows."""
    return _pending(x, w, residual, norm_w, eps, config, out)


def dense_linear_norm(x, w: torch.Tensor, norm_w: torch.Tensor, eps: float, *,
                      config: KernelConfig | None = None) -> PendingNorm:
    """`rms_norm(dense_linear(x, w), norm_w, eps)` with the norm left pending, as
    `dense_linear_add_norm` without the residual: one launch writes `x @ w.T` (the rows) and its
    per-tile sums of squares (a drafter's context features, `hidden_norm(fc(taps))`, normed by
    the k/v projections that read them). Twin: `norm_ref.rms_norm_tree_ref` of `dense_linear_ref`."""
    return _pending(x, w, None, norm_w, eps, config)


def _pending(x, w: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
             config: KernelConfig | None, out: torch.Tensor | None = None) -> PendingNorm:
    """`(residual +) x @ w.T` and its per-tile sums of squares in one launch, as a PendingNorm."""
    rows = _norm_in_args(x)[0]
    n = w.shape[0]
    if norm_w.shape != (n,) or norm_w.dtype != rows.dtype:
        raise ValueError(f"norm_w must be [{n}] {rows.dtype}, got {tuple(norm_w.shape)} {norm_w.dtype}")
    cfg = config.check() if config is not None else config_for(*w.shape, rows.element_size())
    sumsq = torch.empty((rows.shape[0], triton.cdiv(n, cfg.block_n)), dtype=torch.float32, device=rows.device)
    out = dense_linear(x, w, config=cfg, residual=residual, sumsq_out=sumsq, out=out)
    return PendingNorm(out, sumsq, norm_w, float(eps))


def qkv_rope_eligible(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Whether `dense_qkv_rope_kv_write` takes the fused projection `x @ w.T`: the step ops'
    `linear` would take this kernel (`eligible`), and the shape's n tiles lie inside heads."""
    return eligible(x, w) and _tiles_in_heads(w, head_dim)


def _tiles_in_heads(w: torch.Tensor, head_dim: int) -> bool:
    """`w`'s n tiles each inside one head of `head_dim` (a power of two: the epilogue's halves)."""
    return (head_dim & (head_dim - 1) == 0 and w.dim() == 2 and w.shape[0] % head_dim == 0
            and head_dim % config_for(*w.shape, w.element_size()).block_n == 0)


def dense_qkv_rope_kv_write(x: torch.Tensor, w: torch.Tensor, q_norm_w: torch.Tensor | None,
                            k_norm_w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                            positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """`rope.qk_norm_rope_kv_write(dense_linear(x, w), ...)` (norm weights None:
    `rope.rope_kv_write`, LLaMA) in one launch: each head's last program rounds its projection as
    dense_linear does and norms, rotates and writes it (the projection itself is never stored;
    the norm's sum of squares may run in another order than the rope kernel's: `rope.qkv_rope_epilogue`).
    x `[t, hidden]`, w `[(nh + 2 nkv) hd, hidden]` with `qkv_rope_eligible`; the rest as
    `qk_norm_rope_kv_write`'s. Returns rotated q `[t, nh, hd]`."""
    from .rope import _check

    x, norm_in = _norm_in_args(x)
    n, k = w.shape
    hd = cos.shape[1]
    check_tensors(x, w)
    check_dtype(x, "x")
    if not _tiles_in_heads(w, hd) or w.dtype != x.dtype or x.dim() != 2 or x.shape[1] != w.shape[1] \
            or w.stride(1) != 1 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"the fused q/k/v projection takes x [t <= {MAX_ROWS}, in] and a weight of its dtype with "
                         f"contiguous rows whose tiles lie inside heads of {hd}, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(w.shape)} {w.dtype}")
    norm = q_norm_w is not None
    t = x.shape[0]
    # the unfused op's checks, on a stand-in for the projection it would have read
    _check(x.new_empty((t, n)), (q_norm_w, k_norm_w) if norm else (), cos, sin, positions, k_cache, v_cache,
           n_heads, n_kv)
    q = torch.empty((t, n_heads, hd), dtype=x.dtype, device=x.device)
    if t == 0:
        return q
    x2 = x if x.stride(1) == 1 else x.contiguous()
    cfg = config_for(n, k, x.element_size())
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(t, BLOCK_M))
    ws = torch.empty((cfg.split_k, t, n), dtype=torch.float32, device=x.device)
    cnt = counters("dense_qkv_rope", x.device, grid[2] * (n // hd))
    _dense_linear_kernel[grid](
        x2, w, q, ws, cnt, t, n, k, x2.stride(0), w.stride(0), 0, cfg.split_k,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split_k > 1, EVEN_K=k % cfg.block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=interpreting() and x.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PREFETCH=PDL_PREFETCH,
        ROPE=True, NORM=norm, HD=hd, q_w_ptr=q_norm_w if norm else cos, k_w_ptr=k_norm_w if norm else cos,
        cos_ptr=cos, sin_ptr=sin, pos_ptr=positions, q_out_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache,
        stride_cos=cos.stride(0), stride_sin=sin.stride(0), stride_qo=q.stride(0), stride_kc_h=k_cache.stride(0),
        stride_kc_s=k_cache.stride(1), stride_vc_h=v_cache.stride(0), stride_vc_s=v_cache.stride(1),
        n_heads=n_heads, n_kv=n_kv, eps=float(eps), **norm_in, **pdl_args(x),
    )
    return q


_KEYS: dict[tuple, torch.Tensor] = {}


def _argmax_args(argmax_out: torch.Tensor, x2: torch.Tensor, glu: bool, cfg: KernelConfig, m_tiles: int) -> dict:
    """The argmax epilogue's launch arguments: its key slots (int64, -1 between calls: the last
    program resets them, like the split-K counters; per device and stream) and arrival counters."""
    m = x2.shape[0]
    if glu or cfg.split_k > 1:
        raise ValueError("argmax_out needs a plain (not glu) weight whose tiles do not split `in`")
    if argmax_out.shape != (m,) or argmax_out.dtype != torch.long or argmax_out.device != x2.device:
        raise ValueError(f"argmax_out must be int64 [{m}] on {x2.device}, got {argmax_out.dtype} {tuple(argmax_out.shape)}")
    stream = torch.cuda.current_stream(x2.device).cuda_stream if x2.device.type == "cuda" else 0
    key = (x2.device.type, x2.device.index, stream)
    keys = _KEYS.get(key)
    if keys is None or keys.numel() < m:
        keys = _KEYS[key] = torch.full((max(m, MAX_ROWS),), -1, dtype=torch.long, device=x2.device)
    return dict(ARGMAX=True, keys_ptr=keys, picks_ptr=argmax_out,
                acnt_ptr=counters("dense_linear_argmax", x2.device, m_tiles))


def dense_linear_ref(x: torch.Tensor, w: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """The obviously-right version: float32 x @ w.T, rounded to x's dtype (glu: then the
    SwiGLU middle of its two halves, `activation.silu_mul_ref`)."""
    y = (x.float() @ w.float().T).to(x.dtype)
    if glu:
        from .activation import silu_mul_ref

        y = silu_mul_ref(y)
    return y


def load_tuned(path) -> dict[tuple[int, int], KernelConfig]:
    """Replace TUNED with the table a sweep wrote (benchmarks/gpu/dense_linear_sweep.py
    `--tuned`: {"OUTxIN": {block_n, block_k, split_k, num_warps, num_stages}}), for a benchmark
    that times a candidate table before its first launch; returns the table."""
    import json
    from pathlib import Path

    raw = json.loads(Path(path).read_text())
    table = {}
    for key, cfg in raw.items():
        n, k = (int(v) for v in key.split("x"))
        table[(n, k)] = KernelConfig(**cfg).check()
    TUNED.clear()
    TUNED.update(table)
    return table
