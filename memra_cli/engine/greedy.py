"""The plain-greedy reference: the stream every speculative arm must reproduce token for token.

Deliberately naive (prefill, then one token per forward through the cache) so it is obviously
right; it shares only `Qwen3Target.forward` / `argmax` with the speculative path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.models.qwen3 import Qwen3Target


def greedy_reference(target: Qwen3Target, prompt_ids: Sequence[int], max_new: int,
                     eos_ids: Sequence[int] = ()) -> list[int]:
    """Greedy-decode up to `max_new` tokens after `prompt_ids`.

    Stops after the first token in `eos_ids` (which is included in the output) or after exactly
    `max_new` tokens. Raises PromptError for an empty / out-of-vocabulary / too-long request.
    """
    prompt = list(prompt_ids)
    target.check_prompt(prompt, max_new)
    if max_new == 0:
        return []
    eos = set(eos_ids)
    cache = target.new_cache(len(prompt) + max_new)
    ids = torch.tensor(prompt, dtype=torch.long, device=target.device)
    token, _ = target.prefill(ids, cache)  # [1]
    out: list[int] = []
    while True:
        out.append(int(token))  # host sync per token: fine for a reference
        if out[-1] in eos or len(out) == max_new:
            cache.release()
            return out
        token, _ = target.verify(token, cache.length, cache)
