"""What the engine needs from a target model, and the registry that picks one by `model_type`.

A model file holds math and weights only. Everything about scheduling (step width, padding,
CUDA graphs), storage (pooling, budgets) and sampling lives elsewhere (runtime/, spec/), so a
new family is one module that implements `TargetModel` and one line in `MODEL_FAMILIES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import torch

from memra_cli.engine.errors import ConfigError, UnsupportedError
from memra_cli.engine.formats.config import read_json_object
from memra_cli.engine.models.state import StateBase


class TargetState(Protocol):
    """A session's model state (KV cache; recurrent state for hybrid models). Every member here
    is read by the runtime; `StateBase` gives the optional capabilities their off defaults."""

    length: int  # committed positions
    max_len: int  # storage positions
    graphs: dict  # CUDA graphs captured over this storage (kept by the runtime)
    nbytes: int

    # capabilities (class-level, declared once per state class)
    host_bookkeeping: bool  # commit / rollback only move `length`: padding rows leave no trace
    round_graphs_ok: bool  # a commit after a whole-round graph's replay needs no host read
    settles_on_device: bool  # a round graph restores the state itself (`restore_round`)
    graph_variants: int  # buffer arrangements a fixed step runs over (one graph per arrangement)
    graphed_restores: bool  # replays graphs in its own methods, captured by `attach_graph_cache`'s cache

    @property
    def graph_variant(self) -> int: ...  # the arrangement the next fixed step runs over

    def rollback(self, n_keep: int) -> None: ...  # forget every position from n_keep on
    def reset(self) -> None: ...

    def commit(self, end: int, step_continues: bool = False) -> None:
        """After a `static_step` at `length`: keep positions up to `end` (rows past it were
        padding; `length = end`). `step_continues`: another fixed step of the same runner step
        follows at `end` (a recurrent state keeps this one's record for a rollback)."""
        ...

    def arranged_for_capture(self, variant: int):
        """Context manager: the state arranged as `variant` for a graph capture, put back after."""
        ...

    def set_live_rows(self, n: int | None) -> None:
        """Before a fixed step: only its first `n` rows are real (None: all); the rest are padding,
        which a state may skip work for (the hybrid's recurrence). A KV cache ignores it."""
        ...

    def live_rows_from(self, rows: torch.Tensor):
        """Context manager: the fixed step run (or captured) inside it reads its live-row count
        from `rows` (int32 `[1]`, written on the device by a round body) instead."""
        ...

    def reading_rows(self, n: int):
        """Context manager: the fixed step run (or captured) inside has only its first `n` rows
        read (a host int: a plain decode step's 1); the rest may be treated as padding."""
        ...

    def attach_graph_cache(self, cache) -> None:
        """(`graphed_restores` only) The runtime's `GraphCache` (runtime/cuda_graphs.py), given once
        when the runtime makes the state: its `run(key, build, *args)` replays the graph of the body
        `build(*args)` returns, capturing it the first time."""
        ...

    def restore_round(self, live: torch.Tensor | None = None) -> None:
        """Inside a round graph (`settles_on_device` only): restore the state after the round's
        kept rows, read on the device (`live`: the live rows the round's step ran with, when not
        every row)."""
        ...

    def settled_on_device(self, end: int) -> None:
        """The host's side of a round whose graph ran `restore_round`: positions up to `end` kept."""
        ...


class TargetModel(Protocol):
    """A causal LM the round loop verifies with. Tap id `i` is the raw output of layer `i`
    (residual stream, never final-normed), `-1` the embedding output."""

    cfg: object  # .source, .vocab_size, .hidden_size, .num_hidden_layers, .max_position_embeddings, .eos_token_ids
    dtype: torch.dtype
    device: torch.device
    n_layers: int
    hidden_size: int
    vocab_size: int
    embed_weight: torch.Tensor  # [vocab, hidden]
    embed_scale: float  # the family's embedding multiplier (1.0: raw rows, as Qwen3 / LLaMA)
    lm_head_weight: torch.Tensor  # [vocab, hidden]
    supports_cuda_graphs: bool  # static_step is capturable (else `graphs_note` says why not)
    graphs_note: str  # why static_step is not capturable (read only when supports_cuda_graphs is false)
    state_class: type  # what `new_state` returns: a `TargetState` (checked at load, `check_family`)
    step_ops_used: str | None  # what of the step-op seam the family runs, when not all (None: all of it)
    moe: object | None  # a family that routes experts: its MoE settings (the priced window's cost); else None
    batched_taps: bool  # forward_taps runs a batch's sequences through each layer together (else one at a time)
    step_ops: object  # layers/step_ops.py: static_step's fused ops, and a graphed round's argmax

    @classmethod
    def from_dir(cls, path: Path, dtype: torch.dtype, device: str | torch.device) -> "TargetModel": ...
    def new_state(self, rows: int) -> TargetState: ...
    def ensure_positions(self, rows: int) -> None: ...
    def check_taps(self, taps: Sequence[int]) -> None: ...
    def check_span(self, start: int, t: int, state: TargetState) -> None: ...
    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [t] -> [t, hidden]
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [t, hidden] -> f32 [t, vocab]
    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor: ...  # before widening: model dtype; `weight`: other rows

    def forward(self, ids: torch.Tensor, start: int, state: TargetState, taps: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager, any width: final-normed hidden `[t, hidden]` and taps `[t, n_taps*hidden]`;
        sets `state.length = start + t`."""
        ...

    def padding_rows_limit(self, state: TargetState) -> int | None:
        """The most padding rows one write may add over `state` (a ring's span), or None."""
        ...

    def forward_taps(self, ids: torch.Tensor, taps: Sequence[int], lengths: Sequence[int] | None = None
                     ) -> torch.Tensor:
        """Training's taps of fresh sequences: ids `[B, L]` (positions from 0) -> `[B, L,
        n_taps*hidden]`, rows past `lengths[b]` zero; no state is kept."""
        ...

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, state: TargetState,
                    taps: Sequence[int] | None = None, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fixed width, positions on the device (continuing `state.length`), graph-capturable
        where `supports_cuda_graphs`: f32 logits `[W, vocab]` (`widen=False`: the lm_head's
        model-dtype output, for an argmax that needs no float32 copy) and taps; leaves
        `state.length` alone (the rows stay pending until `state.commit`)."""
        ...


# What the runtime calls on a family class, on its state class, and the capabilities each state
# capability needs: checked once when a family is picked, never probed in the round loop.
MODEL_MEMBERS = ("from_dir", "new_state", "ensure_positions", "check_taps", "check_span", "embed", "logits",
                 "lm_head", "forward", "static_step", "supports_cuda_graphs", "graphs_note", "state_class",
                 "step_ops_used", "embed_scale", "moe", "forward_taps", "batched_taps",
                 "padding_rows_limit")
STATE_MEMBERS = ("rollback", "reset", "commit", "nbytes", "host_bookkeeping", "round_graphs_ok",
                 "settles_on_device", "graph_variants", "graph_variant", "arranged_for_capture",
                 "restore_round", "settled_on_device", "graphed_restores", "attach_graph_cache", "set_live_rows",
                 "live_rows_from", "reading_rows")
_CLAIMS = {  # a claimed capability -> the methods a state must override (not inherit from StateBase)
    "settles_on_device": ("restore_round", "settled_on_device"),
    "graph_variants": ("arranged_for_capture", "graph_variant"),
    "graphed_restores": ("attach_graph_cache",),
}


def check_family(model_type: str, family: type) -> None:
    """Refuse a family class (and its `state_class`) lacking a member the runtime uses, or claiming
    a state capability without the methods behind it: `UnsupportedError` naming both."""
    def refuse(what: str) -> None:
        raise UnsupportedError(f"model family {model_type!r} ({family.__name__}): {what}")

    missing = [m for m in MODEL_MEMBERS if not hasattr(family, m)]
    if missing:
        refuse(f"lacks {', '.join(missing)} (models/base.py TargetModel)")
    state = family.state_class
    if not isinstance(state, type):
        refuse(f"state_class must be the class new_state returns, got {state!r}")
    missing = [m for m in STATE_MEMBERS if not hasattr(state, m)]
    if missing:
        refuse(f"its state {state.__name__} lacks {', '.join(missing)} (models/base.py TargetState; "
               "StateBase gives the optional ones)")
    for claim, needs in _CLAIMS.items():
        default = getattr(StateBase, claim)
        if getattr(state, claim) != default and any(getattr(state, m) is getattr(StateBase, m, None) for m in needs):
            refuse(f"its state {state.__name__} sets {claim} but does not provide {' and '.join(needs)}")


def _qwen3():
    from memra_cli.engine.models.qwen3 import Qwen3Target

    return Qwen3Target


def _qwen3_moe():
    from memra_cli.engine.models.qwen3_moe import Qwen3MoeTarget

    return Qwen3MoeTarget


def _llama():
    from memra_cli.engine.models.llama import LlamaTarget

    return LlamaTarget


def _qwen3_5():
    from memra_cli.engine.models.qwen3_5 import Qwen35Target

    return Qwen35Target


def _qwen3_5_moe():
    from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget

    return Qwen35MoeTarget


def _gemma4():
    from memra_cli.engine.models.gemma4 import Gemma4Target

    return Gemma4Target


def _gemma4_moe():
    from memra_cli.engine.models.gemma4_moe import Gemma4MoeTarget

    return Gemma4MoeTarget


def _gemma4_moe_block(raw: dict) -> bool:
    text = raw.get("text_config") if raw.get("model_type") == "gemma4" else raw
    return isinstance(text, dict) and text.get("enable_moe_block") is True


# config.json `model_type` -> loader of the class (imported on demand: one family's deps never
# load for another's). qwen3_5 is the published multimodal layout (its text model is loaded),
# qwen3_5_text the layout transformers writes for Qwen3_5ForCausalLM; qwen3_5_moe / qwen3_5_moe_text
# the same two for the mixture-of-experts hybrid.
# gemma4 is the multimodal layout (its language model is loaded), gemma4_text Gemma4ForCausalLM's.
MODEL_FAMILIES = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "llama": _llama, "qwen3_5": _qwen3_5,
                  "qwen3_5_text": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe, "qwen3_5_moe_text": _qwen3_5_moe,
                  "gemma4": _gemma4, "gemma4_text": _gemma4}

# model types whose config.json picks a second class with other declarations (Gemma 4's MoE
# block: the step ops it takes, which the engine's step-ops note, made before any weight loads,
# names): model_type -> (does this parsed config pick it?, loader of that class)
VARIANTS = {"gemma4": (_gemma4_moe_block, _gemma4_moe), "gemma4_text": (_gemma4_moe_block, _gemma4_moe)}

# recognized model types that are refused by name (rather than as unknown)
REFUSED_FAMILIES: dict[str, str] = {}


def target_family(path: Path) -> type:
    """The model class for the target directory `path`, from its config.json `model_type`
    (no weights read): its class facts (`supports_cuda_graphs`) can shape settings first."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: target directory does not exist" if not path.exists()
                          else f"{path}: expected a target model directory (config.json + safetensors)")
    raw = read_json_object(path / "config.json")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in REFUSED_FAMILIES:
        raise UnsupportedError(f"{path / 'config.json'}: model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    family = MODEL_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"{path / 'config.json'}: model_type {model_type!r} is not a supported target "
                          f"(supported: {', '.join(sorted(MODEL_FAMILIES))})")
    picks, variant = VARIANTS.get(model_type, (None, None))
    cls = variant() if picks is not None and picks(raw) else family()
    check_family(model_type, cls)
    return cls


def load_target(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> TargetModel:
    """Load the target model directory `path`, dispatched on its config.json `model_type`."""
    return target_family(path).from_dir(Path(path), dtype=dtype, device=device)
