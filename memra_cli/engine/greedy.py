"""The plain references: the streams every speculative arm must reproduce token for token.

Deliberately naive (prefill, then one token per step through the state) so they are obviously
right; they share only the runner's `prefill` / `step` and the selection (argmax, or a sampler's
`select`) with the speculative path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.sampling import GREEDY


def greedy_reference(runner, prompt_ids: Sequence[int], max_new: int,
                     eos_ids: Sequence[int] = ()) -> list[int]:
    """Greedy-decode up to `max_new` tokens after `prompt_ids` through a `StepRunner` (or a bare
    model, which then runs each step at its own width).

    Stops after the first token in `eos_ids` (which is included in the output) or after exactly
    `max_new` tokens. Raises PromptError for an empty / out-of-vocabulary / too-long request.
    """
    return sampled_reference(runner, prompt_ids, max_new, GREEDY, eos_ids)


def sampled_reference(runner, prompt_ids: Sequence[int], max_new: int, sampler,
                      eos_ids: Sequence[int] = ()) -> list[int]:
    """Plain decoding with `sampler.select(logits, positions)` choosing each token: the token
    after the row at position j is selected with `positions = [j]` (the prefill's last row is at
    len(prompt) - 1). With the position-keyed sampler this is plain seeded sampling."""
    if not isinstance(runner, StepRunner):
        runner = StepRunner(runner)
    prompt = list(prompt_ids)
    runner.check_prompt(prompt, max_new)
    if max_new == 0:
        return []
    eos = set(eos_ids)
    state = runner.new_state(len(prompt) + max_new)
    dev = runner.model.device
    try:
        logits, _ = runner.prefill(torch.tensor(prompt, dtype=torch.long, device=dev), state)
        out: list[int] = []
        while True:
            row = state.length - 1
            token = sampler.select(logits, torch.tensor([row], device=dev))  # [1]
            out.append(int(token))
            if out[-1] in eos or len(out) == max_new:
                return out
            logits, _ = runner.step(token, state.length, state)
    finally:
        runner.release(state)
