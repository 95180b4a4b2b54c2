"""DSpark's greedy markov chain on the device in `n + 1` launches instead of ~5 per draft.

The chain picks draft k as `argmax(logits[k] + w2 · w1[prev])` with `prev` the token it picked
for slot k-1 (the anchor for slot 0): `w1 [V_in, r]` is a table gathered by token, `w2 [V, r]`
a linear layer (`Linear(r, V).weight`). Each slot depends on the one before, so the torch path
launches a gather, a cast, a GEMV, a cast, an add and an argmax per slot: 6 launches of a few
microseconds each, which on a small drafter cost more than its whole forward.

Here one launch per slot does all of it, split over the vocabulary (`BLOCK_V` rows of `w2` per
program): each program writes the maximum of its rows and the first index where it occurs to a
workspace. The next slot's programs first reduce the previous slot's partials (a few dozen
values, redundantly in every program: no atomics, no grid-wide barrier, so it also runs under
Triton's interpreter) to find `prev`; the launch after the last slot reduces the last one. The
partials are in vocabulary order and each holds the first index of its maximum, so the chain
keeps `torch.argmax`'s rule: the first index among equal maxima.

Numerics follow `markov_chain_ref` (the engine's torch loop): `w1[prev]` rounded to the compute
dtype, the dot accumulated in float32 and rounded to the compute dtype (a linear layer's output),
widened and added to the float32 logits. The only difference is the dot's summation order, an
ulp before the rounding. A draft never decides a committed token (the target does), so such a
difference could cost acceptance, never exactness. Rows never mix: each slot reads only its own
logits row.

Small vocabularies: one launch for the whole chain. When the table of every bias row,
`T[p] = w2 · w1[p]` (`[V_in, V]` in the compute dtype), is small (<= `TABLE_MAX_BYTES`, 64 MiB:
the embedded DSpark drafter's 4096 x 4096 bf16 is 32 MiB), `bias_table` builds it once and
`markov_chain(..., table=T)` runs one program that walks the slots: gather row `T[prev]`, add
slot k's logits, argmax, next. A slot is then two dependent loads instead of a launch: the
per-slot launches were a third of a small round's proposal time (docs/tuning.md#markov-chain).
The table's rows are one GEMM's (`linear(w1, w2)`), so a bias can differ
from the per-slot GEMV's in its summation order (an ulp before the rounding), as above. Large
vocabularies keep the per-slot kernel: their table would not fit, and each slot's GEMV reads
megabytes, so the launches are not what they wait on.

A round that sizes its window from DSpark's confidence head scores its slots in the same launch
(`markov_chain_confidence`): slot k's score needs only its draft row and the token before it,
which the program keeps as it walks the slots, then scores them all at once, so the head's own
launch after the chain goes. The score is `gather.confidence_rows`, the one body
`confidence_raw`'s kernel runs too, summed in an order that does not depend on the rows a program
holds or its warps: the same bits.

Public API: `markov_chain(logits, anchor, w1, w2, dtype, table=None, with_anchor=False)`,
`markov_chain_confidence(logits, anchor, w1, w2, dtype, table, hidden, conf_w, conf_b, conf_w1=None)`,
`bias_table(w1, w2, dtype)`, `table_fits(w1, w2, dtype)`, and the twin `markov_chain_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from .gather import confidence_args, confidence_raw, confidence_rows
from .markov_ref import markov_chain_ref  # noqa: F401  (the twin: the op's one torch body)

BLOCK_V = 128  # vocabulary rows of w2 per program
BLOCK_R = 64  # columns of w2 per loop step
TABLE_MAX_BYTES = 64 << 20  # the largest bias table built (the one-launch chain)
TABLE_BLOCK = 4096  # vocabulary entries per loop step of the one-launch chain
TABLE_WARPS = 8  # warps of the one-launch chain's program
CONF_TILE_MAX = 16384  # float32 values of the slots' tile the one-launch chain scores them in (else the head's launch)


@triton.jit
def _reduce_prev(val_ptr, idx_ptr, n_parts, BLOCK_P: tl.constexpr):
    """The chain's token from one slot's partials: the first index of the overall maximum."""
    p = tl.arange(0, BLOCK_P)
    vals = tl.load(val_ptr + p, mask=p < n_parts, other=float("-inf"))
    idxs = tl.load(idx_ptr + p, mask=p < n_parts, other=2147483647)
    best = tl.max(vals, axis=0)
    return tl.min(tl.where(vals == best, idxs, 2147483647), axis=0)


@triton.jit
def _markov_slot_kernel(logits_ptr, w1_ptr, w2_ptr, anchor_ptr, val_ptr, idx_ptr, out_ptr,
                        slot, V, R, n_parts, stride_logits, stride_w1, stride_w2,
                        COMPUTE: tl.constexpr, FIRST: tl.constexpr, REDUCE_ONLY: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """Slot `slot` over this program's BLOCK_V vocabulary rows; `slot == n` (REDUCE_ONLY)
    only writes the last slot's token. Workspace `val/idx [n, BLOCK_P]`, tokens `out [n]`."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if FIRST:
        prev = tl.load(anchor_ptr).to(tl.int32)
    else:
        prev = _reduce_prev(val_ptr + (slot - 1) * BLOCK_P, idx_ptr + (slot - 1) * BLOCK_P, n_parts, BLOCK_P)
        if pid == 0:
            tl.store(out_ptr + slot - 1, prev.to(tl.int64))
    if not REDUCE_ONLY:
        rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)
        in_v = rows < V
        acc = tl.zeros((BLOCK_V,), tl.float32)
        for r0 in range(0, R, BLOCK_R):
            cols = r0 + tl.arange(0, BLOCK_R)
            in_r = cols < R
            a = tl.load(w1_ptr + prev.to(tl.int64) * stride_w1 + cols, mask=in_r, other=0.0)
            a = a.to(tl.float32).to(COMPUTE).to(tl.float32)  # w1[prev] in the compute dtype
            b = tl.load(w2_ptr + rows.to(tl.int64)[:, None] * stride_w2 + cols[None, :],
                        mask=in_v[:, None] & in_r[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        bias = acc.to(COMPUTE).to(tl.float32)  # the linear layer's output dtype
        s = tl.load(logits_ptr + slot * stride_logits + rows, mask=in_v, other=0.0).to(tl.float32) + bias
        s = tl.where(in_v, s, float("-inf"))
        best = tl.max(s, axis=0)
        first = tl.min(tl.where(s == best, rows, 2147483647), axis=0)
        tl.store(val_ptr + slot * BLOCK_P + pid, best)
        tl.store(idx_ptr + slot * BLOCK_P + pid, first)


@triton.jit
def _first_max_key(s, idx):
    """One int64 key per element whose maximum is the first index of the maximum score: the
    float32 score's bits mapped to an order-preserving unsigned 32-bit value (negatives
    flipped whole, positives with the sign bit set), shifted above `2^31 - 1 - idx`."""
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0 (as torch.argmax compares), so one bit pattern
    u = s.to(tl.int32, bitcast=True)
    ordered = tl.where(u < 0, ~u, u | -2147483648)  # as unsigned 32 bits: the float order
    return ((ordered.to(tl.uint32, bitcast=True).to(tl.int64)) << 31) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _markov_table_kernel(logits_ptr, table_ptr, anchor_ptr, out_ptr, n, V,
                         stride_logits, stride_table, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
                         PDL: tl.constexpr = False, WITH_ANCHOR: tl.constexpr = False,
                         WITH_CONF: tl.constexpr = False, BLOCK_S: tl.constexpr = 1, raws_ptr=None, h_ptr=None,
                         w_ptr=None, b_ptr=None, w1_ptr=None, H=0, R=0, stride_h=0, stride_w1=0,
                         WITH_MARKOV: tl.constexpr = False,
                         BLOCK_H: tl.constexpr = 1, BLOCK_R: tl.constexpr = 1, NORM_IN: tl.constexpr = False,
                         sq_ptr=None, nw_ptr=None, n_parts=1, PARTS_POW2: tl.constexpr = 1, eps=0.0):
    """The whole chain in one program: slot k's scores are `logits[k] + table[prev]` (the table
    already rounded to the compute dtype, the logits widened to float32), its pick the first
    index of their maximum, found with one reduction over packed (score, index) keys. With
    ONE_TILE (V <= BLOCK) slot k+1's logits are loaded while slot k waits on its table row:
    they do not depend on the pick. WITH_ANCHOR: out[0] is the anchor and the picks follow it.
    WITH_CONF: each slot's confidence score too (`gather.confidence_rows` of draft row k with the
    token before it), into `raws [n]`, all BLOCK_S (>= n) slots at once after the chain, from the
    previous tokens it kept: the launch the head took after the chain."""
    pdl_wait(PDL)
    prev = tl.load(anchor_ptr).to(tl.int64)
    if WITH_ANCHOR:
        tl.store(out_ptr, prev)
        out_ptr += 1
    cols = tl.arange(0, BLOCK)
    if WITH_CONF:
        slots = tl.arange(0, BLOCK_S)
        prevs = tl.zeros((BLOCK_S,), tl.int64)
    if ONE_TILE:
        ok = cols < V
        lg = tl.load(logits_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        for k in range(0, n):
            if WITH_CONF:
                prevs = tl.where(slots == k, prev, prevs)  # slot k's previous token
            nxt = tl.minimum(k + 1, n - 1)  # the last slot reloads itself (in bounds, unused)
            lg_next = tl.load(logits_ptr + nxt * stride_logits + cols, mask=ok, other=0.0).to(tl.float32)
            bias = tl.load(table_ptr + prev * stride_table + cols, mask=ok, other=0.0).to(tl.float32)
            key = _first_max_key(tl.where(ok, lg + bias, float("-inf")), cols)
            pick = 2147483647 - (tl.max(key, axis=0) & 2147483647)
            tl.store(out_ptr + k, pick)
            prev = pick
            lg = lg_next
    else:
        for k in range(0, n):
            if WITH_CONF:
                prevs = tl.where(slots == k, prev, prevs)  # slot k's previous token
            best = tl.full((BLOCK,), -9223372036854775807 - 1, tl.int64)
            for v0 in range(0, V, BLOCK):
                idx = v0 + cols
                ok = idx < V
                bias = tl.load(table_ptr + prev * stride_table + idx, mask=ok, other=0.0).to(tl.float32)
                lg = tl.load(logits_ptr + k * stride_logits + idx, mask=ok, other=0.0).to(tl.float32)
                key = _first_max_key(lg + bias, idx)
                best = tl.maximum(best, tl.where(ok, key, best))
            pick = 2147483647 - (tl.max(best, axis=0) & 2147483647)
            tl.store(out_ptr + k, pick)
            prev = pick
    if WITH_CONF:  # every slot at once, off the chain's serial path
        raws = confidence_rows(slots, slots < n, prevs, h_ptr, w_ptr, b_ptr, w1_ptr, H, R, stride_h, stride_w1,
                               WITH_MARKOV, BLOCK_S, BLOCK_H, BLOCK_R, NORM_IN, sq_ptr, nw_ptr, n_parts, PARTS_POW2,
                               eps)
        tl.store(raws_ptr + slots, raws, mask=slots < n)


_COMPUTE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def table_fits(w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the bias table `[V_in, V]` in `dtype` is small enough to build (TABLE_MAX_BYTES)."""
    return w1.shape[0] * w2.shape[0] * dtype.itemsize <= TABLE_MAX_BYTES


def bias_table(w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every chain bias at once: `[V_in, V]` in `dtype`, row p = `linear(w1[p], w2)` rounded to
    `dtype` as the linear layer's output is. Built once per drafter (one GEMM), outside graphs."""
    return torch.nn.functional.linear(w1.to(dtype), w2.to(dtype)).contiguous()


def markov_chain_confidence(logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                            dtype: torch.dtype, table: torch.Tensor, hidden, conf_w: torch.Tensor,
                            conf_b: torch.Tensor, conf_w1: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch chain over `table` with the anchor first, `[1 + n]`, and each slot's
    confidence score float32 `[n]` from the same launch: `gather.confidence_raw(hidden, conf_w,
    conf_b, prev, conf_w1)` with `prev` = the candidates' first n (each slot's previous token;
    `conf_w1` None: a head without the markov features), the same function of the same values.
    `hidden` `[n, H]` or its `PendingNorm`, as `confidence_raw` takes it. Slots whose tiles would
    not fit the registers (next_pow2(n) x the head's column block > CONF_TILE_MAX) are scored by
    the head's own launch after the chain: the same bits."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got {tuple(logits.shape)}")
    n = logits.shape[0]
    rows, conf = confidence_args(hidden, conf_w, conf_b, n if conf_w1 is not None else None, conf_w1)
    if rows != n:
        raise ValueError(f"the confidence head's rows ({rows}) are not the chain's slots ({n})")
    check_tensors(logits, conf["h_ptr"])
    block_s = max(1, next_pow2(n))
    if block_s * max(conf["BLOCK_H"], conf["BLOCK_R"]) > CONF_TILE_MAX:  # its slots' tiles would spill: two launches
        cand = markov_chain(logits, anchor, w1, w2, dtype, table, with_anchor=True)
        return cand, confidence_raw(hidden, conf_w, conf_b, cand[:-1] if conf_w1 is not None else None, conf_w1)
    raws = torch.empty(n, dtype=torch.float32, device=logits.device)
    return markov_chain(logits, anchor, w1, w2, dtype, table, with_anchor=True,
                        _conf=dict(WITH_CONF=True, BLOCK_S=block_s, raws_ptr=raws, **conf)), raws


def markov_chain(logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 dtype: torch.dtype, table: torch.Tensor | None = None, with_anchor: bool = False,
                 _conf: dict | None = None) -> torch.Tensor:
    """Greedy chain over `logits [n, V]` (float32): tokens `[n]` (int64, on the device), slot
    k picking `argmax(logits[k] + (w1[prev] @ w2.T))` in `dtype` as described above, `prev`
    starting at `anchor` (one int64 element). `w1 [V_in, r]`, `w2 [V, r]`, last axes contiguous.
    With `table` (`bias_table(w1, w2, dtype)`) the whole chain is one launch. No host sync:
    capturable in a CUDA graph. `with_anchor`: `[1 + n]`, the anchor first (a round's candidates;
    written by the table's launch, else one concatenation after the slots')."""
    if logits.dim() != 2 or logits.dtype not in _COMPUTE:
        raise ValueError(f"logits must be [n, V] float32, bfloat16 or float16, got {logits.dtype} {tuple(logits.shape)}")
    n, V = logits.shape
    if w2.dim() != 2 or w2.shape[0] != V or w1.dim() != 2 or w1.shape[1] != w2.shape[1]:
        raise ValueError(f"w1 [V_in, r] and w2 [V={V}, r] expected, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    if w1.shape[0] < V:
        raise ValueError(f"w1 must have at least {V} rows (a pick, any of the V tokens, indexes it), got {w1.shape[0]}")
    if dtype not in _COMPUTE:
        raise TypeError(f"compute dtype {dtype} not supported (float32, bfloat16, float16)")
    check_tensors(logits, anchor, w1, w2)
    for x, name in ((logits, "logits"), (w1, "w1"), (w2, "w2")):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the last axis must be contiguous")
    if _conf is not None and table is None:
        raise ValueError("the chain scores its slots in its one launch only: pass the bias table")
    if table is None and with_anchor:  # the slots' launches, then the anchor in front
        return torch.cat([anchor.reshape(1).long(), markov_chain(logits, anchor, w1, w2, dtype)])
    out = torch.empty(n + int(with_anchor), dtype=torch.long, device=logits.device)
    if n == 0:
        if with_anchor:
            out.copy_(anchor.reshape(1))
        return out
    if table is not None:
        if table.shape != (w1.shape[0], V) or table.dtype != dtype or table.stride(-1) != 1:
            raise ValueError(f"table must be [{w1.shape[0]}, {V}] {dtype} with a contiguous last axis, "
                             f"got {table.dtype} {tuple(table.shape)}")
        check_tensors(logits, table)
        block = min(TABLE_BLOCK, next_pow2(V))
        _markov_table_kernel[(1,)](logits, table, anchor.reshape(1), out, n, V, logits.stride(0), table.stride(0),
                                   BLOCK=block, ONE_TILE=V <= block, num_warps=TABLE_WARPS, WITH_ANCHOR=with_anchor,
                                   **(_conf or {}), **pdl_args(logits))
        return out
    parts = triton.cdiv(V, BLOCK_V)
    block_p = max(16, next_pow2(parts))
    vals = torch.empty((n, block_p), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((n, block_p), dtype=torch.int32, device=logits.device)
    anchor = anchor.reshape(1)
    R = w1.shape[1]
    for slot in range(n + 1):
        last = slot == n
        _markov_slot_kernel[(1 if last else parts,)](
            logits, w1, w2, anchor, vals, idxs, out, slot, V, R, parts,
            logits.stride(0), w1.stride(0), w2.stride(0),
            COMPUTE=_COMPUTE[dtype], FIRST=slot == 0, REDUCE_ONLY=last,
            BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, BLOCK_P=block_p, num_warps=4, **pdl_args(logits),
        )
    return out
