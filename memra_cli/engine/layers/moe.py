"""The mixture-of-experts feed-forward: routing and a row-invariant grouped SwiGLU (torch).

Routing (`route`) is one arithmetic for every step: router logits in the model dtype, softmax in
float32, top-k with ties broken by the lower expert index, renormalised over the k kept when
asked, cast back to the model dtype. `moe_swiglu` groups rows by expert so each routed expert's
weights are used once per step, and keeps the fixed-width exactness rule: every expert matmul
runs over all `t` rows of the step (rows that did not pick it are zeros in their own slot), so a
row's products never depend on which or how many rows share its expert; the combine sums a row's
k contributions in ascending expert index, from that row's values only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_lowest_index(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `probs [t, E]` along E, ties broken by the lower index: values and indices
    `[t, k]`, in descending value. A stable descending sort gives that order by definition
    (torch.topk leaves the order of equal values unspecified)."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def route(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[t, k]` (model dtype) and expert ids `[t, k]` for `x [t, hidden]` with
    `router [E, hidden]`: softmax in float32, top-k (lower index on ties), renormalised over the
    kept k when `normalize` (Qwen3-MoE's `norm_topk_prob`)."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = topk_lowest_index(probs, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def moe_swiglu(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[r, j] · down_e(silu(gate_e(x_r)) · up_e(x_r)), e = experts[r, j], for
    `x [t, hidden]`; `w_gate_up [E, 2*I, hidden]` (gate rows first), `w_down [E, hidden, I]`.

    Each expert that any row picked runs once, over a `[t, hidden]` buffer holding its rows in
    their own slots (zeros elsewhere): the matmul's width is the step's, never the group's.
    Contributions are added per row in ascending expert index (the order transformers' loop
    adds them), starting from zeros, in the model dtype. Returns `[t, hidden]`.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        hit = experts == e  # [t, k]; at most one True per row (top-k picks distinct experts)
        rows = hit.any(dim=-1)
        buf = torch.where(rows[:, None], x, torch.zeros((), dtype=x.dtype))
        gate, up = F.linear(buf, w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])  # [t, hidden]
        w = (weights * hit).sum(dim=-1)  # the row's weight for e, 0 where it did not pick e
        out = torch.where(rows[:, None], out + y * w[:, None], out)
    return out


def moe_glu(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, act) -> torch.Tensor:
    """`moe_swiglu` with another gate activation `act` (Gemma 4's experts: GELU-tanh), under the
    same rule: each routed expert runs once over a step-wide buffer holding its rows in their own
    slots, and a row's contributions are added in ascending expert index from zeros. Returns
    `[t, hidden]` for `x [t, hidden]`, `weights` / `experts [t, k]`."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        hit = experts == e
        rows = hit.any(dim=-1)
        buf = torch.where(rows[:, None], x, torch.zeros((), dtype=x.dtype))
        gate, up = F.linear(buf, w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w_down[e])
        w = (weights * hit).sum(dim=-1)
        out = torch.where(rows[:, None], out + y * w[:, None], out)
    return out
