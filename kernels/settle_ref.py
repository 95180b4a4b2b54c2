"""A chained speculative round's settlement, in torch ops: window, accepted prefix, next inputs.

The torch side of the step-op seam's `settle_round` (layers/step_ops.py): a round queued before
the host has read the previous one (spec/session.py `_pipelined_spec`) decides on the device
what the host decides after its read in an ordinary round. `memra_kernels.settle` does the same
in one launch (its docstring states the arithmetic; this is its twin, `settle_round_ref` there).
It is the op's one torch body and imports no triton, so the engine's torch step ops call it on
any machine:

- window `vt`: the ladder's (`inputs[3]`), or from the confidence raws as policy.py sizes it
  (float64 sigmoid, the product slot after slot), or the expert-priced window (`priced`: the
  `v` in [2, cap] of the most expected tokens `1 + Σ_{j<v-1} survival_j` per `cost[v - 1]`, a
  strictly better rate by a factor 1 + 1e-12 to move, as spec/priced.py `priced_vt`), or carried
  (`priced-runs`: `inputs[3]`, like the ladder); then capped by the budget `inputs[4]`, >= 1;
- `m` = the leading run of `cand[j + 1] == sel[j]` for `j < vt - 1`;
- `inputs := [t_start + m + 1, d_start + m + 1, sel[m], next vt, budget - m - 1]`, next vt the
  ladder's `clamp(m + 2, 3, cap)` when it adapts, else `cap`; under `priced-runs` `inputs` is
  `[..., kept, rejected]` (the session's drafts accepted, rounds that rejected one), updated by
  the round, and the next vt is the priced window over the geometric survival fitted to them
  (`a = (kept + 1) / (kept + rejected + 2)`, `a^(j+1)` as a running product: spec/priced.py
  `accepted_runs_survival`);
- returns `cand ; sel ; raws ; vt ; m` as float64;
- with `restore` (int32 `[2]`, a state whose rollback runs on the device: the hybrid's), also
  `restore := [t_start % ring, m + 1]`, or `[t_start % ring, -1]` when every row is kept
  (`m + 1 == W`: the step itself left that state), the ring rows a replay restore re-runs.

`cost` (float64 `[cap]`, the bytes of a step of 1..cap rows) only for the priced kinds.
"""

from __future__ import annotations

import torch

KINDS = {"ladder": 0, "confidence": 1, "confidence-slot": 2, "priced": 3, "priced-runs": 4}
RAW_KINDS = ("confidence", "confidence-slot", "priced")  # sized from the confidence raws
PRICED_KINDS = ("priced", "priced-runs")
TIE = 1.0 + 1e-12  # a window moves to a strictly better rate, not a rounding tie (priced_vt's rule)


def check_settle(cand, sel, raws, inputs, threshold, kind, cap, restore=None, ring=0, cost=None):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    for x, name, dt in ((cand, "cand", torch.int64), (sel, "sel", torch.int64), (inputs, "inputs", torch.int64)):
        if x.dim() != 1 or x.dtype != dt or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D {dt} tensor, got {x.dtype} {tuple(x.shape)}")
    n_inputs = 7 if kind == "priced-runs" else 5
    if cand.shape != sel.shape or cand.shape[0] < 1 or inputs.shape[0] != n_inputs:
        raise ValueError(f"cand {tuple(cand.shape)} and sel {tuple(sel.shape)} must match; inputs must be [{n_inputs}]")
    if kind in RAW_KINDS:
        if raws is None or raws.dim() != 1 or raws.dtype != torch.float32 or not raws.is_contiguous():
            raise ValueError("a confidence window needs contiguous float32 raws [n]")
    if kind in ("confidence", "confidence-slot"):
        if threshold is None or threshold.shape != (1,) or threshold.dtype != torch.float64:
            raise ValueError("a confidence window needs threshold as a float64 [1] tensor")
    if cap < 2:
        raise ValueError(f"cap must be >= 2, got {cap}")
    if kind in PRICED_KINDS:
        if cost is None or cost.shape != (cap,) or cost.dtype != torch.float64 or not cost.is_contiguous():
            raise ValueError(f"a priced window needs cost as a contiguous float64 [{cap}] tensor (bytes of 1..cap rows)")
    if restore is not None:
        if restore.shape != (2,) or restore.dtype != torch.int32 or restore.device != cand.device:
            raise ValueError(f"restore must be int32 [2] on {cand.device}, got {tuple(restore.shape)} {restore.dtype}")
        if ring < cand.shape[0]:
            raise ValueError(f"a restore needs a ring of at least the round's {cand.shape[0]} rows, got {ring}")


def _sigmoids(raws: torch.Tensor) -> torch.Tensor:
    r = raws.double()
    return torch.where(r >= -700.0, 1.0 / (1.0 + torch.exp(-r)), torch.zeros_like(r))


def _survival(p: torch.Tensor) -> list[torch.Tensor]:
    """The running product of `p`, slot after slot (the host's order), as 0-d tensors."""
    survival, out = torch.ones((), dtype=torch.float64, device=p.device), []
    for i in range(p.shape[0]):
        survival = survival * p[i]
        out.append(survival)
    return out


def _priced(survival: list[torch.Tensor], cost: torch.Tensor, cap: int) -> torch.Tensor:
    """The v in [2, cap] of the most `1 + Σ_{j<v-1} survival[j]` per `cost[v - 1]` (0-d long)."""
    best = torch.full((), 2, dtype=torch.int64, device=cost.device)
    best_rate = torch.full((), -1.0, dtype=torch.float64, device=cost.device)
    tokens = torch.ones((), dtype=torch.float64, device=cost.device)
    for v in range(2, cap + 1):
        if v - 2 < len(survival):
            tokens = tokens + survival[v - 2]
        rate = tokens / cost[v - 1]
        better = rate > best_rate * TIE
        best, best_rate = torch.where(better, v, best), torch.where(better, rate, best_rate)
    return best


def _window(kind, raws, inputs, threshold, cap, cost) -> torch.Tensor:
    """This round's window before the budget (0-d long)."""
    if kind in ("ladder", "priced-runs"):
        return inputs[3]
    p = _sigmoids(raws)
    if kind == "priced":
        return _priced(_survival(p), cost, cap)
    if kind == "confidence":
        p = torch.stack(_survival(p)) if p.shape[0] else p
    kept = torch.cumprod((p >= threshold[0]).long(), 0).sum()
    return (1 + kept).clamp(min=2, max=max(cap, 2))


def _fitted_next(inputs, vt, m, cap, cost) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`priced-runs`: the next window over the survival fitted to the updated runs, and them."""
    kept = inputs[5] + m
    rejected = inputs[6] + (m < vt - 1).long()
    alpha = (kept + 1).double() / (kept + rejected + 2).double()
    survival = _survival(alpha.expand(cap - 1))
    return _priced(survival, cost, cap), [kept, rejected]


def settle_round(cand: torch.Tensor, sel: torch.Tensor, raws: torch.Tensor | None, inputs: torch.Tensor,
                 threshold: torch.Tensor | None, *, kind: str, cap: int, adapt: bool,
                 restore: torch.Tensor | None = None, ring: int = 0, cost: torch.Tensor | None = None) -> torch.Tensor:
    """Settle a round (module docstring); rewrites `inputs` `[t_start, d_start, last, vt,
    budget]` (int64; `priced-runs`: `+ [kept, rejected]`) for the next round. `raws` (float32
    `[n]`) under a window sized from them; `threshold` (float64 `[1]`) under a confidence window;
    `cost` (float64 `[cap]`) under a priced one; `restore` (int32 `[2]`) and `ring` only for a
    state restored on the device."""
    check_settle(cand, sel, raws, inputs, threshold, kind, cap, restore, ring, cost)
    w = cand.shape[0]
    vt = torch.minimum(_window(kind, raws, inputs, threshold, cap, cost), inputs[4]).clamp(min=1)
    parts = [cand.double(), sel.double()] + ([raws.double()] if kind in RAW_KINDS else [])
    slots = torch.arange(w - 1, device=cand.device)
    agree = (cand[1:] == sel[:-1]) & (slots < vt - 1)
    m = torch.cumprod(agree.long(), 0).sum()
    step = m + 1
    runs = []
    if kind == "priced-runs":
        next_vt, runs = _fitted_next(inputs, vt, m, cap, cost)
    else:
        next_vt = (m + 2).clamp(min=3, max=cap)
    if not adapt:
        next_vt = torch.full_like(m, cap)
    anchor = sel.index_select(0, m.reshape(1)).reshape(())  # (sel[m] would read m on the host)
    nxt = torch.stack([inputs[0] + step, inputs[1] + step, anchor, next_vt, inputs[4] - step] + runs)
    out = torch.cat(parts + [torch.stack([vt, m]).double()])
    if restore is not None:
        rows = torch.where(step == w, torch.full_like(step, -1), step)
        restore.copy_(torch.stack([inputs[0] % ring, rows]).to(torch.int32))
    inputs.copy_(nxt)  # after everything above read them
    return out
