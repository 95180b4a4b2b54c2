"""A chained speculative round's settlement, in torch ops: window, accepted prefix, next inputs.

The torch side of the step-op seam's `settle_round` (layers/step_ops.py): a round queued before
the host has read the previous one (spec/session.py `_pipelined_spec`) decides on the device
what the host decides after its read in an ordinary round. `memra_kernels.settle` does the same
in one launch (its docstring states the arithmetic; this is its twin, `settle_round_ref` there).
It is the op's one torch body and imports no triton, so the engine's torch step ops call it on
any machine:

- window `vt`: the ladder's (`inputs[3]`), or from the confidence raws as policy.py sizes it
  (float64 sigmoid, the product slot after slot), then capped by the budget `inputs[4]`, >= 1;
- `m` = the leading run of `cand[j + 1] == sel[j]` for `j < vt - 1`;
- `inputs := [t_start + m + 1, d_start + m + 1, sel[m], next vt, budget - m - 1]`;
- returns `cand ; sel ; raws ; vt ; m` as float64;
- with `restore` (int32 `[2]`, a state whose rollback runs on the device: the hybrid's), also
  `restore := [t_start % ring, m + 1]`, or `[t_start % ring, -1]` when every row is kept
  (`m + 1 == W`: the step itself left that state), the ring rows a replay restore re-runs.
"""

from __future__ import annotations

import torch

KINDS = {"ladder": 0, "confidence": 1, "confidence-slot": 2}


def check_settle(cand, sel, raws, inputs, threshold, kind, cap, restore=None, ring=0):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    for x, name, dt in ((cand, "cand", torch.int64), (sel, "sel", torch.int64), (inputs, "inputs", torch.int64)):
        if x.dim() != 1 or x.dtype != dt or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D {dt} tensor, got {x.dtype} {tuple(x.shape)}")
    if cand.shape != sel.shape or cand.shape[0] < 1 or inputs.shape[0] != 5:
        raise ValueError(f"cand {tuple(cand.shape)} and sel {tuple(sel.shape)} must match; inputs must be [5]")
    if kind != "ladder":
        if raws is None or raws.dim() != 1 or raws.dtype != torch.float32 or not raws.is_contiguous():
            raise ValueError("a confidence window needs contiguous float32 raws [n]")
        if threshold is None or threshold.shape != (1,) or threshold.dtype != torch.float64:
            raise ValueError("a confidence window needs threshold as a float64 [1] tensor")
    if cap < 2:
        raise ValueError(f"cap must be >= 2, got {cap}")
    if restore is not None:
        if restore.shape != (2,) or restore.dtype != torch.int32 or restore.device != cand.device:
            raise ValueError(f"restore must be int32 [2] on {cand.device}, got {tuple(restore.shape)} {restore.dtype}")
        if ring < cand.shape[0]:
            raise ValueError(f"a restore needs a ring of at least the round's {cand.shape[0]} rows, got {ring}")


def settle_round(cand: torch.Tensor, sel: torch.Tensor, raws: torch.Tensor | None, inputs: torch.Tensor,
                     threshold: torch.Tensor | None, *, kind: str, cap: int, adapt: bool,
                     restore: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """Settle a round (module docstring); rewrites `inputs` `[t_start, d_start, last, vt,
    budget]` (int64) for the next round. `raws` (float32 `[n]`) and `threshold` (float64 `[1]`) only
    under a confidence window; `restore` (int32 `[2]`) and `ring` only for a state restored on
    the device."""
    check_settle(cand, sel, raws, inputs, threshold, kind, cap, restore, ring)
    w = cand.shape[0]
    if kind == "ladder":
        vt = inputs[3]
        parts = [cand.double(), sel.double()]
    else:
        r = raws.double()
        p = torch.where(r >= -700.0, 1.0 / (1.0 + torch.exp(-r)), torch.zeros_like(r))
        if kind == "confidence":
            survival, surv = torch.ones((), dtype=torch.float64, device=r.device), []
            for i in range(r.shape[0]):  # slot after slot, as the host's product
                survival = survival * p[i]
                surv.append(survival)
            p = torch.stack(surv) if surv else p
        keep = p >= threshold[0]
        kept = torch.cumprod(keep.long(), 0).sum()
        vt = (1 + kept).clamp(min=2, max=max(cap, 2))
        parts = [cand.double(), sel.double(), r]
    vt = torch.minimum(vt, inputs[4]).clamp(min=1)
    slots = torch.arange(w - 1, device=cand.device)
    agree = (cand[1:] == sel[:-1]) & (slots < vt - 1)
    m = torch.cumprod(agree.long(), 0).sum()
    step = m + 1
    next_vt = (m + 2).clamp(min=3, max=cap) if adapt else torch.full_like(m, cap)
    anchor = sel.index_select(0, m.reshape(1)).reshape(())  # (sel[m] would read m on the host)
    nxt = torch.stack([inputs[0] + step, inputs[1] + step, anchor, next_vt, inputs[4] - step])
    out = torch.cat(parts + [torch.stack([vt, m]).double()])
    if restore is not None:
        rows = torch.where(step == w, torch.full_like(step, -1), step)
        restore.copy_(torch.stack([inputs[0] % ring, rows]).to(torch.int32))
    inputs.copy_(nxt)  # after everything above read them
    return out
