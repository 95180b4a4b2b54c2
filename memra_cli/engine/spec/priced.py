"""A verify step's cost on a mixture-of-experts target, and the window that it prices.

A plain step reads the routed experts of one token; a verify step of `vt` rows reads the union
of every row's experts. With routing independent between rows, each of `E` experts is missed by
one row with probability `1 - k/E`, so a layer reads `E·(1 - (1 - k/E)^vt)` experts in
expectation (an upper bound: neighbouring tokens' routing is correlated, which shrinks the
union). `StepCost.bytes(vt)` is the weight bytes a step of `vt` rows reads: attention, router,
dense feed-forwards and lm_head once, plus the expected expert union per sparse layer. On a
dense target it is flat in `vt`, the rule every other window policy assumes.

A measured alternative (`routed_unions`): the target's own routing of the prompt's prefill (each
sparse layer's top-k ids per prompt token) gives the empirical expected union of `vt` consecutive
tokens, under the prompt's real correlation between neighbours; `StepCost.unions` carries it.

`priced_vt` picks the window that maximises expected committed tokens per byte read, from the
drafter's per-slot cumulative survival: the confidence head's raws (`survival_from_raws`), or for
a drafter without one a geometric fit of the session's accepted runs (`accepted_runs_survival`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class StepCost:
    """Weight bytes of a step, split into what every step reads and what its experts add.

    `fixed_bytes`: attention, norms, router, dense feed-forwards, embedding row and lm_head;
    `expert_bytes`: one expert's gate/up/down; `sparse_layers`, `num_experts`, `top_k` as in the
    config (0 sparse layers: a dense target)."""

    fixed_bytes: float
    expert_bytes: float = 0.0
    sparse_layers: int = 0
    num_experts: int = 1
    top_k: int = 1
    unions: tuple[float, ...] | None = None  # measured: mean experts per sparse layer of vt = 1.. rows

    @property
    def is_flat(self) -> bool:
        return self.sparse_layers == 0 or self.expert_bytes == 0 or self.top_k >= self.num_experts

    @property
    def model(self) -> str:
        """Which union it prices: `routed` (measured from a prompt's routing) or `shape`."""
        return "shape" if self.unions is None else "routed"

    def expected_union(self, vt: int) -> float:
        """Expected experts read per sparse layer by a step of `vt` rows: measured (`unions`), or
        for independently routed rows `E·(1 - (1 - k/E)^vt)`."""
        if self.unions is not None:
            return self.unions[vt - 1]
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** vt)

    def bytes(self, vt: int) -> float:
        """Expected weight bytes a step of `vt` rows reads."""
        return self.fixed_bytes + self.sparse_layers * self.expected_union(vt) * self.expert_bytes


def qwen3_moe_cost(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                   num_experts: int, top_k: int, moe_intermediate: int, dense_intermediate: int = 0,
                   dense_layers: int = 0, dtype_bytes: int = 2) -> StepCost:
    """`StepCost` of a Qwen3(-MoE) shape (`num_experts = 0`: dense, every layer's MLP of
    `dense_intermediate`); K/V reads are left out (they grow with the context, not with vt)."""
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    sparse = layers - dense_layers if num_experts else 0
    fixed = layers * attn + (layers - sparse) * 3 * hidden * dense_intermediate + sparse * num_experts * hidden
    fixed += vocab * hidden  # lm_head (the embedding is one row a token)
    return StepCost(fixed * dtype_bytes, 3 * hidden * moe_intermediate * dtype_bytes, sparse,
                    max(num_experts, 1), max(top_k, 1))


def expected_committed(survival: Sequence[float], vt: int) -> float:
    """Tokens a round commits in expectation with `vt` rows (the anchor's pick + accepted drafts):
    `1 + Σ_{j<vt-1} survival[j]`, `survival[j]` = P(drafts 0..j all accepted)."""
    return 1.0 + sum(survival[: vt - 1])


def priced_vt(survival: Sequence[float], cost: StepCost, cap: int) -> int:
    """The window in [2, cap] with the most expected committed tokens per expected byte; on a
    tie the narrower one (fewer bytes for the same tokens)."""
    best, best_rate = 2, -1.0
    tokens = 1.0  # expected_committed(survival, vt), kept as a running sum
    for vt in range(2, max(cap, 2) + 1):
        tokens += survival[vt - 2] if vt - 2 < len(survival) else 0.0
        rate = tokens / cost.bytes(vt)
        if rate > best_rate * (1.0 + 1e-12):  # a strictly better rate, not a rounding tie
            best, best_rate = vt, rate
    return best


def survival_from_raws(raws: Sequence[float]) -> list[float]:
    """Cumulative survival from the confidence head's pre-sigmoid slot scores."""
    out, s = [], 1.0
    for raw in raws:
        s *= 1.0 / (1.0 + math.exp(-raw)) if raw >= -700 else 0.0
        out.append(s)
    return out


def geometric_survival(alpha: float, n: int) -> list[float]:
    """The prior: each draft accepted with probability `alpha` given the ones before it."""
    return [alpha ** (j + 1) for j in range(n)]


def accepted_runs_alpha(accepted: int, rejected: int) -> float:
    """Per-draft acceptance fitted to a session's rounds: `accepted` drafts kept over them and
    `rejected` rounds that ended on a rejected draft (a round that kept every draft it verified
    ended on none: its run was cut by the window, not by the drafter). The posterior mean of a
    geometric run's rate under a uniform prior: `(accepted + 1) / (accepted + rejected + 2)`.

    The ladder reads the same evidence, the accepted run, one round at a time; fitted from one
    round, a window narrowed to 2 rows never sees a run past 1 and stays there on a steep cost
    (docs/moe.md, the simulation), so every round's run counts here."""
    return (accepted + 1) / (accepted + rejected + 2)


def accepted_runs_survival(accepted: int, rejected: int, n: int) -> list[float]:
    """Cumulative survival of `n` draft slots under `accepted_runs_alpha`: `a^(j+1)` as a
    running product (the device settle's order of the same float64 products, kernels/settle.py)."""
    a, s, out = accepted_runs_alpha(accepted, rejected), 1.0, []
    for _ in range(n):
        s *= a
        out.append(s)
    return out


def routed_unions(routing: Sequence[torch.Tensor], max_vt: int) -> tuple[float, ...]:
    """Mean experts per sparse layer that `vt` consecutive tokens route to, vt = 1..max_vt.

    `routing`: per sparse layer, the expert ids `[n, k]` of the prompt's n tokens in order. For
    each layer and each window of vt consecutive tokens the union's size is counted; the mean is
    over every window of every layer (integer counts, then one float division: deterministic).
    Needs `n >= max_vt`."""
    total, windows = [0] * max_vt, [0] * max_vt
    for ids in routing:
        n = ids.shape[0]
        if n < max_vt:
            raise ValueError(f"routing of {n} tokens cannot measure a {max_vt}-row union")
        ids = ids.long()
        hit = torch.zeros(n, int(ids.max()) + 1, dtype=torch.int32, device=ids.device)
        hit.scatter_(1, ids, 1)  # [n, E]: token t routed to expert e
        # per expert, the tokens up to t that chose it: a window (t, t+vt] chose it iff it grew
        seen = torch.cat([torch.zeros_like(hit[:1]), hit.cumsum(0, dtype=torch.int32)])
        sums = torch.stack([((seen[vt:] - seen[:-vt]) > 0).sum() for vt in range(1, max_vt + 1)]).tolist()
        for vt in range(1, max_vt + 1):  # [n - vt + 1] windows of vt tokens
            total[vt - 1] += sums[vt - 1]
            windows[vt - 1] += n - vt + 1
    return tuple(t / w for t, w in zip(total, windows))


def step_cost_of(model) -> StepCost | None:
    """The step cost of a loaded target: priced when it routes experts (its declared `moe`
    settings, models/base.py), None for any other target (its cost is flat in vt)."""
    moe, cfg = model.moe, model.cfg
    if moe is None:
        return None
    n_sparse = len(moe.sparse_layers)
    if moe.fixed_elements is not None:  # counted from the loaded weights (the hybrid, Gemma 4)
        size = model.dtype.itemsize
        return StepCost(moe.fixed_elements * size, 3 * cfg.hidden_size * moe.moe_intermediate_size * size, n_sparse,
                        max(moe.num_experts, 1), max(moe.top_k, 1))
    return qwen3_moe_cost(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                          kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                          num_experts=moe.num_experts, top_k=moe.top_k, moe_intermediate=moe.moe_intermediate_size,
                          dense_intermediate=cfg.intermediate_size, dense_layers=cfg.num_hidden_layers - n_sparse,
                          dtype_bytes=model.dtype.itemsize)
