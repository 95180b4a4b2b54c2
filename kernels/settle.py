"""A chained speculative round's settlement on the device: window, accepted prefix, next inputs.

A round queued before the host has read the previous one (the engine's pipelined rounds) must
decide on the device what the host decides after its read in an ordinary round: how many of
the verified rows count (the verify window), how many drafts were accepted (m), and where the
next round starts with which anchor. Written as tensor ops, that is some thirty tiny kernels at
the end of every round (docs/tuning.md#device-settlement); here it is one
launch that also packs the round's output for the host's read.

`settle_round(cand, sel, raws, inputs, threshold, kind=, cap=, adapt=, cost=)`, one program:

- window `vt`: the ladder's (`inputs[3]`), or from the drafter's confidence raws: keep leading
  slots while the running product of sigmoids (`confidence`) or each sigmoid
  (`confidence-slot`) stays >= threshold, `vt = clamp(1 + kept, 2, max(cap, 2))`; or the
  expert-priced window (`priced`): the `v` in [2, cap] with the most expected tokens
  `1 + Σ_{j<v-1} survival_j` (the sigmoids' running product) per `cost[v - 1]`, moving to a
  rate only when it beats the best by a factor 1 + 1e-12 (spec/priced.py `priced_vt`); or
  carried (`priced-runs`, `inputs[3]`); then capped by the budget `inputs[4]` and at least 1. The sigmoid is `1 / (1 + exp(-x))` in float64 (0 below
  -700) and the product runs slot after slot, as the host's policy code computes it (its
  float64 `exp` may differ from the host's in the last bit: a window moves only when the
  survival lands within an ulp of threshold, and the stream never does: acceptance is the target's);
- `m` = the leading run of `cand[j + 1] == sel[j]` for `j < vt - 1`;
- `inputs := [t_start + m + 1, d_start + m + 1, sel[m], next vt, budget - m - 1]`, next vt
  `clamp(m + 2, 3, cap)` when the ladder adapts (`min(max(m + 2, 3), cap)`), else `cap`; under
  `priced-runs` `inputs` also holds `[kept, rejected]`, updated by the round (`+ m`, `+ (m <
  vt - 1)`), and the next vt is the priced window over the survival `a^(j+1)` (a running
  product), `a = (kept + 1) / (kept + rejected + 2)` (spec/priced.py `accepted_runs_survival`);
- the priced kinds run without fused multiply-adds (`enable_fp_fusion=False`): the host's
  roundings, op for op;
- `out [2W + n + 2]` float64: `cand ; sel ; raws ; vt ; m` (ids < 2^53 and float32 raws exact);
- with `restore=` (int32 `[2]`) and `ring=`: `restore := [t_start % ring, m + 1]`, the rows a
  replay restore of the hybrid's recurrent state re-runs, or `[t_start % ring, -1]` when all W
  rows are kept (the step already wrote that state: nothing to re-run).

`inputs` is read whole before it is written (one program). `threshold` is a float64 `[1]` tensor (a
Python float would reach the kernel as float32). The twin `settle_round_ref` is the same
arithmetic in torch ops (settle_ref.py: the CPU path, and what the kernel is
tested against).

Public API: `settle_round`, `settle_round_ref`, `KINDS`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settle_ref import KINDS, PRICED_KINDS, RAW_KINDS, TIE, check_settle
from .settle_ref import settle_round as settle_round_ref  # the torch twin

from ._common import check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait


@triton.jit
def _priced_step(v, tokens, survival_j, cost_ptr, best, best_rate, tie):
    """One candidate window `v` of the priced argmax: tokens += survival_j, rate per cost[v-1]."""
    tokens = tokens + survival_j
    rate = tokens / tl.load(cost_ptr + v - 1)
    better = rate > best_rate * tie
    return tokens, tl.where(better, v, best), tl.where(better, rate, best_rate)


@triton.jit
def _settle_kernel(cand_ptr, sel_ptr, raws_ptr, inputs_ptr, threshold_ptr, out_ptr, restore_ptr, cost_ptr, cap, ring,
                   W: tl.constexpr, ND: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr,
                   ADAPT: tl.constexpr, RESTORE: tl.constexpr = False, NC: tl.constexpr = 0,
                   TIE_C: tl.constexpr = 1.0, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    tie = tl.full((), TIE_C, tl.float64)  # the priced windows' tie factor, as a float64 constant
    offs = tl.arange(0, BLOCK)
    in_w = offs < W
    cand = tl.load(cand_ptr + offs, mask=in_w, other=0)
    sel = tl.load(sel_ptr + offs, mask=in_w, other=0)
    tl.store(out_ptr + offs, cand.to(tl.float64), mask=in_w)
    tl.store(out_ptr + W + offs, sel.to(tl.float64), mask=in_w)
    t_start = tl.load(inputs_ptr)
    d_start = tl.load(inputs_ptr + 1)
    budget = tl.load(inputs_ptr + 4)
    if KIND == 0 or KIND == 4:  # the ladder's, or the fitted priced window: carried
        vt = tl.load(inputs_ptr + 3)
    elif KIND == 3:  # priced from the raws: the argmax of tokens per cost over v in [2, NC]
        for i in tl.static_range(ND):
            tl.store(out_ptr + 2 * W + i, tl.load(raws_ptr + i).to(tl.float64))
        survival = tl.full((), 1.0, tl.float64)
        tokens = tl.full((), 1.0, tl.float64)
        vt = tl.full((), 2, tl.int64)
        best_rate = tl.full((), -1.0, tl.float64)
        for v in tl.static_range(2, NC + 1):
            s_j = tl.full((), 0.0, tl.float64)
            if v - 2 < ND:  # slot after slot: the host's order of the product
                raw = tl.load(raws_ptr + v - 2).to(tl.float64)
                survival = survival * tl.where(raw >= -700.0, 1.0 / (1.0 + tl.exp(-raw)), 0.0)
                s_j = survival
            tokens, vt, best_rate = _priced_step(v, tokens, s_j, cost_ptr, vt, best_rate, tie)
    else:
        threshold = tl.load(threshold_ptr)
        survival = tl.full((), 1.0, tl.float64)
        going = tl.full((), 1, tl.int64)
        kept = tl.full((), 0, tl.int64)
        for i in tl.static_range(ND):  # slot after slot: the host's order of the product
            raw = tl.load(raws_ptr + i).to(tl.float64)
            tl.store(out_ptr + 2 * W + i, raw)
            p = tl.where(raw >= -700.0, 1.0 / (1.0 + tl.exp(-raw)), 0.0)
            if KIND == 1:
                survival = survival * p
                ok = survival >= threshold
            else:
                ok = p >= threshold
            going = going * ok.to(tl.int64)
            kept += going
        vt = tl.minimum(tl.maximum(1 + kept, 2), tl.maximum(cap, 2))
    vt = tl.maximum(tl.minimum(vt, budget), 1)
    # drafts j = 0..W-2 (cand[j + 1]) against the target's picks sel[j], inside the window
    nxt_cand = tl.load(cand_ptr + offs + 1, mask=offs + 1 < W, other=0)
    agree = (nxt_cand == sel) & (offs < W - 1) & (offs < vt - 1)
    m = tl.min(tl.where(agree, BLOCK, offs), axis=0).to(tl.int64)  # the first disagreement
    anchor = tl.sum(tl.where(offs == m, sel, 0), axis=0)
    if KIND == 4:  # the runs so far, this round's in; the window priced over their fitted survival
        kept_runs = tl.load(inputs_ptr + 5) + m
        rejected = tl.load(inputs_ptr + 6) + (m < vt - 1).to(tl.int64)
        alpha = (kept_runs + 1).to(tl.float64) / (kept_runs + rejected + 2).to(tl.float64)
        survival = tl.full((), 1.0, tl.float64)
        tokens = tl.full((), 1.0, tl.float64)
        next_vt = tl.full((), 2, tl.int64)
        best_rate = tl.full((), -1.0, tl.float64)
        for v in tl.static_range(2, NC + 1):
            survival = survival * alpha
            tokens, next_vt, best_rate = _priced_step(v, tokens, survival, cost_ptr, next_vt, best_rate, tie)
        tl.store(inputs_ptr + 5, kept_runs)
        tl.store(inputs_ptr + 6, rejected)
    else:
        next_vt = tl.minimum(tl.maximum(m + 2, 3), cap)
    if not ADAPT:
        next_vt = (m * 0 + cap).to(tl.int64)
    tl.store(out_ptr + 2 * W + ND, vt.to(tl.float64))
    tl.store(out_ptr + 2 * W + ND + 1, m.to(tl.float64))
    if RESTORE:  # the replay restore's ring rows: none when the step's last row is kept
        tl.store(restore_ptr, (t_start % ring).to(tl.int32))
        tl.store(restore_ptr + 1, tl.where(m + 1 == W, -1, m + 1).to(tl.int32))
    tl.store(inputs_ptr, t_start + m + 1)
    tl.store(inputs_ptr + 1, d_start + m + 1)
    tl.store(inputs_ptr + 2, anchor)
    tl.store(inputs_ptr + 3, next_vt.to(tl.int64))
    tl.store(inputs_ptr + 4, budget - m - 1)


def settle_round(cand: torch.Tensor, sel: torch.Tensor, raws: torch.Tensor | None, inputs: torch.Tensor,
                 threshold: torch.Tensor | None, *, kind: str, cap: int, adapt: bool,
                 restore: torch.Tensor | None = None, ring: int = 0, cost: torch.Tensor | None = None) -> torch.Tensor:
    """Settle a round (module docstring): returns `out [2W + n + 2]` float64 and rewrites `inputs`
    `[t_start, d_start, last, vt, budget]` (int64; `priced-runs`: `+ [kept, rejected]`) for the
    next round. `raws` (float32 `[n]`) under a window sized from them (the ladder's and
    `priced-runs`' outputs have none); `threshold` (float64 `[1]`) under a confidence window;
    `cost` (float64 `[cap]`) under a priced one. `restore` (int32 `[2]`) and `ring`: also write
    a replay restore's ring rows."""
    check_settle(cand, sel, raws, inputs, threshold, kind, cap, restore, ring, cost)
    nd = raws.shape[0] if kind in RAW_KINDS else 0
    check_tensors(*[x for x in (cand, sel, raws, inputs, threshold, restore, cost) if x is not None])
    w = cand.shape[0]
    out = torch.empty(2 * w + nd + 2, dtype=torch.float64, device=cand.device)
    _settle_kernel[(1,)](cand, sel, raws if nd else out, inputs, threshold if threshold is not None else out,
                         out, restore if restore is not None else inputs, cost if cost is not None else out,
                         cap, max(ring, 1), W=w, ND=nd, BLOCK=next_pow2(w), KIND=KINDS[kind], ADAPT=bool(adapt),
                         RESTORE=restore is not None, NC=cap if kind in PRICED_KINDS else 0, TIE_C=TIE, num_warps=1,
                         enable_fp_fusion=False,  # no fused multiply-adds: the host's roundings, op for op
                         **pdl_args(cand))
    return out
