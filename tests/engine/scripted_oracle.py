"""`ScriptedOracle`: a proposer that knows the target's greedy continuation and drafts it, wrong
at the draft slots a schedule names, so a round loop's partial acceptance is driven on purpose
(test_gemma4.py, test_qwen3_5.py)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from memra_cli.engine.spec.proposer import Proposal


class ScriptedOracle:
    """`truth` the greedy stream past the prompt's first token; `wrong(round) -> set of draft
    slots` to corrupt (by +1 mod `vocab`). Records the taps it is fed (`taps`, one `[n, ...]`
    tensor an ingest) and checks that they arrive at contiguous positions."""

    def __init__(self, truth: Sequence[int], prompt_len: int, n_drafts: int,
                 wrong: Callable[[int], set[int]], vocab: int):
        self.truth, self.p, self.nd, self.wrong, self.vocab = truth, prompt_len, n_drafts, wrong, vocab
        self.round = self.ingested = 0
        self.taps: list[torch.Tensor] = []

    def reset(self, capacity: int) -> None:
        self.round = self.ingested = 0

    def release(self) -> None:
        pass

    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        assert torch.equal(positions, torch.arange(self.ingested, self.ingested + taps.shape[0]))
        self.ingested += taps.shape[0]
        self.taps.append(taps)

    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal:
        i = start - self.p
        assert int(last) == self.truth[i]
        drafts = [self.truth[j] if j < len(self.truth) else 0 for j in range(i + 1, i + 1 + self.nd)]
        for slot in self.wrong(self.round):
            drafts[slot] = (drafts[slot] + 1) % self.vocab
        self.round += 1
        return Proposal(torch.tensor(drafts))


def moving_wrong_slot(round_: int) -> set[int]:
    """A schedule for 7 drafts: one wrong slot that moves round to round, and every so often none,
    so the rounds accept every count from 0 to 7."""
    slot = (3 * round_ + 1) % 9
    return {slot} if slot < 7 else set()
