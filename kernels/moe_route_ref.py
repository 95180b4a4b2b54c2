"""A mixture-of-experts router's picks from its logits, the one torch body (no triton): the twin
`moe_route.py`'s kernel is tested against, and what the engine's torch path runs
(`TorchStepOps.moe_route`, `layers/moe.py`).

Per row of `logits [t, E]` (the router matmul's output, model dtype): softmax in float32, the k
largest probabilities with ties broken by the lower expert index (a stable descending sort:
`torch.topk` leaves the order of equal values unspecified), divided by their sum when
`normalize`, times a per-expert float32 scale when given (Gemma 4's `per_expert_scale`), cast
to the logits' dtype. Then, with `live` (int32 `[1]`, a fixed step's live-row count on the
device), every row from it on is padding: ids `E` (no expert) and weights 0. With `counts`
(int64 `[2]`, `layers/moe.py` `ExpertReads`' totals) the call adds 1 and its distinct experts
(those of the live rows) to them. Nothing is read on the host, so a CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemma4_ref import gemma_rms_norm_ref


def topk_lowest_index(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `probs [t, E]` along E, ties broken by the lower index: values and indices
    `[t, k]`, in descending value (a stable descending sort gives that order by definition)."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def count_experts(counts: torch.Tensor, experts: torch.Tensor, num_experts: int) -> None:
    """Add one call and the distinct ids below `num_experts` of `experts [t, k]` to `counts`
    (int64 `[2]`), on the device (an id of `num_experts`, a padding row's, is no expert)."""
    hit = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device)
    hit.index_fill_(0, experts.reshape(-1), 1)  # a padding row's id lands in the call's slot
    hit[-1:].fill_(1)  # the call; a kernel, not a host-to-device copy (a capture refuses those)
    counts += torch.stack((hit[-1], hit[:-1].sum()))


def routed_experts_ref(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The distinct experts of `experts [t, k]` in ascending index, then `num_experts` in every
    slot left: int32 `[num_experts]` (an id of `num_experts`, a padding row's, is no expert).
    What `moe_route.router_route` writes to `routed` for the expert kernels' grid
    (`memra_kernels.moe`: a program per routed expert's tile comes first); on the device."""
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=experts.device)
    hit.index_fill_(0, experts.reshape(-1), True)
    ids = torch.arange(num_experts, dtype=torch.int32, device=experts.device)
    return torch.sort(torch.where(hit[:-1], ids, num_experts)).values


def moe_route_ref(logits: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[t, k]` (logits' dtype) and expert ids `[t, k]` (int64) of `logits [t, E]`
    (module docstring); `scale [E]` any float dtype (widened to float32, exact)."""
    n_exp = logits.shape[-1]
    if not 1 <= k <= n_exp:
        raise ValueError(f"top-k {k} must lie in [1, {n_exp}] (the router's experts)")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = topk_lowest_index(probs, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale is not None:
        weights = weights * scale.float()[experts]
    weights = weights.to(logits.dtype)
    if live is not None:
        pad = torch.arange(experts.shape[0], device=experts.device)[:, None] >= live
        weights, experts = weights.masked_fill(pad, 0), experts.masked_fill(pad, n_exp)
    if counts is not None:
        count_experts(counts, experts, n_exp)
    return weights, experts


def router_pre_norm_ref(x: torch.Tensor, weight: torch.Tensor, factor: float, eps: float) -> torch.Tensor:
    """Gemma 4's router input from the residual `x [t, hidden]`: the unweighted RMSNorm (float32,
    `(mean(x^2) + eps)^-0.5`, cast to x's dtype: `gemma4_ref.gemma_rms_norm_ref` with no weight),
    times `weight [hidden]` (x's dtype, rounded), times the float `factor` (`hidden^-0.5`; a
    float32 product, rounded): three roundings to x's dtype, in this order."""
    return gemma_rms_norm_ref(x, None, eps) * weight * factor


def router_route_ref(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
                     counts: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                     pre_norm: tuple[torch.Tensor, float, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_ref` of a router's logits `F.linear(x, router)` in the model dtype: `x [t,
    hidden]`, `router [E, hidden]` (the twin of `moe_route.router_route`, one launch).
    `pre_norm` `(weight [hidden], factor, eps)`: x goes through `router_pre_norm_ref` first."""
    if pre_norm is not None:
        x = router_pre_norm_ref(x, *pre_norm)
    return moe_route_ref(F.linear(x, router), k, normalize, live, counts, scale)
