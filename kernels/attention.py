"""Causal GQA attention over the KV cache, for decode/verify steps and prefill chunks.

`decode_attention(q, k_cache, v_cache, positions, scale)`: row i (at position p_i) attends to
keys 0..p_i of the cache (key index == position), query head h to KV head h // g. It replaces
the engine's masked SDPA over the whole cache storage, which reads every stored key (live or not)
and builds a `[g*t, S]` mask; this reads only the live keys and never repeats K/V.

Design (flash-decoding with fixed splits):

* The key axis is cut into splits of SPLIT_KEYS keys at fixed key indices (split s covers keys
  [s*SPLIT_KEYS, (s+1)*SPLIT_KEYS)). One program per (block of BLOCK_M query rows, split, KV
  head) runs an online softmax over its split's keys in BLOCK_N blocks, in key order, and stores
  the row's partial (running max m, sum l, unnormalized output acc) for that split.
* The M axis of each `tl.dot` folds the g query heads of the KV head with the rows (M index =
  row*g + head-in-group), so one K/V tile feeds every query that reads that KV head.
* The merge of a (row, head)'s partials over splits 0..p_i // SPLIT_KEYS is a log-sum-exp merge
  in a fixed order: the largest partial max (max is exact: its order is free), then
  `l = sum_s l_s * w_s`, `o = sum_s acc_s * w_s` with `w_s = exp2(m_s - max)`, added one split at
  a time in split order, then `o / l`, rounded once to q's dtype (`_merge_splits`). Every step
  is elementwise per (row, head), so its bits depend neither on which pairs are merged together
  nor on the register layout Triton picks (a `tl.sum` over a lane axis would: its tree follows
  the layout), which is what lets two differently shaped programs produce the same bits.
* One launch (FUSED_COMBINE, the default): the split programs of a (row tile, KV head) count
  themselves on a per-(tile, KV head) int32 counter once their partials are stored; the
  program that brings the count to the tile's number of needed splits (max position of the
  tile // SPLIT_KEYS + 1; programs of later splits store nothing and do not count) merges the
  tile's (row, head) pairs and writes the output, then resets the counter to 0 for the next
  launch or CUDA-graph replay ("last block does the reduction"). The counters live in one
  persistent per-device buffer (`_counter_buffer`), allocated zeroed on the first eager call
  and grown only outside stream capture. Calls sharing a device must be stream-ordered (never
  concurrent on two streams), which the engine's single stream guarantees.
* Two launches (`_launch(..., fused=False)`): the split kernel, then `_combine_kernel` merges
  COMBINE_PAIRS pairs per program with the same `_merge_splits`: bit-identical outputs, kept as
  the benchmarks' baseline and as a fallback.

Why a row's output is bit-identical whatever shares its step (row-count invariance), and
whatever the cache storage size S:

* split boundaries depend only on key indices, and the splits a row merges only on its position;
* inside a split a row visits the same key blocks in the same order whatever the tile holds;
  blocks past the row's position (present because another row of the tile reaches further) are
  fully masked for it, and a fully masked block leaves (m, l, acc) bit-identical: m unchanged,
  alpha = exp2(0) = 1, p = 0. A row with no valid key in a split (m = -inf; its partial is
  never stored) is guarded so that exp2(-inf - -inf) never makes a NaN;
* K/V are loaded only for keys <= the tile's largest position (masked to 0 beyond), so storage
  past the live keys (garbage, NaN) is never read into the arithmetic, and the work per program
  depends on positions, never on S; S only sizes the grid (static: CUDA-graph capturable; splits
  past a tile's last position do nothing, and do not count towards the fused merge) and the
  workspace;
* BLOCK_M/BLOCK_N/SPLIT_KEYS are constants, never derived from t, so the same instruction shapes
  run for 1 row or 4096; `tl.dot` computes each output row from its own q row only, and the
  per-row reductions (max, sum) see only that row;
* the merge is elementwise per (row, head) (see above), so which program merges a row, with
  which other rows, in one launch or two, cannot change its bits.

Rows may come in any order and at any positions (prefill chunks at consecutive positions use
the same kernel: causal by position). Requirements: 0 <= positions[i] < S (not checked on the
device), n_heads % n_kv == 0, head_dim <= 256 (any size; non-powers of two are masked).

Numerics: scores in float32 (bf16/f16 q·k on tensor cores with float32 accumulation; float32
inputs use IEEE float32 dot, not TF32), softmax in float32 with exp2, probabilities rounded to
the K/V dtype for the P·V dot (as flash attention does), accumulation and merge in float32,
one rounding to q's dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_tensors, interpreting, next_pow2

# Keys per split. Split boundaries are multiples of this key index: changing it changes results
# in the last bits (never their invariance), so it is a constant of the deployment, not a knob.
# Measured on an H200 (bf16, Qwen3-8B shape, 16-row step, CUDA-graph replay over 36 per-layer
# caches; us per call at live contexts 512 / 4096 / 32768; the two-launch path, before the
# one-launch one: benchmarks/gpu/attention_tiles.py times both per tile set):
#   SPLIT 256, BLOCK_N 32, 3 stages: 13.0 / 14.3 / 64.0   <- chosen: short contexts dominate
#   SPLIT 512, BLOCK_N 64, 3 stages: 16.4 / 17.3 / 53.0      (fewer float32 partials at 32k)
#   SPLIT 128, BLOCK_N 64, 2 stages: 10.5 / 14.4 / 93.8
# (torch SDPA over the same live keys: 61 / 267 / 1844.)
SPLIT_KEYS = 256
BLOCK_N = 32  # keys per inner block (divides SPLIT_KEYS)
BLOCK_M = 64  # folded (row, head-in-group) pairs per program: a 16-row step with g = 4 is one tile
NUM_WARPS = 4
NUM_STAGES = 3
# One launch per call: the split programs merge their own partials (see the Design notes). The
# engine calls `decode_attention`, which follows this; `_launch(..., fused=False)` keeps the
# two-launch path (bit-identical) for benchmarks.
FUSED_COMBINE = True
# The merge's shape knobs. None of them changes a bit of any result (the merge is elementwise
# per (row, head), see `_merge_splits`): they only trade registers for loads in flight.
MERGE_CHUNK = 16  # splits whose partial maxima the max pass loads at once
MERGE_UNROLL = 2  # splits the sum pass loads before adding them (in split order)
FUSED_MERGE_PAIRS = 32  # (row, head) pairs the fused combining program merges at once
COMBINE_PAIRS = 8  # (row, head) pairs per program of the two-launch path's combine kernel
# Upper bound of the float32 partials (acc, m, l) of one launch; larger batches (long prefill
# chunks over long caches) are processed in row chunks, which cannot change any row's result.
WORKSPACE_BYTES = 256 << 20
# Smallest counter buffer of the fused path (int32 per (row tile, KV head) of one launch): 64 KiB
# covers 32768-row chunks at the Qwen3-8B shape (g = 4, 8 KV heads; the workspace bound keeps
# chunks far smaller), so the buffer is sized once, on the first eager call.
MIN_COUNTERS = 1 << 14

_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, count_ptr,
                  n_rows, n_splits, qk_scale, stride_qt, stride_qh, stride_kh, stride_ks,
                  stride_vh, stride_vs, stride_out,
                  G: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr, FUSED: tl.constexpr,
                  MERGE_PAIRS: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    """Partial attention of BLOCK_M folded (row, head) pairs of one KV head over one split.

    Grid (row tiles, splits, KV heads). Partials go to acc `[rows, NH, n_splits, HD]`, m and l
    `[rows, NH, n_splits]` (float32). FUSED: the last program of a (tile, KV head) to store
    also merges the tile's pairs into out `[rows, NH*HD]`; count_ptr: int32 counters, one per
    (tile, KV head), 0 before the launch and after it (unused when not FUSED).
    """
    tile = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // G
    head = kv_head * G + offs_m % G
    row_ok = offs_m < n_rows * G
    # Padding rows get position -1: every key is masked for them and they store nothing.
    pos = tl.load(pos_ptr + row, mask=row_ok, other=-1).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    lo = split * SPLIT
    # Keys this tile needs from the split: up to its largest position (0 keys if beyond).
    pos_max = tl.max(pos, axis=0)
    hi = tl.minimum(lo + SPLIT, pos_max + 1)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi  # never read storage past the tile's last live key
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 domain
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no valid key so far keeps m = -inf: subtract 0 instead, so that
        # alpha = exp2(-inf) = 0 and p = exp2(-inf) = 0 rather than exp2(-inf - -inf) = NaN.
        # (Only rows for which this split is not valid get here, since a valid row's first
        # block holds its key `lo`; their partials are never stored, so this keeps NaN out of
        # the registers rather than out of the results.)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_dot = p.to(v_ptr.dtype.element_ty)  # rounded to the K/V dtype, as flash attention
        if DOT_F32:
            p_dot = p_dot.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=PRECISION)
        m_i = m_new

    # A split is valid for a row iff it holds the row's key `lo` (then l > 0 and m is finite).
    valid = row_ok & (pos >= lo)
    ws = (row.to(tl.int64) * NH + head) * n_splits + split
    tl.store(m_ptr + ws, m_i, mask=valid)
    tl.store(l_ptr + ws, l_i, mask=valid)
    tl.store(acc_ptr + ws[:, None] * HD + offs_d[None, :], acc, mask=valid[:, None] & d_ok[None, :])

    if FUSED:
        # The splits this tile needs: those holding a key <= its largest position. Exactly
        # their programs store partials and count; later splits' programs end here. Every
        # program of the (tile, KV head) computes the same number from the same positions.
        # (min: a position >= S, a broken precondition, must still let the count complete and
        # reset, or every later launch would read a stale counter.)
        n_needed = tl.minimum(pos_max // SPLIT + 1, n_splits)
        if split < n_needed:
            # Memory ordering (the GPU's, PTX memory model). Storing side: the barrier orders
            # every thread's partial stores above before the atomic, which one thread performs
            # with release semantics at GPU scope; release is cumulative, so the stores the
            # barrier ordered before it are published with it. Combining side: the program that
            # reads count == n_needed - 1 has acquired every earlier program's release (each
            # acq_rel increment reads the previous one's value, so they chain: every storing
            # program's release happens before the last increment's acquire), and the barrier
            # after it orders all its threads' loads after that acquire; the loads go to L2
            # (`.cg`), so no L1 line cached earlier on this SM can be stale. The counter's
            # value, not timing, picks the combiner: exactly one program reads n_needed - 1.
            tl.debug_barrier()
            counter = count_ptr + tile * tl.num_programs(2) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == n_needed - 1:
                tl.debug_barrier()
                # Every program that counts has counted: nothing else touches this counter in
                # this launch, and the launch boundary orders the reset before the next one.
                tl.store(counter, 0)
                first = tile * BLOCK_M
                last = tl.minimum(first + BLOCK_M, n_rows * G)
                for p0 in tl.range(first, last, MERGE_PAIRS, num_stages=1):
                    pair = p0 + tl.arange(0, MERGE_PAIRS)  # folded index row*G + head-in-group
                    pair_ok = pair < last
                    pair_row = pair // G
                    pair_pos = tl.load(pos_ptr + pair_row, mask=pair_ok, other=-1).to(tl.int32)
                    _merge_splits(acc_ptr, m_ptr, l_ptr, out_ptr, pair_row, kv_head * G + pair % G,
                                  pair_pos, pair_ok, n_splits, stride_out, NH=NH, HD=HD,
                                  BLOCK_D=BLOCK_D, SPLIT=SPLIT, P=MERGE_PAIRS, CHUNK=CHUNK,
                                  UNROLL=UNROLL)


@triton.jit
def _merge_splits(acc_ptr, m_ptr, l_ptr, out_ptr, row, head, pos, ok, n_splits, stride_out,
                  NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr,
                  UNROLL: tl.constexpr):
    """out[row, head*HD:(head+1)*HD] = log-sum-exp merge of the pair's splits 0..pos // SPLIT.

    row, head, pos, ok: `[P]` (row index, query head, position, pair present); the partials
    are at `(row*NH + head) * n_splits + split` (m, l) and `* HD + d` (acc). Pass 1 takes the
    largest partial max (loads of CHUNK splits at once; max is exact, its order free); pass 2
    adds `l_s * w_s` and `acc_s * w_s` one split at a time in split order, starting from +0.
    Splits past a pair's last valid one (present when another pair of the block reaches
    further) add exact +0 (masked loads, weight exp2(-inf) = 0), and a sum started at +0 is
    never -0, so x + 0 == x bit for bit: a pair's result depends on its position and its
    partials only, never on P, UNROLL, the other pairs, or n_splits (i.e. S). Loads use `.cg`
    (L2, not L1): in the fused kernel other SMs wrote these partials during this launch.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    # min(.., n_splits) only matters for a position >= S (a broken precondition): reads stay
    # inside the workspace.
    n_valid = tl.where(ok, tl.minimum(pos // SPLIT + 1, n_splits), 0)
    base = (row.to(tl.int64) * NH + head) * n_splits
    n_max = tl.max(n_valid, axis=0)
    offs_c = tl.arange(0, CHUNK)
    m_all = tl.full([P], float("-inf"), tl.float32)
    # num_stages=1: no shared-memory pipelining of these loads (in the fused kernel it would
    # size the shared memory of every split program, and with it their occupancy).
    for c0 in tl.range(0, n_max, CHUNK, num_stages=1):
        split = c0 + offs_c
        m_c = tl.load(m_ptr + base[:, None] + split[None, :],
                      mask=split[None, :] < n_valid[:, None], other=float("-inf"),
                      cache_modifier=".cg")
        m_all = tl.maximum(m_all, tl.max(m_c, axis=1))
    # Finite for every merged pair (split 0 holds key 0); 0 for absent pairs, so that their
    # weights are exp2(-inf - 0) = 0, never exp2(-inf - -inf) = NaN.
    m_all = tl.where(n_valid > 0, m_all, 0.0)
    l_sum = tl.zeros([P], tl.float32)
    o_sum = tl.zeros([P, BLOCK_D], tl.float32)
    for s0 in tl.range(0, n_max, UNROLL, num_stages=1):
        for j in tl.static_range(UNROLL):  # straight-line: the UNROLL splits' loads overlap
            take = s0 + j < n_valid
            ws = base + s0 + j
            weight = tl.exp2(tl.load(m_ptr + ws, mask=take, other=float("-inf"),
                                     cache_modifier=".cg") - m_all)
            l_sum += tl.load(l_ptr + ws, mask=take, other=0.0, cache_modifier=".cg") * weight
            o = tl.load(acc_ptr + ws[:, None] * HD + offs_d[None, :],
                        mask=take[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
            o_sum += o * weight[:, None]
    out = o_sum / tl.where(n_valid > 0, l_sum, 1.0)[:, None]  # (absent pairs: never stored)
    dst = out_ptr + row.to(tl.int64)[:, None] * stride_out + head[:, None] * HD + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, pos_ptr, out_ptr, n_rows, n_splits, stride_out,
                    NH: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLIT: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr,
                    UNROLL: tl.constexpr):
    """Two-launch path: merge P consecutive (row, head) pairs (index row*NH + head)."""
    pair = tl.program_id(0) * P + tl.arange(0, P)
    ok = pair < n_rows * NH
    row = pair // NH
    pos = tl.load(pos_ptr + row, mask=ok, other=-1).to(tl.int32)
    _merge_splits(acc_ptr, m_ptr, l_ptr, out_ptr, row, pair % NH, pos, ok, n_splits, stride_out,
                  NH=NH, HD=HD, BLOCK_D=BLOCK_D, SPLIT=SPLIT, P=P, CHUNK=CHUNK, UNROLL=UNROLL)


def _check(q, k_cache, v_cache, positions):
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [t, nh, hd], k/v_cache [nkv, S, hd]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, nh, hd = q.shape
    nkv, _, hd_k = k_cache.shape
    if hd_k != hd or nh % nkv:
        raise ValueError(f"head_dim {hd} vs {hd_k}, or n_heads {nh} not a multiple of n_kv {nkv}")
    if hd > 256:
        raise ValueError(f"head_dim {hd} > 256 is not supported (register tile)")
    if positions.shape != (t,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be [t] int64/int32, got {tuple(positions.shape)} {positions.dtype}")
    check_tensors(q, k_cache, v_cache, positions)
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(a, name)
        check_last_contiguous(a, name)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError("q, k_cache and v_cache must share one dtype")


# device -> the fused path's counter buffers, newest last. Older ones are kept alive: a captured
# CUDA graph holds the address of the buffer it was captured with, and replays it.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is recording a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _counter_buffer(device: torch.device, needed: int) -> torch.Tensor:
    """int32 `[>= needed]` counters of the fused path on `device`, all 0 between launches.

    Allocated (zeroed) on the first call on the device and replaced by a larger one when a launch
    needs more, both only outside stream capture: a graph must not own the buffer (it would be
    recycled with the graph's pool) nor capture its zeroing. Each launch leaves the counters it
    used at 0, so the buffer is never zeroed again."""
    buffers = _COUNTERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= needed:
        return buffers[-1]
    if _capturing(device):
        have = buffers[-1].numel() if buffers else 0
        raise RuntimeError(
            f"decode_attention (fused combine): needs {needed} counters on {device} but "
            f"{'none are' if not have else f'only {have} are'} allocated, and the stream is "
            "capturing a CUDA graph; run the same call once eagerly before capturing it")
    size = max(MIN_COUNTERS, next_pow2(needed))
    buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            positions: torch.Tensor, scale: float, *, split: int, block_m: int, block_n: int,
            num_warps: int, num_stages: int, workspace_bytes: int = WORKSPACE_BYTES,
            fused: bool | None = None, merge_pairs: int = FUSED_MERGE_PAIRS,
            combine_pairs: int = COMBINE_PAIRS, merge_unroll: int = MERGE_UNROLL) -> torch.Tensor:
    """`decode_attention` with explicit tile constants (benchmarks sweep these; the engine must
    not: results depend, in the last bits, on split and block_n).

    fused: one launch (the split programs merge) or two (split kernel, then `_combine_kernel`);
    None follows FUSED_COMBINE. Both give the same bits, as do any merge_pairs, combine_pairs
    and merge_unroll (powers of two)."""
    _check(q, k_cache, v_cache, positions)
    assert split % block_n == 0 and block_m >= 16 and block_n >= 16
    fused = FUSED_COMBINE if fused is None else fused
    t, nh, hd = q.shape
    nkv, s_len, _ = k_cache.shape
    g = nh // nkv
    out = torch.empty((t, nh * hd), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    n_splits = triton.cdiv(s_len, split)
    block_d = max(16, next_pow2(hd))
    # Row chunks bound the workspace; a row's result does not depend on the chunking.
    per_row = nh * n_splits * (hd + 2) * 4
    chunk = max(1, min(t, workspace_bytes // per_row))
    acc = torch.empty((chunk, nh, n_splits, hd), dtype=torch.float32, device=q.device)
    m = torch.empty((chunk, nh, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    # Fused: one counter per (row tile, KV head) of the largest chunk; chunks run one after the
    # other on the stream, each leaving its counters at 0 for the next.
    counters = _counter_buffer(q.device, triton.cdiv(chunk * g, block_m) * nkv) if fused else m
    dot_f32 = interpreting()  # the interpreter multiplies bf16 as raw bits (see _common)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only names the default
    for r0 in range(0, t, chunk):
        rows = min(chunk, t - r0)
        qc, pc, oc = q[r0:r0 + rows], positions[r0:r0 + rows], out[r0:r0 + rows]
        grid = (triton.cdiv(rows * g, block_m), n_splits, nkv)
        _split_kernel[grid](
            qc, k_cache, v_cache, pc, acc, m, l, oc, counters, rows, n_splits,
            float(scale) * _LOG2E, qc.stride(0), qc.stride(1), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), oc.stride(0),
            G=g, NH=nh, HD=hd, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
            DOT_F32=dot_f32, PRECISION=precision, FUSED=fused, MERGE_PAIRS=merge_pairs,
            CHUNK=MERGE_CHUNK, UNROLL=merge_unroll, num_warps=num_warps, num_stages=num_stages,
        )
        if not fused:
            _combine_kernel[(triton.cdiv(rows * nh, combine_pairs),)](
                acc, m, l, pc, oc, rows, n_splits, oc.stride(0), NH=nh, HD=hd, BLOCK_D=block_d,
                SPLIT=split, P=combine_pairs, CHUNK=MERGE_CHUNK, UNROLL=merge_unroll, num_warps=4,
            )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of `q [t, nh, hd]` over the cache -> `[t, nh*hd]` in q's dtype.

    k_cache, v_cache `[nkv, S, hd]` (row strides free, e.g. `kv[0]`, or a view `kv[0, :, :n]` to
    bound the grid), positions `[t]` int64 on the device: row i attends to keys
    0..positions[i] inclusive. `scale` multiplies q·k (1/sqrt(hd) for Qwen3).
    """
    return _launch(q, k_cache, v_cache, positions, scale, split=SPLIT_KEYS, block_m=BLOCK_M,
                   block_n=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                   fused=FUSED_COMBINE)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain torch twin of `decode_attention`: one row at a time, float32 softmax.

    Reads positions on the host (fine for a reference; the kernel never does).
    """
    t, nh, hd = q.shape
    g = nh // k_cache.shape[0]
    out = torch.empty((t, nh, hd), dtype=q.dtype, device=q.device)
    for i, p in enumerate(positions.tolist()):
        keys = k_cache[:, : p + 1].float().repeat_interleave(g, dim=0)  # [nh, p+1, hd]
        values = v_cache[:, : p + 1].float().repeat_interleave(g, dim=0)
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

