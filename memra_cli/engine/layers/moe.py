"""The mixture-of-experts feed-forward's routing, its expert op's one torch body, and the count of
experts it ran.

Routing (`route`) is one arithmetic for every step: router logits in the model dtype, then the
picks (the step ops' `router_route`: the torch ops' `linear` and the twin
`memra_kernels.moe_route_ref`, or with the kernels one launch of both for a step's rows): softmax in float32, top-k with ties broken by the lower expert index,
renormalised over the k kept when asked, cast back to the model dtype, a fixed step's padding
rows routed to no expert, the call counted. The experts' grouped GLU and combine (`moe_swiglu`, SwiGLU
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
from memra_kernels.moe_route_ref import count_experts, moe_route_ref, topk_lowest_index  # noqa: F401


def route(x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool, ops=None, live: torch.Tensor | None = None,
          counts: torch.Tensor | None = None, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[t, k]` (model dtype) and expert ids `[t, k]` for `x [t, hidden]` with
    `router [E, hidden]`: the logits `x @ router.T` in the model dtype, then the picks: the step
    ops' `router_route` (`ops`: their `linear` then `moe_route`, or one launch of both with the
    kernels for a step's rows; None: `F.linear` and the twin, memra_kernels.moe_route_ref):
    softmax in float32, top-k
    (lower index on ties), renormalised over the kept k when `normalize` (Qwen3-MoE's
    `norm_topk_prob`); rows from `live` on (int32 `[1]`), and from the host `bound` on (the
    state's `reading_rows`), routed to no expert (id E, weight 0); the call counted into `counts`
    (`ExpertReads.sink()`)."""
    if ops is None:
        return moe_route_ref(F.linear(x, router), k, normalize, bounded_live(live, bound, x), counts)
    return ops.router_route(x, router, k, normalize, live, counts, bound=bound)


def bounded_live(live: torch.Tensor | None, bound: int | None, x: torch.Tensor) -> torch.Tensor | None:
    """The live-row count of a call on `x [t, ...]` whose rows from `bound` on are padding too:
    `live` capped at `bound` (int32 `[1]` on x's device), `live` itself where no bound cuts a row."""
    if bound is None or bound >= x.shape[0]:
        return live
    if live is None:
        return torch.full((1,), bound, dtype=torch.int32, device=x.device)
    return torch.clamp(live, max=bound)


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

    def sink(self) -> torch.Tensor | None:
        """The device totals a routing op adds its call to (`moe_route`'s `counts`), or None inside
        `not_counted` (read when the op is traced: a captured step counts at every replay)."""
        return None if _paused[0] else self._totals

    def count(self, experts: torch.Tensor) -> None:
        """Add one call that ran the distinct ids of `experts [t, k]` (an id of `num_experts`:
        a padding row's, no expert)."""
        if not _paused[0]:
            count_experts(self._totals, experts, self.num_experts)

    def snapshot(self) -> tuple[int, int]:
        """(calls, experts) so far: a host read."""
        calls, experts = self._totals.tolist()
        return calls, experts
