"""A greedy round's `argmax` over each row of its logits: one launch, one program per row.

On the H200, a graphed speculative round of the small embedded model spent ~15 µs in
`logits.argmax(dim=-1)` over float32 logits `[16, 4096]` (and ~9 µs in the drafter's argmax):
PyTorch's generic reduce kernel, built for any shape and dim. The job is 16 rows of 16 KiB, which
one program per row reads in a single pass, ~2-3 µs for the launch and the reads. A round is a
CUDA graph of small kernels, so those microseconds are a visible slice of every token.

`row_argmax(x)` launches one program per row of `x [rows, V]` (float32, bf16 or f16; any row
stride, the last axis contiguous). The program walks its row in `BLOCK`-sized tiles, keeping for
each lane of the tile a running maximum and the column where that lane first saw it, then folds
the lanes once at the end. The result is `torch.argmax(x, dim=-1)`'s, rule for rule:

* the FIRST index among equal maxima (a lane replaces its best only on a strictly greater value,
  so it keeps its first column; the fold takes the smallest column among the lanes at the top);
* NaN is the maximum: a row with a NaN gives the index of its first NaN (torch's rule on the CPU
  and on CUDA). NaN compares false with everything, so it is tracked explicitly: a lane takes a
  NaN only over a non-NaN best, and the fold looks for NaN lanes before taking the maximum of
  the others (whatever `tl.max` would do with a NaN never comes into it);
* a row of -inf gives 0 (its first column: every value ties at the maximum, -inf);
* -0.0 and +0.0 are equal (IEEE comparison), so the first of them wins, as in torch.

Bf16/f16 are widened to float32 on load, which is exact, so comparisons are those of the input
values. Each row is read only by its own program: a row's index never depends on the other rows
or on the row count (fixed-width steps stay bit-exact). No host sync, so it is capturable in a
CUDA graph; pass `out=` to write into a buffer the graph owns.

One program per row is the right shape for a step's few rows; a large vocabulary (Qwen's 151936
or 248320 columns) is one program walking ~0.6-1 MB alone, which is still a single launch but
leaves most SMs idle. Splitting a row over programs (as kernels/markov.py does for its slots) is
the next step if that ever shows in a profile.

Public API: `row_argmax(x, out=None)` and its twin `row_argmax_ref(x)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait

MAX_BLOCK = 4096  # columns per tile: a 4096-column row (the embedded model's vocab) is one tile
NO_INDEX = 2147483647  # int32 max (spelled out in the kernel): above every column, as V < 2^31 - MAX_BLOCK


@triton.jit
def _row_argmax_kernel(x_ptr, out_ptr, V, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    # The first tile seeds every lane with its value and its own column; a lane past the row's
    # end holds -inf at a column >= V, so it can only tie at -inf and then loses on the column.
    mask = offs < V
    best = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    best = tl.where(mask, best, float("-inf"))
    idx = offs
    for start in range(BLOCK, V, BLOCK):
        cols = start + offs
        mask = cols < V
        v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        # strictly greater keeps the lane's first column among equals; a NaN beats a non-NaN
        take = mask & ((v > best) | ((v != v) & (best == best)))
        best = tl.where(take, v, best)
        idx = tl.where(take, cols, idx)
    lane_nan = best != best
    first_nan = tl.min(tl.where(lane_nan, idx, 2147483647), axis=0)
    top = tl.max(tl.where(lane_nan, float("-inf"), best), axis=0)
    first_top = tl.min(tl.where(best == top, idx, 2147483647), axis=0)
    pick = tl.where(first_nan < 2147483647, first_nan, first_top)
    tl.store(out_ptr + row * stride_out, pick.to(tl.int64))


def row_argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` for `x [rows, V]` (float32, bf16, f16) -> int64 `[rows]`, as
    described above. Rows may be strided; the last axis must be contiguous. `out` (int64
    `[rows]`, on x's device) is written and returned when given."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, V], got {tuple(x.shape)}")
    rows, V = x.shape
    if V == 0:
        raise ValueError("argmax of an empty row (V = 0)")
    if V > NO_INDEX - MAX_BLOCK:
        raise ValueError(f"rows of {V} columns: the kernel indexes columns in int32")
    check_dtype(x, "x")
    check_last_contiguous(x, "x")
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=x.device)
    elif out.shape != (rows,) or out.dtype != torch.long:
        raise ValueError(f"out must be int64 [{rows}], got {out.dtype} {tuple(out.shape)}")
    check_tensors(x, out)
    if rows == 0:
        return out
    block = min(MAX_BLOCK, next_pow2(V))
    _row_argmax_kernel[(rows,)](
        x, out, V, x.stride(0), out.stride(0), BLOCK=block, num_warps=max(1, min(8, block // 256)), **pdl_args(x),
    )
    return out


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of `row_argmax`: the engine's `torch.argmax(x, dim=-1)`."""
    return torch.argmax(x, dim=-1)
