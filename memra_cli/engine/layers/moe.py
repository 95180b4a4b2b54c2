"""The mixture-of-experts feed-forward's routing, and its expert op's one torch body.

Routing (`route`) is one arithmetic for every step: router logits in the model dtype, softmax in
float32, top-k with ties broken by the lower expert index, renormalised over the k kept when
asked, cast back to the model dtype. The experts' grouped SwiGLU and combine (`moe_swiglu`) is
`memra_kernels.moe_ref`'s body, which the step ops run (`TorchStepOps.moe_swiglu`) or replace by
the few-row kernels (`TritonStepOps.moe_swiglu`); both keep a row's output independent of the
rows beside it (docs/moe.md, "The expert kernels").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memra_kernels.moe_ref import moe_swiglu_ref as moe_swiglu  # noqa: F401  (the op's one torch body)


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


def moe_glu(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor, act) -> torch.Tensor:
    """`moe_swiglu`'s torch body with another gate activation `act` (Gemma 4's experts: GELU-tanh), under the
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
