"""The drafter's greedy markov chain, the one torch body (no triton): the twin `markov.py`'s
`markov_chain` is tested against, and the engine's `TorchStepOps.markov_chain` (which feeds the
same loop a slot's bias from its table where one is built)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def markov_bias_ref(w1: torch.Tensor, w2: torch.Tensor, prev: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The chain's bias after token `prev [1]`: float32 `[1, V]` = `linear(w1[prev], w2)` in `dtype`."""
    return torch.nn.functional.linear(w1[prev].to(dtype), w2.to(dtype)).float()


def markov_chain_body(logits: torch.Tensor, anchor: torch.Tensor,
                      bias_after: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Greedy chain over `logits [n, V]` -> int64 tokens `[n]`: slot k takes
    `argmax(logits[k] + bias_after(prev))` (`[1, V]` float32), prev starting at `anchor`."""
    prev = anchor.reshape(1)
    out = []
    for k in range(logits.shape[0]):
        prev = torch.argmax(logits[k : k + 1] + bias_after(prev), dim=-1)
        out.append(prev)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=logits.device)


def markov_chain_ref(logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """Plain torch twin of `markov_chain`: each slot's bias by its own GEMV in `dtype`."""
    return markov_chain_body(logits, anchor, lambda prev: markov_bias_ref(w1, w2, prev, dtype))
