"""Qwen3.5 hybrid target config.json -> a frozen `Qwen35Config`, with validation.

Two layouts, both read (text model only):

- the published multimodal one: top-level `model_type: qwen3_5` (`Qwen3_5ForConditionalGeneration`)
  with the language model's keys under `text_config`; `tie_word_embeddings` is read at the top
  level (the class the file names ties by it), falling back to `text_config`'s;
- the text-only one transformers writes for `Qwen3_5ForCausalLM`: top-level
  `model_type: qwen3_5_text`.

The mixture-of-experts hybrid (`qwen3_5_moe` with `text_config`, or `qwen3_5_moe_text`) has the
same two layouts and the same keys, plus its experts (`Qwen35MoeKeys`, as
`transformers.Qwen3_5MoeTextConfig`: every layer routes; no dense `intermediate_size`).

Semantics follow `transformers.Qwen3_5TextConfig`:

- `layer_types` (`linear_attention` | `full_attention`, one per layer), else the interval rule
  `linear_attention if (i + 1) % full_attention_interval else full_attention`. Transformers falls
  back to an interval of 4 when both keys are absent; we refuse instead (a guessed layer layout
  would load the wrong tensors or mis-shape the state), naming the file and key;
- `partial_rotary_factor`: `rope_parameters.partial_rotary_factor`, else the top-level key, else
  0.25 (transformers' default); rotary on the first `int(head_dim * factor)` dims;
- `rope_parameters.mrope_section` / `mrope_interleaved` are recorded only: with text-only
  positions the three M-RoPE position rows are equal, so every section reads the same
  frequencies and M-RoPE is plain 1-D rope over the rotary dims;
- defaults where transformers has one that cannot silently mis-shape a tensor (the checkpoint's
  shapes are checked against the config before loading): `head_dim` 256, `rms_norm_eps` 1e-6,
  `max_position_embeddings` 32768, `linear_conv_kernel_dim` 4, `hidden_act` silu,
  `attention_bias` / `tie_word_embeddings` false. Head counts and dims are required.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memra_cli.engine.formats.config import RopeConfig, _Fields, parse_rope, read_json_object
from memra_cli.engine.errors import CheckpointError, ConfigError, UnsupportedError

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)
MULTIMODAL_TYPE, TEXT_TYPE = "qwen3_5", "qwen3_5_text"
MOE_MULTIMODAL_TYPE, MOE_TEXT_TYPE = "qwen3_5_moe", "qwen3_5_moe_text"
# the multimodal model type -> its text model's; the text-only types are the values
TEXT_TYPES = {MULTIMODAL_TYPE: TEXT_TYPE, MOE_MULTIMODAL_TYPE: MOE_TEXT_TYPE}
MODEL_TYPES = (MULTIMODAL_TYPE, TEXT_TYPE, MOE_MULTIMODAL_TYPE, MOE_TEXT_TYPE)
MOE_TYPES = (MOE_MULTIMODAL_TYPE, MOE_TEXT_TYPE)
# where a checkpoint keeps the text model's tensors: the published multimodal layout, then the
# text-only one; and what a text target recognizes and skips (vision tower, multi-token-prediction head)
TEXT_PREFIXES = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' Qwen3_5TextConfig default


@dataclass(frozen=True)
class Qwen35MoeKeys:
    """The mixture-of-experts feed-forward of a `qwen3_5_moe` text model (every layer routes):
    `num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` per token, and a
    shared SwiGLU expert of `shared_expert_intermediate_size` gated by `sigmoid(x @ gate.T)`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


@dataclass(frozen=True)
class Qwen35Config:
    """The text model of a Qwen3.5 hybrid (Gated DeltaNet / gated attention) checkpoint: dense
    (`moe` None) or with a routed feed-forward on every layer (`moe`)."""

    source: str
    layout: str  # "multimodal" (model_type qwen3_5, text_config) | "text" (model_type qwen3_5_text)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    layer_types_from: str  # "layer_types" | "full_attention_interval=N"
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    partial_rotary_factor: float
    rope: RopeConfig
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool | None
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # the rest
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str | None
    moe: Qwen35MoeKeys | None = None  # the qwen3_5_moe types only (intermediate_size is then 0: no dense MLP)

    # ---------------------------------------------------------------- derived shapes

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rope rotates (transformers: `int(head_dim * factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: q, k and v (`2*key_dim + value_dim`)."""
        return 2 * self.key_dim + self.value_dim


def _eos_ids(raw: dict[str, Any], source: str, prefix: str) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        return tuple(eos)
    raise ConfigError(
        f"{source}: key '{prefix}eos_token_id' must be an integer or a list of integers, got {json.dumps(eos)}"
    )


def _layer_types(f: _Fields, n_layers: int) -> tuple[tuple[str, ...], str]:
    types = f.str_list("layer_types", LAYER_TYPES)
    if types is not None:
        if len(types) != n_layers:
            raise ConfigError(
                f"{f.source}: key '{f.prefix}layer_types' has {len(types)} entries for "
                f"num_hidden_layers {n_layers}"
            )
        return types, "layer_types"
    interval = f.int("full_attention_interval", default=None)
    if interval is None:
        raise ConfigError(
            f"{f.source}: required key '{f.prefix}layer_types' is missing (and no "
            f"'{f.prefix}full_attention_interval' to derive it from): which layers are "
            f"{LINEAR} and which {FULL} cannot be guessed"
        )
    types = tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))
    return types, f"full_attention_interval={interval}"


def _moe_keys(f: _Fields) -> Qwen35MoeKeys:
    """The MoE keys of a qwen3_5_moe text config. transformers' Qwen3_5MoeTextConfig routes every
    layer and always renormalises the top k, so keys that would ask otherwise are refused."""
    experts, top_k = f.int("num_experts"), f.int("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"{f.source}: {f.prefix}num_experts_per_tok {top_k} is more than "
                          f"{f.prefix}num_experts {experts}")
    if f.bool("norm_topk_prob", default=True) is False:
        raise UnsupportedError(f"{f.source}: {f.prefix}norm_topk_prob=false is not how Qwen3.5-MoE routes "
                               "(its top-k weights are always renormalised)")
    if f.int("decoder_sparse_step", default=1) != 1 or f.raw.get("mlp_only_layers") not in (None, []):
        raise UnsupportedError(f"{f.source}: {f.prefix}decoder_sparse_step / {f.prefix}mlp_only_layers: every "
                               "Qwen3.5-MoE layer is sparse (expected 1 and [] or absent)")
    return Qwen35MoeKeys(experts, top_k, f.int("moe_intermediate_size"), f.int("shared_expert_intermediate_size"))


def _text_fields(top: _Fields, model_type: str, source: str) -> tuple[_Fields, str, bool, dict, str]:
    """The text model's fields of either layout: (fields, layout, tie_word_embeddings, the object
    eos_token_id is read from, its key prefix)."""
    if model_type not in TEXT_TYPES:
        return top, "text", top.bool("tie_word_embeddings", default=False), top.raw, ""
    f = top.obj("text_config")
    if f is None:
        raise ConfigError(
            f"{source}: required key 'text_config' is missing (model_type {model_type} keeps "
            "the language model's config there)"
        )
    inner = f.str("model_type", default=TEXT_TYPES[model_type])
    if inner != TEXT_TYPES[model_type]:
        raise UnsupportedError(
            f"{source}: text_config.model_type {inner!r} is not {TEXT_TYPES[model_type]!r} (the text model "
            f"of model_type {model_type})"
        )
    # the ConditionalGeneration class ties by the top-level flag; refuse two that disagree
    tie_top = top.bool("tie_word_embeddings", default=None)
    tie_text = f.bool("tie_word_embeddings", default=None)
    if tie_top is not None and tie_text is not None and tie_top != tie_text:
        raise ConfigError(
            f"{source}: 'tie_word_embeddings' ({json.dumps(tie_top)}) and "
            f"'text_config.tie_word_embeddings' ({json.dumps(tie_text)}) disagree"
        )
    tie = tie_top if tie_top is not None else bool(tie_text)
    eos_raw, eos_prefix = (f.raw, f.prefix) if f.has("eos_token_id") else (top.raw, "")
    return f, "multimodal", tie, eos_raw, eos_prefix


def parse_qwen35_config(raw: dict[str, Any], source: str) -> Qwen35Config:
    """Normalize a Qwen3.5 config.json (already parsed), either layout, dense or MoE."""
    top = _Fields(raw, source)
    model_type = top.str("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedError(
            f"{source}: model_type {model_type!r} is not a Qwen3.5 hybrid target "
            f"(supported: {', '.join(MODEL_TYPES)})"
        )
    f, layout, tie, eos_raw, eos_prefix = _text_fields(top, model_type, source)
    moe = _moe_keys(f) if model_type in MOE_TYPES else None

    hidden_act = f.str("hidden_act", default="silu")
    if hidden_act != "silu":
        raise UnsupportedError(f"{source}: {f.prefix}hidden_act={hidden_act!r} is not implemented (silu only)")
    if f.bool("attn_output_gate", default=True) is False:
        raise UnsupportedError(
            f"{source}: {f.prefix}attn_output_gate=false is not implemented (Qwen3.5 attention is gated)"
        )

    n_layers = f.int("num_hidden_layers")
    layer_types, types_from = _layer_types(f, n_layers)
    n_heads = f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads")
    if n_heads % n_kv:
        raise ConfigError(
            f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}"
        )
    n_k, n_v = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    if n_v % n_k:
        raise ConfigError(
            f"{source}: {f.prefix}linear_num_value_heads {n_v} is not a multiple of "
            f"{f.prefix}linear_num_key_heads {n_k}"
        )
    head_dim = f.int("head_dim", default=256)
    max_pos = f.int("max_position_embeddings", default=32768)

    rope = parse_rope(f, max_pos)
    params = f.obj("rope_parameters") or f.obj("rope_scaling")
    factor = None
    if params is not None:
        factor = params.float("partial_rotary_factor", default=None)
    if factor is None:
        factor = f.float("partial_rotary_factor", default=DEFAULT_PARTIAL_ROTARY)
    if factor > 1:
        raise ConfigError(f"{source}: partial_rotary_factor {factor} is above 1")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor {factor} x head_dim {head_dim} gives {rotary_dim} rotary "
            "dims (need an even number >= 2)"
        )
    mrope_section = params.int_list("mrope_section", minimum=0) if params is not None else None
    mrope_interleaved = params.bool("mrope_interleaved", default=None) if params is not None else None

    return Qwen35Config(
        source=source,
        layout=layout,
        model_type=model_type,
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        # the MoE model has no dense MLP (transformers' config has no such key)
        intermediate_size=f.int("intermediate_size") if moe is None else 0,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        layer_types_from=types_from,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        attention_bias=f.bool("attention_bias", default=False),
        partial_rotary_factor=factor,
        rope=rope,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        linear_num_key_heads=n_k,
        linear_num_value_heads=n_v,
        linear_key_head_dim=f.int("linear_key_head_dim"),
        linear_value_head_dim=f.int("linear_value_head_dim"),
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", default=4, minimum=2),
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        eos_token_ids=_eos_ids(eos_raw, source, eos_prefix),
        bos_token_id=f.int("bos_token_id", default=None, minimum=0),
        pad_token_id=f.int("pad_token_id", default=None, minimum=0),
        dtype=(f.str("dtype", default=None) or f.str("torch_dtype", default=None)
               or top.str("dtype", default=None) or top.str("torch_dtype", default=None)),
        moe=moe,
    )


def load_qwen35_config(directory: Path) -> Qwen35Config:
    """Read `directory/config.json` as a Qwen3.5 target config (either layout)."""
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory (expected an HF model directory)")
    path = directory / "config.json"
    return parse_qwen35_config(read_json_object(path), str(path))


def text_prefix(tensor_names, root: object) -> str:
    """Where a checkpoint keeps the text model's tensors (`TEXT_PREFIXES`), found by its
    embedding; `root` names the checkpoint in the refusal."""
    names = set(tensor_names)
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise CheckpointError(
        f"{root}: tensor 'model.language_model.embed_tokens.weight' (multimodal layout) or "
        "'model.embed_tokens.weight' (text-only layout) is missing"
    )
