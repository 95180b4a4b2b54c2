"""The sampler seam: how a step's logits become tokens, and which drafts a verify accepts.

The target's step returns float32 logits; a `Sampler` selects one token per row. The round loop
then accepts the longest prefix of drafts that equal the target's own selections at their
positions and commits the target's selection at the first mismatch (`accept_prefix`). That rule
is lossless for any sampler whose selection at a position is a deterministic function of that
position's logits (and, for a seeded sampler, of the seed and the position): the committed
stream is then exactly the plain stream. Greedy (argmax) is here; temperature sampling (the
position-keyed sampler, and opt-in rejection sampling) is in `keyed.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:  # torch loads where a sampler runs: the bench's arm grammar needs none of it
    import torch

ACCEPTANCE_RULES = ("keyed", "rejection")  # position-keyed (default) | rejection sampling


class Sampler(Protocol):
    name: str  # said in receipts / --json

    def select(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 logits `[t, vocab]` of rows at absolute `positions [t]` -> tokens `[t]` (long,
        on the device, no host sync)."""
        ...


class Greedy:
    """Argmax per row; ties go to the lowest id (torch.argmax)."""

    name = "greedy"
    acceptance = "a draft is kept while it equals the target's argmax at its position"

    def select(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


GREEDY = Greedy()


def accept_prefix(cand: Sequence[int], vam: Sequence[int], vt: int) -> int:
    """Accepted drafts: `cand[0]` is the anchor, `cand[1:]` the drafts, `vam[j]` the target's
    selection (greedy: argmax) for anchor+j+1. Returns m; `cand[1..=m]` commit and `vam[m]` is the next anchor."""
    m = 0
    while m < vt - 1 and cand[m + 1] == vam[m]:
        m += 1
    return m
