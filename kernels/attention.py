"""Causal GQA attention over the KV cache, for decode/verify steps and prefill chunks.

`decode_attention(q, k_cache, v_cache, positions, scale, window=0)`: row i (at position p_i)
attends to keys 0..p_i of the cache (key index == position), query head h to KV head h // g;
with a sliding `window` W > 0 (Gemma 4's sliding layers) to keys p_i - W < j <= p_i only. It replaces
the engine's masked SDPA over the whole cache storage, which reads every stored key (live or not)
and builds a `[g*t, S]` mask; this reads only the live keys and never repeats K/V.

Design (flash-decoding with fixed splits):

* The key axis is cut into splits of SPLIT keys at fixed key indices (split s covers keys
  [s*SPLIT, (s+1)*SPLIT); SPLIT, BLOCK_M, BLOCK_N are the head size's `tile_for`). One program
  per (block of BLOCK_M query rows, split, KV head) runs an online softmax over its split's
  keys in BLOCK_N blocks, in key order, and stores the row's partial (running max m, sum l,
  unnormalized output acc) for that split.
* The M axis of each `tl.dot` folds the g query heads of the KV head with the rows (M index =
  row*g + head-in-group), so one K/V tile feeds every query that reads that KV head.
* A combine pass merges, per (row, head), the partials of splits 0..p_i // SPLIT with a
  log-sum-exp merge in a fixed order (chunks of COMBINE_CHUNK splits in split order, a fixed
  tree inside a chunk), and writes the output in q's dtype.
* Long contexts (a tile's optional `long_from`, `long_split`): a row's split doubles at
  position long_from and at each doubling of long_from after it, up to long_split keys, so a
  row's number of splits stays about the same as its context grows. With 256-key splits a
  16-row step of the 8B shape at 32k keys writes and re-reads 34 MB of float32 partials a layer
  (a quarter of its K/V), and each program walks only 8 key blocks. The grid does not change:
  program j starts at key j*SPLIT and serves the rows whose split starts there (split size
  dividing j*SPLIT), walking up to the end of the longest such split; the other rows of its
  tile are masked. Partials live in SPLIT-sized units (a row's at the unit of its split's
  start); the combine reads every (row_split / SPLIT)-th unit.

One split: a grid whose storage fits one split (S <= SPLIT) has nothing to merge, so the split
kernel writes each row's output itself (DIRECT): `acc / l` in q's dtype, what the combine makes
of a single partial bit for bit (its weight is exp2(0) = 1, and its lane sum turns a -0 into +0,
as `acc + 0.0` does here), and the combine is not launched; a padding row (position -1) gets
NaN. Since the bits are the same, a row's result still does not depend on S. A drafter's block
(`draft_block_attention`) runs its own tile (`DRAFT_TILES`: 1024-key splits for heads up to
128), so a draft cache of a prompt and its answer takes one launch a layer.

Sliding windows: a row's first key is w_i = max(0, p_i - W + 1), a function of its own
position. A program serves a row only if its split holds a key of the row's window; it walks key
blocks on the absolute BLOCK_N grid from the earliest window start among its rows (rounded down
to that grid), so the blocks a row takes part in, and their order, are fixed by its own window
(blocks before it, there for another row, leave its state exactly zero: m = -inf, l = 0,
acc = 0). The combine merges splits w_i // row_split .. p_i // row_split, chunks counted from
the first. Keys before the window are live storage (every position is kept), never NaN.
A sliding layer's grid (WINDOW_GRID) holds only a window's worth of split programs
(`split_programs`), each looping over the units first + p, first + p + P, ... of its tile's
rows, first being the earliest unit a row of the tile reads: a causal grid over every position
would leave nearly all of a long context's programs with no key of any row's window. Which
program takes a unit changes none of its bits.

Wide heads (`Tile.block_dv`): a program may keep only a part of the head's value columns, the
parts of one row tile side by side on the grid. Each part computes the same scores and softmax
state; part 0 stores m and l. A 512-wide head's 64-row tile then fits the registers.

Ring storage (`span` > the storage's S rows; Gemma 4's sliding layers): key j lives at row
j % S. Every index above stays a position (splits, blocks, windows, the grid over `span`
positions), and only the K/V loads take the modulo, so a row sees the keys, in the order and
with the arithmetic, of a plain storage of `span` rows holding the same keys: the same bits.
The writer keeps every key of a row's window in the ring (memra_cli's `kv_cache.ring_rows`);
a key before the window that a program walks for another row reads a row holding some other
written position, finite, and masked for this one.

Why a row's output is bit-identical whatever shares its step (row-count invariance), and
whatever the cache storage size S:

* split boundaries depend only on key indices, and the splits a row merges only on its position;
  so does the size of its splits (a function of its position). A program walks keys past a
  row's split only for another row of its tile, and those blocks are fully masked for it;
* inside a split a row visits the same key blocks in the same order whatever the tile holds;
  blocks past the row's position (present because another row of the tile reaches further) are
  fully masked for it, and a fully masked block leaves (m, l, acc) bit-identical: m unchanged,
  alpha = exp2(0) = 1, p = 0. A row with no valid key in a split (m = -inf; its partial is
  never stored) is guarded so that exp2(-inf - -inf) never makes a NaN;
* K/V are loaded only for keys <= the tile's largest position (masked to 0 beyond), so storage
  past the live keys (garbage, NaN) is never read into the arithmetic, and the work per program
  depends on positions, never on S; S only sizes the grid (static: CUDA-graph capturable; splits
  past a tile's last position do nothing) and the workspace;
* the tile (split, BLOCK_M, BLOCK_N, warps, stages) is `tile_for(head_dim)`: a function of the
  model's head size only, never of t or S, so the same instruction shapes run for 1 row or 4096
  and for any storage; `tl.dot` computes each output row from its own q row only, and the
  per-row reductions (max, sum) see only that row.

Rows may come in any order and at any positions (prefill chunks at consecutive positions use
the same kernel: causal by position). Requirements: 0 <= positions[i] < S (not checked on the
device), n_heads % n_kv == 0, head_dim <= 512 (any size; non-powers of two are masked).

Numerics: scores in float32 (bf16/f16 q·k on tensor cores with float32 accumulation; float32
inputs use IEEE float32 dot, not TF32), softmax in float32 with exp2, probabilities rounded to
the K/V dtype for the P·V dot (as flash attention does), accumulation and merge in float32,
one rounding to q's dtype at the end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_positions, check_tensors, interpreting, next_pow2
from ._pdl import pdl_args, pdl_wait


@dataclass(frozen=True)
class Tile:
    """One launch configuration of the split kernel (field order = the benchmarks' lists and
    hybrid_step.py's `--attn-tile SPLIT,BLOCK_N,BLOCK_M,STAGES,WARPS`).

    split: keys per split; split boundaries are multiples of it, so it changes results in the
    last bits (never their invariance). block_n: keys per inner block (divides split).
    block_m: folded (row, head-in-group) pairs per program. num_stages, num_warps: Triton's.
    block_dv: output columns per program (a power of two dividing the padded head width; 0 = all
    of them). Below the head width the head's value columns are cut into parts, one program each,
    adjacent on the grid so that they read the same keys together: every part computes the same
    scores (the same q·K, bit for bit) and keeps a BLOCK_M x block_dv accumulator, which lets a
    512-wide head run a 64-row tile on tensor cores without spilling (docs/gemma4.md#kernels-and-cuda).
    Like split and block_n it is part of the tile, hence a function of the head size only.
    long_from, long_split: a row's split doubles at position long_from and at every doubling
    of long_from after it, up to long_split keys (split times a power of two; 0 = one split
    size for every row): with split 256, long_from 8192 and long_split 1024, a row at 5000 uses
    256, at 9000 512, at 20000 and at 60000 1024. A row's split depends on its own position
    only, so it is as invariant as the split itself; growing splits keep a long context's float32
    partials (written by one launch, read by the next) and its programs' loops in proportion
    (module docstring).
    """

    split: int
    block_n: int
    block_m: int
    num_stages: int
    num_warps: int
    long_split: int = 0
    long_from: int = 0
    block_dv: int = 0

    def __post_init__(self):
        def pow2(x):
            return x > 0 and x & (x - 1) == 0

        # tl.arange wants powers of two, and so does Triton's num_warps; tl.dot wants M, N,
        # K >= 16 (block_m is M of both dots, block_n N of q.K and K of P.V).
        if not all(pow2(x) for x in (self.block_n, self.block_m, self.num_warps)):
            raise ValueError(f"{self}: block_n, block_m and num_warps must be powers of two")
        if min(self.block_m, self.block_n) < 16 or self.split % self.block_n or self.num_stages < 1:
            raise ValueError(f"{self}: need block_m, block_n >= 16, block_n dividing split, "
                             "stages >= 1")
        ratio = self.long_split // self.split
        if self.long_split and (self.long_split % self.split or not pow2(ratio) or ratio < 2
                                or self.long_from < 1):
            raise ValueError(f"{self}: long_split must be split times a power of two >= 2, with "
                             "long_from >= 1 (or long_split 0: no long splits)")
        if not self.long_split and self.long_from:
            raise ValueError(f"{self}: long_from without long_split")
        if self.block_dv and (not pow2(self.block_dv) or self.block_dv < 16):
            raise ValueError(f"{self}: block_dv must be 0 (the whole head) or a power of two >= 16")


# Tiles per head-size class, keyed by the widest head_dim of the class (see `tile_for`). A row's
# result depends on its tile (the split, in the last bits), so the tile is a property of the
# model (its head size), never of a step (t) or a cache (S): the engine must not change this
# dict at run time. Benchmarks may replace an entry before their first call (it is a plain dict:
# `TILES[256] = Tile(...)`, as hybrid_step.py's --attn-tile does) to time a candidate.
#
# Chosen per class from GPU sweeps: short contexts dominate the score; the numbers and the
# growing-splits trials are in docs/tuning.md#attention-tiles. 128: the fastest 16-row tile at
# 32k keys no slower at 512 and 4096 (the suite's long_attention part, H100).
TILES: dict[int, Tile] = {
    128: Tile(split=256, block_n=64, block_m=64, num_stages=3, num_warps=4, long_split=1024, long_from=8192),
    256: Tile(split=128, block_n=64, block_m=16, num_stages=2, num_warps=4),
    # Gemma 4's full layers: 64 folded rows on wgmma with the value columns in four parts (a
    # 64 x 128 float32 accumulator), 32-key blocks, three stages; growing splits keep a long
    # context's partials small. The fastest in the 31B's whole step: docs/gemma4.md#kernels-and-cuda
    512: Tile(split=256, block_n=32, block_m=64, num_stages=3, num_warps=4, long_split=1024, long_from=4096,
              block_dv=128),
}


def tile_for(head_dim: int) -> Tile:
    """The split kernel's tile for a model's head size: head_dim <= 128 -> TILES[128],
    129..256 -> TILES[256], 257..512 -> TILES[512] (> 512 is refused).

    Classes, not exact sizes: the kernel pads head_dim to BLOCK_D = next_pow2(head_dim) (>= 16),
    the width of its q, K/V and accumulator tiles, which sets registers and shared memory; every
    size of a class pads to at most the class's width, so the class's tile fits it. (Sizes
    <= 64 run the 128 tile.) Takes head_dim only, so that no
    property of a step or a cache can reach a row's tile (see the module docstring).
    """
    return TILES[_head_class(head_dim)]


def _head_class(head_dim: int) -> int:
    """The tile tables' key for a head size: 128 (up to 128), 256 (129..256), 512 (257..512)."""
    if not 0 < head_dim <= 512:
        raise ValueError(f"head_dim {head_dim} is not in 1..512 (register tile)")
    return 128 if head_dim <= 128 else 256 if head_dim <= 256 else 512


# A drafter's block attention (`draft_block_attention`): its rows all sit at the block's last
# position over a draft cache that holds a prompt and its answer, a few hundred keys in the
# bench's regime, so one split of up to 1024 keys covers the whole storage there and the split
# kernel writes the outputs itself (DIRECT_ONE_SPLIT): one launch a layer, not two. Like TILES,
# a function of the head size only, so a row's drafts never depend on the storage (a longer
# storage runs the same splits and the combine: the same bits). Classes without an entry run TILES.
DRAFT_TILES: dict[int, Tile] = {
    128: Tile(split=1024, block_n=64, block_m=64, num_stages=3, num_warps=4),
}


def draft_tile_for(head_dim: int) -> Tile:
    """The split kernel's tile for a drafter's block attention: DRAFT_TILES' entry for the head
    size's class (`tile_for`'s classes), else `tile_for(head_dim)`."""
    head_class = _head_class(head_dim)
    return DRAFT_TILES.get(head_class, TILES[head_class])


# The 128 entry's values at import, under their names from before the table (for callers that
# predate it); decode_attention never reads them, only `tile_for`.
SPLIT_KEYS = TILES[128].split
BLOCK_N = TILES[128].block_n
BLOCK_M = TILES[128].block_m
NUM_WARPS = TILES[128].num_warps
NUM_STAGES = TILES[128].num_stages

# Stages a float32 launch may use, by BLOCK_D: its q, K and V tiles are twice bf16's, and the 512
# tile's three stages would need 296 KiB of shared memory on sm_90 (two fit). Stages only
# pipeline the loads, so a row's bits are the same with fewer.
FLOAT32_MAX_STAGES = {512: 2}

COMBINE_CHUNK = 16  # splits the combine reads at once (a constant: its sum tree is fixed)
# Upper bound of the float32 partials (acc, m, l) of one launch; larger batches (long prefill
# chunks over long caches) are processed in row chunks, which cannot change any row's result.
WORKSPACE_BYTES = 256 << 20

# A grid of one split (a storage of at most a split's keys: a drafter's block attention over its
# draft cache, DRAFT_TILES) writes its rows' outputs in the split kernel, the combine's bits
# without its launch. Benchmarks may set it False to time the two launches beside it.
DIRECT_ONE_SPLIT = True

# Sliding layers' programs placed over the windows (WINDOW_GRID in the split kernel). Benchmarks may
# set it False to time the causal grid over every position beside it (the same bits either way).
GRID_OVER_WINDOWS = True

_LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the window of a causal (full) layer: wider than any position


@triton.jit
def _row_split(pos, long_from, SPLIT: tl.constexpr, LEVELS: tl.constexpr):
    """Keys per split of a row at `pos`: SPLIT, doubled at long_from and at each doubling of
    long_from after it, LEVELS times at most (long_split = SPLIT << LEVELS)."""
    level = tl.zeros_like(pos)
    threshold = long_from
    for _ in tl.static_range(LEVELS):
        level += (pos >= threshold).to(tl.int32)
        threshold = threshold * 2
    return SPLIT << level


@triton.jit
def _attend_unit(q_ptr, k_base, v_base, acc_ptr, m_ptr, l_ptr, prog, offs_m, row, head, row_ok, pos, row_split,
                 win_start, part, n_splits, qk_scale, stride_qt, stride_qh, stride_ks, stride_vs, ring,
                 NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                 PRECISION: tl.constexpr, RING: tl.constexpr, DIRECT: tl.constexpr = False, out_ptr=None,
                 stride_out=0):
    """The partial of the tile's rows whose split starts at key prog * SPLIT (partial unit
    `prog`), value columns part * BLOCK_DV .. + BLOCK_DV (m and l: part 0 stores them).
    DIRECT (a grid of one split, so a row's only partial is its output): `acc / l` in the output's
    dtype into `out [t, nh*hd]` instead, what the combine makes of one split, bit for bit."""
    lo = prog * SPLIT
    # Rows whose split starts at `lo` and holds a key they see (then l > 0 and m is finite at the
    # end); the others are computed alongside but never stored.
    mine = row_ok & (pos >= lo) & (lo % row_split == 0) & (lo + row_split > win_start)
    row_end = tl.minimum(lo + row_split, pos + 1)  # a row takes keys row_start..row_end-1 from here
    row_start = tl.maximum(win_start, lo)
    # Keys this tile needs from here (lo when no row's split starts here: nothing to do).
    hi = tl.max(tl.where(mine, row_end, lo), axis=0)
    # Blocks start on the absolute BLOCK_N grid (lo is on it), so a row meets the same blocks
    # whichever rows share its tile; blocks before its window leave its state exactly zero.
    first = tl.min(tl.where(mine, row_start // BLOCK_N * BLOCK_N, hi), axis=0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    offs_dv = part * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's value columns
    dv_ok = offs_dv < HD
    q_ok = (mine & (hi > lo))[:, None]
    if HD < BLOCK_D:  # padded columns (a head as wide as the tile needs no column mask)
        q_ok = q_ok & d_ok[None, :]
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=q_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(first, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi  # never read storage past the tile's last live key
        slot = offs_n % ring if RING else offs_n  # where key offs_n is stored
        k_ok = n_ok[None, :]
        v_ok = n_ok[:, None]
        if HD < BLOCK_D:
            k_ok = k_ok & d_ok[:, None]
            v_ok = v_ok & dv_ok[None, :]
        kt = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None], mask=k_ok, other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :], mask=v_ok, other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 domain
        # A row sees keys in its window, up to its position and within its own split: blocks
        # outside are fully masked for it, which leaves its (m, l, acc) bit-identical (module
        # docstring).
        seen = (offs_n[None, :] < row_end[:, None]) & (offs_n[None, :] >= row_start[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no valid key so far keeps m = -inf: subtract 0 instead, so that
        # alpha = exp2(-inf) = 0 and p = exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
        # (Only rows not stored here get there, since a stored row's first block holds its key
        # `lo`; this keeps NaN out of the registers rather than out of the results.)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_dot = p.to(v_base.dtype.element_ty)  # rounded to the K/V dtype, as flash attention
        if DOT_F32:
            p_dot = p_dot.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=PRECISION)
        m_i = m_new

    if DIRECT:
        # the combine of one split: weight exp2(m - m) = 1, so acc / l (its lane sum adds +0 to acc,
        # which makes a -0 +0, as this add does); a padding row (position -1) gets 0 / 0, NaN
        dst = out_ptr + row.to(tl.int64)[:, None] * stride_out + head[:, None] * HD + offs_dv[None, :]
        out_ok = row_ok[:, None]
        if HD < BLOCK_D:
            out_ok = out_ok & dv_ok[None, :]
        l_out = tl.where(mine, l_i, tl.where(row_ok & (pos < 0), 0.0, 1.0))
        tl.store(dst, ((acc + 0.0) / l_out[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        ws = (row.to(tl.int64) * NH + head) * n_splits + prog
        tl.store(m_ptr + ws, m_i, mask=mine & (part == 0))
        tl.store(l_ptr + ws, l_i, mask=mine & (part == 0))
        acc_ok = mine[:, None]
        if HD < BLOCK_D:
            acc_ok = acc_ok & dv_ok[None, :]
        tl.store(acc_ptr + ws[:, None] * HD + offs_dv[None, :], acc, mask=acc_ok)


@triton.jit(do_not_specialize=["long_from", "window", "ring"])
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, m_ptr, l_ptr, n_rows, n_splits,
                  qk_scale, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, long_from, window,
                  ring, G: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LEVELS: tl.constexpr,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_DV: tl.constexpr, RING: tl.constexpr = False,
                  WINDOW_GRID: tl.constexpr = False, PDL: tl.constexpr = False, DIRECT: tl.constexpr = False,
                  out_ptr=None, stride_out=0):
    """Partial attention of BLOCK_M folded (row, head) pairs of one KV head, value columns
    part * BLOCK_DV ..: program `prog` starts at key prog * SPLIT and takes, for each row whose
    split starts there (its split size divides the start), the keys of that split up to the row's
    position. A row's split size depends on its position only (`_row_split`); its partial goes to
    unit `prog`. A row sees keys pos - window < j <= pos (`window` NO_WINDOW: causal). RING: key j
    is stored at row j % ring (a ring storage; every index above stays a position).

    WINDOW_GRID (sliding layers): the grid's second axis holds only as many programs as a
    window has splits (plus two), and program p takes units first + p, first + p + P, ... up to
    the tile's last, where first is the earliest unit a row of the tile reads: programs are
    spent where the rows' windows are, not over every position of the storage. Which program
    takes a unit changes no bit of it.

    DIRECT (a grid of one split: every row's keys in unit 0): the rows' outputs, not partials
    (`_attend_unit`); the combine's launch is not needed."""
    pdl_wait(PDL)
    DV_PARTS: tl.constexpr = BLOCK_D // BLOCK_DV
    tile = tl.program_id(0) // DV_PARTS
    part = tl.program_id(0) % DV_PARTS  # the parts of a tile are adjacent: they read the same keys
    kv_head = tl.program_id(2).to(tl.int64)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // G
    head = kv_head * G + offs_m % G
    row_ok = offs_m < n_rows * G
    # Padding rows get position -1: every key is masked for them and they store nothing.
    pos = tl.load(pos_ptr + row, mask=row_ok, other=-1).to(tl.int32)
    row_split = _row_split(pos, long_from, SPLIT, LEVELS)
    win_start = pos - window + 1  # the row's first key (negative: key 0)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    if WINDOW_GRID:
        live = row_ok & (pos >= 0)
        # the unit where a row's first split starts (its split size divides that key), and its last
        first_unit = tl.min(tl.where(live, tl.maximum(win_start, 0) // row_split * row_split // SPLIT, n_splits),
                            axis=0)
        last_unit = tl.max(tl.where(live, pos // SPLIT, -1), axis=0)
        for prog in range(first_unit + tl.program_id(1), last_unit + 1, tl.num_programs(1)):
            _attend_unit(q_ptr, k_base, v_base, acc_ptr, m_ptr, l_ptr, prog, offs_m, row, head, row_ok, pos,
                         row_split, win_start, part, n_splits, qk_scale, stride_qt, stride_qh, stride_ks, stride_vs,
                         ring, NH, HD, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, SPLIT, DOT_F32, PRECISION, RING, DIRECT,
                         out_ptr, stride_out)
    else:
        _attend_unit(q_ptr, k_base, v_base, acc_ptr, m_ptr, l_ptr, tl.program_id(1), offs_m, row, head, row_ok,
                     pos, row_split, win_start, part, n_splits, qk_scale, stride_qt, stride_qh, stride_ks, stride_vs,
                     ring, NH, HD, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, SPLIT, DOT_F32, PRECISION, RING, DIRECT,
                     out_ptr, stride_out)


@triton.jit(do_not_specialize=["long_from", "window"])
def _combine_kernel(acc_ptr, m_ptr, l_ptr, pos_ptr, out_ptr, gate_ptr, n_splits, stride_out, stride_gate,
                    long_from, window, NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLIT: tl.constexpr, LEVELS: tl.constexpr, CHUNK: tl.constexpr,
                    GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[row, head] = log-sum-exp merge of the row's valid splits w // row_split ..
    pos // row_split (w = max(0, pos - window + 1), its window's first key), of row_split =
    `_row_split(pos)` keys each: every (row_split // SPLIT)-th partial unit.

    Splits are read CHUNK at a time (loads in parallel, not one dependent step per split):
    pass 1 takes the largest partial max (max is exact, so its order is free); pass 2 sums the
    rescaled partials lane by lane across chunks in split order, then one fixed-shape tree over
    the CHUNK lanes. Lanes past the row's last valid split contribute exact zeros (weight
    exp2(-inf) = 0), so the result depends on pos, never on n_splits (i.e. on S).
    """
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    pos = tl.load(pos_ptr + row).to(tl.int32)
    row_split = _row_split(pos, long_from, SPLIT, LEVELS)
    stride_unit = row_split // SPLIT
    n_valid = pos // row_split + 1
    first = tl.maximum(pos - window + 1, 0) // row_split  # chunks counted from the row's own first split
    base = (row * NH + head) * n_splits
    m_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for c0 in range(first, n_valid, CHUNK):
        ok = c0 + offs_c < n_valid
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + (c0 + offs_c) * stride_unit, mask=ok,
                                          other=float("-inf")))
    m_all = tl.max(m_max, axis=0)  # finite: the first split always holds the window's first key
    l_lanes = tl.zeros([CHUNK], tl.float32)
    o_lanes = tl.zeros([CHUNK, BLOCK_D], tl.float32)
    for c0 in range(first, n_valid, CHUNK):
        split = c0 + offs_c
        ok = split < n_valid
        unit = base + split * stride_unit
        weight = tl.exp2(tl.load(m_ptr + unit, mask=ok, other=float("-inf")) - m_all)
        l_lanes += tl.load(l_ptr + unit, mask=ok, other=0.0) * weight
        o = tl.load(acc_ptr + unit[:, None] * HD + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        o_lanes += o * weight[:, None]
    dt = out_ptr.dtype.element_ty
    out = (tl.sum(o_lanes, axis=0) / tl.sum(l_lanes, axis=0)).to(dt)
    if GATED:  # Qwen3.5's output gate, as memra_kernels.qwen35.output_gate computes it (same bits)
        g = tl.load(gate_ptr + row * stride_gate + head * 2 * HD + HD + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        out = (out.to(tl.float32) * sig).to(dt)
    tl.store(out_ptr + row * stride_out + head * HD + offs_d, out, mask=d_ok)


def _check(q, k_cache, v_cache, positions):
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [t, nh, hd], k/v_cache [nkv, S, hd]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, nh, hd = q.shape
    nkv, _, hd_k = k_cache.shape
    if hd_k != hd or nh % nkv:
        raise ValueError(f"head_dim {hd} vs {hd_k}, or n_heads {nh} not a multiple of n_kv {nkv}")
    if hd > 512:
        raise ValueError(f"head_dim {hd} > 512 is not supported (register tile)")
    check_positions(positions, t)
    check_tensors(q, k_cache, v_cache, positions)
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(a, name)
        check_last_contiguous(a, name)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError("q, k_cache and v_cache must share one dtype")


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            positions: torch.Tensor, scale: float, *, split: int, block_m: int, block_n: int,
            num_warps: int, num_stages: int, long_split: int = 0, long_from: int = 0, block_dv: int = 0,
            workspace_bytes: int = WORKSPACE_BYTES, gate: torch.Tensor | None = None,
            window: int = 0, span: int | None = None) -> torch.Tensor:
    """The two launches with explicit tile constants (the fields of a `Tile`: benchmarks sweep
    these; the engine must not: results depend, in the last bits, on split, block_n and the
    long split)."""
    _check(q, k_cache, v_cache, positions)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), got {window}")
    ring = _ring_rows(k_cache, window, span)
    window = window or NO_WINDOW
    # raises on a tile the kernel cannot run
    Tile(split, block_n, block_m, num_stages, num_warps, long_split, long_from, block_dv)
    t, nh, hd = q.shape
    nkv, s_len, _ = k_cache.shape
    s_len = span or s_len  # the positions the storage serves (a ring's exceed its rows)
    g = nh // nkv
    out = torch.empty((t, nh * hd), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    n_splits = triton.cdiv(s_len, split)  # programs and partial units: one per split of keys
    levels = (long_split // split).bit_length() - 1 if long_split else 0  # doublings of the split
    if not long_split:
        long_from = 1 << 30  # past every position (LEVELS is 0 anyway)
    block_d = max(16, next_pow2(hd))
    if q.dtype == torch.float32:
        num_stages = min(num_stages, FLOAT32_MAX_STAGES.get(block_d, num_stages))
    block_dv = min(block_dv or block_d, block_d)  # a part wider than the head is the whole head
    dv_parts = block_d // block_dv
    window_grid = GRID_OVER_WINDOWS and window != NO_WINDOW
    split_progs = split_programs(n_splits, window if window_grid else NO_WINDOW, split)
    # One split in the grid: the split kernel writes the outputs (DIRECT), no partials, no combine.
    direct = DIRECT_ONE_SPLIT and n_splits == 1 and gate is None
    # Row chunks bound the workspace; a row's result does not depend on the chunking.
    per_row = nh * n_splits * (hd + 2) * 4
    chunk = t if direct else max(1, min(t, workspace_bytes // per_row))
    if direct:
        acc = m = l = out  # not read or written: the outputs go straight to `out`
    else:
        acc = torch.empty((chunk, nh, n_splits, hd), dtype=torch.float32, device=q.device)
        m = torch.empty((chunk, nh, n_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    dot_f32 = interpreting()  # the interpreter multiplies bf16 as raw bits (see _common)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only names the default
    for r0 in range(0, t, chunk):
        rows = min(chunk, t - r0)
        qc, pc, oc = q[r0:r0 + rows], positions[r0:r0 + rows], out[r0:r0 + rows]
        grid = (triton.cdiv(rows * g, block_m) * dv_parts, split_progs, nkv)
        _split_kernel[grid](
            qc, k_cache, v_cache, pc, acc, m, l, rows, n_splits, float(scale) * _LOG2E,
            qc.stride(0), qc.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), long_from, window, ring or 1,
            G=g, NH=nh, HD=hd, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, LEVELS=levels,
            DOT_F32=dot_f32, PRECISION=precision, BLOCK_DV=block_dv, RING=ring is not None,
            WINDOW_GRID=window_grid, num_warps=num_warps,
            num_stages=num_stages, DIRECT=direct, out_ptr=oc, stride_out=oc.stride(0), **pdl_args(qc),
        )
        if direct:
            continue
        gc = oc if gate is None else gate[r0:r0 + rows]
        _combine_kernel[(rows, nh)](
            acc, m, l, pc, oc, gc, n_splits, oc.stride(0), gc.stride(0), long_from, window,
            NH=nh, HD=hd, BLOCK_D=block_d,
            SPLIT=split, LEVELS=levels, CHUNK=COMBINE_CHUNK, GATED=gate is not None, num_warps=4, **pdl_args(acc),
        )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int = 0,
                     span: int | None = None) -> torch.Tensor:
    """Causal GQA attention of `q [t, nh, hd]` over the cache -> `[t, nh*hd]` in q's dtype.

    k_cache, v_cache `[nkv, S, hd]` (row strides free, e.g. `kv[0]`, or a view `kv[0, :, :n]` to
    bound the grid), positions `[t]` int64 on the device: row i attends to keys
    0..positions[i] inclusive, or with `window` W > 0 to positions[i] - W < j <= positions[i].
    `scale` multiplies q·k (1/sqrt(hd) for Qwen3, 1.0 for Gemma 4). `span` > S (a window only):
    a ring storage serving positions 0..span-1, key j at row j % S (its writes keep every key
    of a row's window: memra_cli's `kv_cache.ring_rows`); the same bits as a storage of `span`
    rows holding the same keys.
    """
    if q.dim() != 3:
        _check(q, k_cache, v_cache, positions)  # raises: the message names the expected shapes
    return _launch(q, k_cache, v_cache, positions, scale, **asdict(tile_for(q.shape[-1])), window=window,
                   span=span)


def draft_block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          positions: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` on the drafter's tile (`draft_tile_for`): a drafter block's rows, every
    one at the block's last position (all of the committed context and the block), over its
    draft cache. Where the storage fits one split, one launch (DIRECT_ONE_SPLIT)."""
    if q.dim() != 3:
        _check(q, k_cache, v_cache, positions)  # raises: the message names the expected shapes
    return _launch(q, k_cache, v_cache, positions, scale, **asdict(draft_tile_for(q.shape[-1])))


def split_programs(n_splits: int, window: int, split: int) -> int:
    """Programs on the split kernel's second grid axis: one a split of the storage for a causal
    layer (`window` NO_WINDOW); for a sliding one (WINDOW_GRID) as many as a window has splits
    and two more, for a tile's rows straddling split edges: more would only exit, fewer loop."""
    return n_splits if window == NO_WINDOW else min(n_splits, triton.cdiv(window, split) + 2)


def _ring_rows(k_cache: torch.Tensor, window: int, span: int | None) -> int | None:
    """None for a plain storage (span None or its rows); the storage's rows for a ring."""
    rows = k_cache.shape[1]
    if span is None or span == rows:
        return None
    if span < rows:
        raise ValueError(f"span {span} is below the storage's {rows} rows (a ring serves more positions than it holds)")
    if not window or rows < window:
        raise ValueError(f"a ring storage of {rows} rows serving {span} positions needs a window of at most "
                         f"{rows} keys, got {window or 'none'}")
    return rows


def gated_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           positions: torch.Tensor, scale: float, qgkv: torch.Tensor) -> torch.Tensor:
    """`decode_attention` times Qwen3.5's output gate, `sigmoid(gate)`, in its combine launch:
    `qgkv [t, (2*nh + 2*nkv)*hd]` is the gated attention's fused projection (per query head
    `[q | gate]`), read in place. Equal bit for bit to `qwen35.output_gate(decode_attention(...),
    qgkv, nh)`, one launch fewer."""
    t, nh, hd = q.shape
    if qgkv.dim() != 2 or qgkv.shape[0] != t or qgkv.shape[1] < 2 * nh * hd or qgkv.dtype != q.dtype \
            or qgkv.stride(-1) != 1:
        raise ValueError(f"qgkv must be [{t}, >= {2 * nh * hd}] {q.dtype} with contiguous rows, "
                         f"got {tuple(qgkv.shape)} {qgkv.dtype}")
    check_tensors(q, qgkv)
    return _launch(q, k_cache, v_cache, positions, scale, **asdict(tile_for(hd)), gate=qgkv)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         positions: torch.Tensor, scale: float, window: int = 0,
                         span: int | None = None) -> torch.Tensor:
    """Plain torch twin of `decode_attention`: one row at a time, float32 softmax over keys
    max(0, p - window + 1)..p (window 0: from key 0); with `span`, key j at row j % S.

    Reads positions on the host (fine for a reference; the kernel never does).
    """
    t, nh, hd = q.shape
    g = nh // k_cache.shape[0]
    ring = _ring_rows(k_cache, window, span) or k_cache.shape[1]
    out = torch.empty((t, nh, hd), dtype=q.dtype, device=q.device)
    for i, p in enumerate(positions.tolist()):
        lo = max(0, p - window + 1) if window else 0
        rows = torch.arange(lo, p + 1, device=q.device) % ring
        keys = k_cache[:, rows].float().repeat_interleave(g, dim=0)  # [nh, live, hd]
        values = v_cache[:, rows].float().repeat_interleave(g, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), keys) * scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hn,hnd->hd", probs, values).to(q.dtype)
    return out.reshape(t, nh * hd)


def sdpa_live(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch op this kernel replaces, over the live keys only (benchmark baseline): SDPA of
    the folded `[nkv, g*t, hd]` queries against `k/v_cache[:, :max(positions)+1]` with a causal
    mask by position. Reads positions on the host."""
    t, nh, hd = q.shape
    nkv = k_cache.shape[0]
    g = nh // nkv
    n = int(positions.max()) + 1
    qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
    keys = torch.arange(n, device=q.device)
    mask = (keys[None, :] <= positions[:, None]).repeat(g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qf, k_cache[:, :n], v_cache[:, :n], attn_mask=mask, scale=scale)
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

