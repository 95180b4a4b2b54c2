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
    """Everything the round loop, the proposer and the runtime read of a sampler; `SamplerBase`
    gives the capabilities their defaults."""

    name: str  # said in receipts / --json
    acceptance: str  # the acceptance rule in words (receipts)
    greedy: bool  # selects by argmax: drafts are argmax too, and whole rounds may be graphed
    rejection: bool  # verifies with `verify` (rejection sampling); the proposer keeps the drafts' q
    params: object  # its SamplingParams (None for greedy): part of a drafter graph's key

    def select(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float32 logits `[t, vocab]` of rows at absolute `positions [t]` -> tokens `[t]` (long,
        on the device, no host sync)."""
        ...

    def drafting(self, positions: torch.Tensor, vocab: int):
        """(not greedy) How the drafts at `positions [n]` are picked: spec/keyed.py `Drafting`."""
        ...

    def verify(self, logits: torch.Tensor, cand: torch.Tensor, q: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """(rejection only) The round's kept tokens from the target's logits and the drafts' q."""
        ...


class SamplerBase:
    """Defaults for a sampler's capabilities: not greedy, no rejection, no params; a sampler opts
    in to `greedy` or `rejection` by overriding it (with `drafting` / `verify` behind it)."""

    greedy = False
    rejection = False
    params = None

    def drafting(self, positions: torch.Tensor, vocab: int):
        raise NotImplementedError(f"{type(self).__name__} does not draft by its own noise")

    def verify(self, logits: torch.Tensor, cand: torch.Tensor, q: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is not a rejection sampler")


class Greedy(SamplerBase):
    """Argmax per row; ties go to the lowest id (torch.argmax; numpy's on the CPU, the same picks:
    layers/torch_step_ops.py `argmax_rows`)."""

    name = "greedy"
    greedy = True
    acceptance = "a draft is kept while it equals the target's argmax at its position"

    def select(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from memra_cli.engine.layers.torch_step_ops import argmax_rows  # here: this module loads without torch

        return argmax_rows(logits)


GREEDY = Greedy()


def accept_prefix(cand: Sequence[int], selected: Sequence[int], rows: int) -> int:
    """Accepted drafts of a verify over `rows` rows: `cand[0]` is the anchor, `cand[1:]` the
    drafts, `selected[j]` the target's selection (greedy: argmax) for anchor+j+1. Returns m;
    `cand[1..=m]` commit and `selected[m]` is the next anchor."""
    m = 0
    while m < rows - 1 and cand[m + 1] == selected[m]:
        m += 1
    return m
