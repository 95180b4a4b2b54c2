"""The mixture-of-experts feed-forward's routing, its expert op's one torch body, and the count of
experts it ran.

Routing (`route`) is one arithmetic for every step: router logits in the model dtype, softmax in
float32, top-k with ties broken by the lower expert index, renormalised over the k kept when
asked, cast back to the model dtype. The experts' grouped GLU and combine (`moe_swiglu`, SwiGLU
or with `activation="gelu_tanh"` Gemma 4's) is `memra_kernels.moe_ref`'s body, which the step
ops run (`TorchStepOps.moe_swiglu`) or replace by the few-row kernels
(`TritonStepOps.moe_swiglu`); both keep a row's output independent of the rows beside it
(docs/moe.md, "The expert kernels").

`ExpertReads` counts, on the device, the sparse-layer calls and the distinct experts each ran,
for every MoE family (the bench's expert counts): no host read, so a captured step counts too.
"""

from __future__ import annotations

from contextlib import contextmanager

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


def drop_padding_rows(weights: torch.Tensor, experts: torch.Tensor, live: torch.Tensor | None, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed step's padding rows (row index >= `live`, int32 `[1]` on the device; None: every row
    is real) routed to no expert: their ids become `num_experts`, which the expert op (twin and
    kernels) and `ExpertReads` skip, and their weights 0. Live rows keep their bits; nothing is
    read on the host. `weights`, `experts`: `[t, k]`."""
    if live is None:
        return weights, experts
    pad = torch.arange(experts.shape[0], device=experts.device)[:, None] >= live
    return weights.masked_fill(pad, 0), experts.masked_fill(pad, num_experts)


_paused = [0]  # depth of `not_counted` blocks open now


@contextmanager
def not_counted():
    """Runs inside this block add nothing to any `ExpertReads` (a CUDA graph's warm-up runs:
    runtime/cuda_graphs.py). A Python flag read when the op is traced, so a graph captured
    outside the block counts at every replay."""
    _paused[0] += 1
    try:
        yield
    finally:
        _paused[0] -= 1


class ExpertReads:
    """(sparse-layer calls, distinct experts they ran), summed on the device over every forward
    and step of one target (replays of a captured step included, a graph's warm-up runs not).
    `snapshot()` reads it on the host (the bench, before and after a session)."""

    def __init__(self, num_experts: int, device: torch.device):
        self.num_experts = num_experts
        self._totals = torch.zeros(2, dtype=torch.int64, device=device)

    def count(self, experts: torch.Tensor) -> None:
        """Add one call that ran the distinct ids of `experts [t, k]` (an id of `num_experts`:
        a padding row's, no expert)."""
        if _paused[0]:
            return
        hit = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=experts.device)
        # the experts run; a padding row's id (num_experts, `drop_padding_rows`) lands in the call's slot
        hit.index_fill_(0, experts.reshape(-1), 1)
        hit[-1:].fill_(1)  # the call, in the last slot; a kernel, not a host-to-device copy (a capture refuses those)
        self._totals += torch.stack((hit[-1], hit[:-1].sum()))

    def snapshot(self) -> tuple[int, int]:
        """(calls, experts) so far: a host read."""
        calls, experts = self._totals.tolist()
        return calls, experts
