"""Where a drafter's training gets the target's taps and token tables from.

Two sources with one shape: `EngineTaps` runs the target through memra's own engine (any family
the model registry loads, `forward(..., taps=...)`), `HFTaps` through a transformers model (the
embedded build's target, batched: its drafters train on the build's data step through the same
TrainJob as `memra train`). Both give taps `[B, L, n_taps*hidden]` in the
target's dtype: tap `i` is layer `i`'s raw output, `-1` the embedding output.
"""

from __future__ import annotations

from typing import Sequence

import torch


class HFTaps:
    """A transformers causal LM (frozen) as a tap source."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.embed_weight = model.get_input_embeddings().weight
        self.head_weight = model.get_output_embeddings().weight
        self.logit_softcap = getattr(model.config, "final_logit_softcapping", None)

    def tap_batch(self, ids: torch.Tensor, taps: Sequence[int], lengths: Sequence[int] | None = None) -> torch.Tensor:
        """ids `[B, L]` -> taps `[B, L, n_taps*hidden]`, the whole batch in one forward (a causal
        target: padding at the end never changes an earlier position's taps, so `lengths` is
        not needed)."""
        return hf_taps(self.model, ids, tuple(taps))


class EngineTaps:
    """A memra engine target (`engine/models/base.py` TargetModel) as a tap source: the batch
    through the target's `forward_taps` (its rows in each layer together where the family says
    `batched_taps`, else one sequence at a time)."""

    def __init__(self, target):
        self.target = target
        self.embed_weight = target.embed_weight
        self.head_weight = target.lm_head_weight
        # Gemma's cap on its logits: the drafter's logits at inference go through the target's lm_head
        self.logit_softcap = getattr(target.cfg, "final_logit_softcapping", None)

    def tap_batch(self, ids: torch.Tensor, taps: Sequence[int], lengths: Sequence[int] | None = None) -> torch.Tensor:
        """ids `[B, L]` -> taps `[B, L, n_taps*hidden]`; rows past `lengths[i]` (padding) are zero
        (a causal target: padding never changes an earlier position's taps)."""
        return self.target.forward_taps(ids, taps, lengths)


def as_tap_source(target):
    """A tap source from either kind of target (a transformers model is wrapped)."""
    return target if hasattr(target, "tap_batch") else HFTaps(target)


@torch.no_grad()
def hf_taps(model, ids: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    """`[B, L, n_taps*hidden]` raw layer outputs (-1 = embedding output), model dtype."""
    # the decoder stack only (`model.model`): the taps never need the lm_head's `[B, L, V]` logits
    hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    # transformers replaces the last entry with the final-normed state: taps never use it here
    assert max(taps) < len(hs) - 2, "a tap on the last target layer needs the raw (pre-norm) state"
    return torch.cat([hs[t + 1] for t in taps], dim=-1)


