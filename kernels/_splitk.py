"""Split-K for the few-row matmul kernels (dense_linear, quant_linear): the split count for an
unmeasured shape, the arrival counters and the fixed-order sum of a tile's float32 partials (no
kernels launched here).

A matmul of a few rows by a wide-`in` weight splits `in` over SPLIT_K programs per output tile so
that every multiprocessor streams part of the weight. Each program writes its float32 partial to a
workspace `ws [SPLIT_K, M, N]` and bumps the tile's arrival counter; the last to arrive sums the
SPLIT_K partials in split order (the same order whatever order the programs ran in, so the bits
never depend on scheduling or on M) and writes the output, then puts the counter back to 0.

Both kernels use the grid (n tiles, SPLIT_K, m tiles); the tile's counter is
`pid_m * n_tiles + pid_n`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._sumsq import pairwise_rows, square_rn
from .activation import silu_mul_rounded

# Programs worth having in flight: two per multiprocessor of an H200 (132). A constant rather than
# the device's count, so a shape's tiles, hence its bits, are the same on every machine.
TARGET_PROGRAMS = 264


def split_for(n_tiles: int, k_tiles: int) -> int:
    """The split count for a shape outside a kernel's measured table: `in` halved again and again
    until there are about TARGET_PROGRAMS programs, keeping at least two k tiles per program."""
    split = 1
    while n_tiles * split * 2 <= TARGET_PROGRAMS and split * 2 * 2 <= k_tiles:
        split *= 2
    return split


# Arrival counters, one zeroed int32 per (m tile, n tile), per kernel family, device and stream:
# a tile's last program puts its counter back to 0, so they stay zero between calls (and inside
# CUDA graphs). Keyed by stream so that calls on two streams never share a counter.
_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(owner: str, device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters for `owner`'s launches on `device`'s current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (owner, device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """The weight rows of n tile `pid_n` -> (rows [BLOCK_N] int64, clamped into the weight, and
    which of them are real), for both few-row matmul kernels. Plain: rows pid_n * BLOCK_N + j. GLU (a fused [gate; up] weight of
    N = 2 I rows): the tile's first half is gate rows pid_n * BLOCK_N / 2 + j, its second half
    the up rows of the same output columns (I further down), so one program holds both factors
    of its outputs. Rows past the end read the last real row (in bounds, never stored), so full
    tiles load unmasked."""
    j = tl.arange(0, BLOCK_N)
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        inter = N // 2
        col = pid_n * HALF + j % HALF
        ok = col < inter
        rows = tl.minimum(col, inter - 1) + (j // HALF) * inter
    else:
        rows = pid_n * BLOCK_N + j
        ok = rows < N
        rows = tl.minimum(rows, N - 1)
    return rows.to(tl.int64), ok


@triton.jit
def _store_out(total, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, GLU: tl.constexpr, RESID: tl.constexpr = False, res_ptr=None, stride_res=0,
               sq_ptr=None, PLAIN_SQUARE: tl.constexpr = False, ADD_RES: tl.constexpr = True):
    """Write a tile's float32 result `total [BLOCK_M, BLOCK_N]` to `out` in out's dtype. GLU: the
    tile's columns are gate j then up j for j < BLOCK_N / 2 (`tile_rows`), and
    `out [M, N / 2]` gets silu(gate) * up, each factor first rounded to out's dtype as the
    unfused matmul's output is (activation.silu_mul_rounded: the same bits as the two launches).
    RESID (plain only): `out` gets the rounded product plus `res [M, N]`, rounded again (the
    residual add's bits), and `sq [M, n tiles]` column `program_id(0)` each row's sum of squares of
    the tile's sums in _sumsq's order (the next RMSNorm's partial, folded into the next matmul).
    RESID without ADD_RES: no residual, only the rounded product's sums of squares (a projection
    whose own output is normed next)."""
    dt = out_ptr.dtype.element_ty
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(total, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        cols = tl.program_id(0) * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + offs_m[:, None] * stride_om + cols[None, :],
                 silu_mul_rounded(gate.to(dt), up.to(dt), dt),
                 mask=m_mask[:, None] & (cols < N // 2)[None, :])
    else:
        mask = m_mask[:, None] & n_mask[None, :]
        y = total.to(dt)
        if RESID:
            if ADD_RES:
                res = tl.load(res_ptr + offs_m[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0)
                y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
            part = pairwise_rows(square_rn(tl.where(mask, y.to(tl.float32), 0.0), PLAIN_SQUARE), BLOCK_M, BLOCK_N)
            tl.store(sq_ptr + offs_m * tl.num_programs(0) + tl.program_id(0), part, mask=m_mask)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


@triton.jit
def store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_om,
                    SPLIT_K, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    GLU: tl.constexpr = False, RESID: tl.constexpr = False, res_ptr=None, stride_res=0, sq_ptr=None,
                    PLAIN_SQUARE: tl.constexpr = False, ADD_RES: tl.constexpr = True):
    """Write one program's `acc [BLOCK_M, BLOCK_N]` (float32) for rows `offs_m`, columns `offs_n`
    (of the [M, N] product; GLU: see `_store_out`): straight to `out` without SPLIT; with it, as
    partial `program_id(1)` of the tile, the last of the tile's SPLIT_K programs to arrive summing
    the partials in split order and writing the result (RESID: see `_store_out`)."""
    if not SPLIT:
        _store_out(acc, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om, BLOCK_M, BLOCK_N, GLU, RESID, res_ptr,
                   stride_res, sq_ptr, PLAIN_SQUARE, ADD_RES)
    else:
        ws_mask = m_mask[:, None] & n_mask[None, :]
        ws_off = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + tl.program_id(1) * M * N + ws_off, acc, mask=ws_mask)
        # every thread's partial is stored before one thread announces it (release) ...
        tl.debug_barrier()
        tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # ... and the last one reads them through L2 (.cg: never a stale L1 line)
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * M * N + ws_off, mask=ws_mask, other=0.0, cache_modifier=".cg")
            _store_out(total, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om, BLOCK_M, BLOCK_N, GLU, RESID,
                       res_ptr, stride_res, sq_ptr, PLAIN_SQUARE, ADD_RES)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
