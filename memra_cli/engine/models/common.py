"""What every target family shares: shape facts read from its config, and the checks of taps and
step spans. Families subclass `TargetBase`; the protocol they satisfy is in `base.py`."""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.errors import ConfigError, PromptError


def batch_taps(tapped: dict[int, torch.Tensor], taps: Sequence[int], B: int, L: int, device: torch.device,
               lengths: Sequence[int] | None) -> torch.Tensor:
    """A batched pass's taps: `tapped[i]` `[B*L, hidden]` per tap id -> `[B, L, len(taps)*hidden]`
    on `device`, in `taps` order, rows past `lengths[b]` (padding) zeroed."""
    out = torch.cat([tapped[i] for i in taps], dim=-1).view(B, L, -1).to(device)
    for b, n in enumerate(lengths or ()):
        out[b, int(n):] = 0
    return out


class TargetBase:
    """What every target family shares: its shape facts from `cfg` and the checks of taps and
    step spans. A family sets `cfg` and `_lm_head` (`[vocab, hidden]`, the embedding when tied)."""

    cfg: object
    _lm_head: torch.Tensor
    # Declared capabilities (models/base.py `TargetModel`), off until a family opts in; the state
    # class is checked at load (`check_family`).
    supports_cuda_graphs = False
    graphs_note = "this target's steps are not capturable"
    state_class: type | None = None
    # what of the step-op seam the family runs, when not all of it (said in the engine's note)
    step_ops_used: str | None = None
    # a family that routes experts sets its MoE settings here (the priced verify window reads them)
    moe = None
    # what the family multiplies its embedding rows by before the first layer (Gemma: √hidden);
    # a z-lab drafter's block embedding may apply it (the `emb_scale` setting, spec/policy.py)
    embed_scale: float = 1.0
    # whether `forward_taps` runs a batch's sequences through each layer together (a family whose
    # layers take rows of several sequences at once overrides it); else one sequence at a time
    batched_taps = False
    batched_taps_limit: str | None = None  # where a batched family still runs one sequence at a time

    @property
    def n_layers(self) -> int:
        return self.cfg.num_hidden_layers  # type: ignore[attr-defined]

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size  # type: ignore[attr-defined]

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size  # type: ignore[attr-defined]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[vocab, hidden]` in the model dtype (the drafter projects its rows through it)."""
        return self._lm_head

    def padding_rows_limit(self, state) -> int | None:
        """The most padding rows (positions past the live ones, written and never read) one write
        may add over `state` without overwriting a key a later row reads, or None: no limit (a
        plain storage keeps every position). A graphed prefill's bucket pads past it only as far."""
        return None

    @torch.no_grad()
    def forward_taps(self, ids: torch.Tensor, taps: Sequence[int],
                     lengths: Sequence[int] | None = None) -> torch.Tensor:
        """Taps of fresh sequences (positions from 0, no cache kept): ids `[B, L]` -> `[B, L,
        len(taps)*hidden]` in the model dtype, on the ids' device, tap `i` in `taps` order; rows
        past `lengths[b]` (padding) are zero. Here each sequence runs `forward` on a state of its
        own length; a causal target's padding never changes an earlier position's taps."""
        self.check_tap_batch(ids, taps)
        B, L = ids.shape
        out = torch.zeros(B, L, len(taps) * self.hidden_size, dtype=self.dtype, device=ids.device)  # type: ignore[attr-defined]
        for b in range(B):
            n = L if lengths is None else int(lengths[b])
            state = self.new_state(n)  # type: ignore[attr-defined]
            _, t = self.forward(ids[b, :n].to(self.device), 0, state, taps=list(taps))  # type: ignore[attr-defined]
            out[b, :n] = t.to(ids.device)
        return out

    def check_tap_batch(self, ids: torch.Tensor, taps: Sequence[int]) -> None:
        """`forward_taps`' arguments: ids `[B, L]` with B, L >= 1, and at least one valid tap."""
        if ids.dim() != 2 or 0 in ids.shape:
            raise PromptError(f"forward_taps needs ids [B, L] with B, L >= 1, got shape {list(ids.shape)}")
        if not taps:
            raise ConfigError("forward_taps needs at least one tap layer id")
        self.check_taps(taps)

    def check_taps(self, taps: Sequence[int]) -> None:
        """Tap ids must be -1 (embedding) or a layer index of this target."""
        for tap in taps:
            if isinstance(tap, bool) or not isinstance(tap, int) or not -1 <= tap < self.n_layers:
                raise ConfigError(
                    f"tap layer id {tap!r} (in target_layer_ids {list(taps)}) is outside "
                    f"[-1, {self.n_layers - 1}] for the {self.n_layers}-layer target {self.cfg.source}"  # type: ignore[attr-defined]
                )

    def check_span(self, start: int, t: int, state) -> None:
        """Refuse a step that would leave a gap before `start` or run past the storage."""
        if t < 1:
            raise PromptError("forward needs at least one token id")
        if not 0 <= start <= state.length:
            # a gap would read stale rows: only re-writing or appending is meaningful
            raise ValueError(f"start {start} is past the cache length {state.length}")
        if start + t > state.max_len:
            raise PromptError(
                f"positions up to {start + t} exceed the KV cache ({state.max_len} positions); "
                "allocate a longer cache for this prompt + max_new"
            )
