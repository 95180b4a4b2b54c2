"""A greedy round's `argmax` over each row of its logits.

PyTorch's generic reduce kernel, built for any shape and dim, is a visible slice of a graphed
round of a small model, where the job is 16 rows of 16 KiB that one program per row reads in a
single pass (docs/tuning.md#argmax).

`row_argmax(x)` takes `x [rows, V]` (float32, bf16 or f16; any row stride, the last axis
contiguous). A program walks its columns in `BLOCK`-sized tiles, turning each value and its
column into one int64 key (below) and keeping each lane's largest, then takes the largest over
its lanes. The result is `torch.argmax(x, dim=-1)`'s, rule for rule:

* the FIRST index among equal maxima (equal values give the larger key to the smaller column);
* NaN is the maximum: a row with a NaN gives the index of its first NaN (torch's rule on the CPU
  and on CUDA): every NaN has the top rank, so the first NaN has the largest key;
* a row of -inf gives 0 (its first column: every value ties at the maximum, -inf);
* -0.0 and +0.0 are equal (IEEE comparison), so the first of them wins, as in torch.

Bf16/f16 are widened to float32 on load, which is exact, so comparisons are those of the input
values. Each row is read only by its own programs: a row's index never depends on the other rows
or on the row count (fixed-width steps stay bit-exact). No host sync, so it is capturable in a
CUDA graph; pass `out=` to write into a buffer the graph owns.

A large vocabulary is split over programs: with one program per row, a Qwen row (151,936 or
248,320 columns, 0.6-1 MB in float32) was one SM walking it alone while the rest idled
(docs/tuning.md#argmax). Rows longer
than `SPLIT_FROM` columns are cut into chunks (about `TARGET_PROGRAMS` programs in all); each
program writes its chunk's winner as one int64 key and a second launch, one program per row,
takes the largest key of its row. The key orders (value, column) exactly as the rules above:

    key = rank(value) * 2^31 + (2^31 - 1 - column)

rank is the float32's bits made monotonic as unsigned (-0.0 first turned into +0.0, every NaN
the top rank 2^32 - 1, above +inf), so a larger key is a larger value, or the same value at an
earlier column. Keys are integers, so their maximum is exact in any order: how a row is cut
(which may depend on the row count) never changes its index. Short rows keep one program per
row and one launch; they run the same key code.

Public API: `row_argmax(x, out=None)` and its twin `row_argmax_ref(x)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from .argmax_ref import row_argmax_ref  # noqa: F401  (the twin: the op's one torch body)

MAX_BLOCK = 4096  # columns per tile: a 4096-column row (the embedded model's vocab) is one tile
NO_INDEX = 2147483647  # 2^31 - 1: columns are below it, as V < 2^31 - MAX_BLOCK
SPLIT_FROM = 2 * MAX_BLOCK  # rows longer than this are cut into chunks over several programs
TARGET_PROGRAMS = 264  # about two programs per H200 multiprocessor (132) for a split call
MAX_CHUNKS = 1024  # chunks of one row (the second launch folds them in one tile)


@triton.jit
def _keys(v, cols, mask):
    """int64 keys of float32 values `v` at columns `cols` (see the module docstring); -1 where
    not `mask` (below every real key, which is >= 0)."""
    v = v + 0.0  # -0.0 -> +0.0: the two are equal, the first column must win
    bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # the bits as an unsigned value
    rank = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)  # monotonic in v
    rank = tl.where(v != v, 0xFFFFFFFF, rank)  # every NaN at the top
    key = rank * 2147483648 + (2147483647 - cols.to(tl.int64))
    return tl.where(mask, key, -1)


@triton.jit
def _column_of(key):
    return 2147483647 - (key & 2147483647)


@triton.jit
def _row_argmax_kernel(x_ptr, out_ptr, ws_ptr, V, chunk, stride_x, stride_out, n_chunks,
                       BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, c): the largest key of columns [c*chunk, min(V, (c+1)*chunk)) of its row
    (chunk a multiple of BLOCK). SPLIT: written to ws[row, c]; else (one chunk a row) the
    column goes to out[row]."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, V)
    src = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1, tl.int64)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        mask = cols < hi
        v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)  # widening is exact
        best = tl.maximum(best, _keys(v, cols, mask))
    top = tl.max(best, axis=0)
    if SPLIT:
        tl.store(ws_ptr + row * n_chunks + tl.program_id(1), top)
    else:
        tl.store(out_ptr + row * stride_out, _column_of(top))


@triton.jit
def _fold_chunks_kernel(ws_ptr, out_ptr, n_chunks, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program row: out[row] = the column of the largest of ws[row, :n_chunks]."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(ws_ptr + row * n_chunks + offs, mask=offs < n_chunks, other=-1)
    tl.store(out_ptr + row * stride_out, _column_of(tl.max(keys, axis=0)))


def plan(rows: int, V: int) -> tuple[int, int, int]:
    """(tile columns, chunk columns, chunks a row) for `rows` rows of `V` columns."""
    block = min(MAX_BLOCK, next_pow2(V)) if V <= SPLIT_FROM else 2048
    if V <= SPLIT_FROM:
        return block, V, 1
    tiles = -(-V // block)
    per_row = max(1, min(tiles, MAX_CHUNKS, -(-TARGET_PROGRAMS // max(rows, 1))))
    chunk = -(-tiles // per_row) * block
    return block, chunk, -(-V // chunk)


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
    block, chunk, n_chunks = plan(rows, V)
    warps = max(1, min(8, block // 256))
    split = n_chunks > 1
    ws = torch.empty((rows, n_chunks), dtype=torch.long, device=x.device) if split else out
    _row_argmax_kernel[(rows, n_chunks)](
        x, out, ws, V, chunk, x.stride(0), out.stride(0), n_chunks, BLOCK=block, SPLIT=split, num_warps=warps,
        **pdl_args(x),
    )
    if split:
        _fold_chunks_kernel[(rows,)](ws, out, n_chunks, out.stride(0), BLOCK=max(16, next_pow2(n_chunks)),
                                     num_warps=1, **pdl_args(x))
    return out
