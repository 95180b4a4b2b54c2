"""Gemma 4 target config.json -> a frozen `Gemma4Config`, with validation; and DeepSpec's Gemma 4
DSpark drafter config.json -> a `DraftConfig` (`parse_gemma4_draft_config`, at the end).

Two file layouts (text model only):

- the text-only one transformers writes for `Gemma4ForCausalLM`: `model_type: gemma4_text`;
- the published multimodal one: `model_type: gemma4` (`Gemma4ForConditionalGeneration`) with the
  language model's keys under `text_config` (vision / audio towers are skipped at load).

and two ways of giving the full-attention layers their own head shape, both read:

- the published keys `global_head_dim` / `num_global_key_value_heads` (transformers applies the
  second only when `attention_k_eq_v` is true; an absent `global_head_dim` means 512, its default,
  recorded in `notes`);
- `per_layer_config` (`{"<layer>": {"head_dim": .., "num_key_value_heads": ..}}`), the form
  newer transformers writes; when present the published keys are ignored, as transformers does.

Semantics follow `transformers.Gemma4TextConfig` (5.25): `layer_types` default to five sliding
layers then one full, `rope_parameters` keyed by layer type (`default` or `proportional`),
`kv_sharing_modes` for the last `num_kv_shared_layers` layers. What would change the math in a
way not implemented is refused by name (bidirectional attention, rope types other than default /
proportional, attention biases). `enable_moe_block` reads `num_experts`, `top_k_experts` and
`moe_intermediate_size` (`Gemma4Moe`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memra_cli.engine.errors import ConfigError, UnsupportedError
from memra_cli.engine.formats.config import (
    DraftConfig, Gemma4DraftFacts, RopeConfig, _Fields, drafting_keys, read_json_object,
)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
MULTIMODAL_TYPE, TEXT_TYPE = "gemma4", "gemma4_text"
MODEL_TYPES = (MULTIMODAL_TYPE, TEXT_TYPE)
ROPE_TYPES = ("default", "proportional")
DEFAULT_PATTERN = 6  # transformers: every 6th layer full, the rest sliding, when layer_types is absent
DEFAULT_GLOBAL_HEAD_DIM = 512  # transformers' default when `global_head_dim` is absent
DEFAULT_ROPE = {  # transformers' rope_parameters when absent
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class Gemma4Rope:
    """One layer type's rope: `default` (every dim pair rotates) or `proportional` (the first
    `int(partial_rotary_factor * head_dim // 2)` frequencies over the full head_dim, the rest 0)."""

    type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4Moe:
    """`enable_moe_block`: every layer runs `num_experts` GELU-tanh GLU experts of
    `moe_intermediate_size` (`top_k_experts` per token) beside its dense MLP."""

    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int


@dataclass(frozen=True)
class Gemma4Config:
    """The text model of a Gemma 4 checkpoint (`moe`: its MoE block, None when dense)."""

    source: str
    layout: str  # "text" (gemma4_text) | "multimodal" (gemma4, text_config)
    head_layout: str  # "global_head_dim" | "per_layer_config"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    rope: dict  # layer type -> Gemma4Rope
    attention_k_eq_v: bool
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int  # 0: no per-layer inputs
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str | None
    notes: tuple[str, ...]  # defaults applied, said in the load receipt
    moe: Gemma4Moe | None = None

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def kv_source(self) -> tuple[int, ...]:
        """Per layer, the layer whose K/V it attends over: itself, or for a KV-shared layer the
        last non-shared layer of its type (transformers' `kv_sharing_modes` 'store' layer)."""
        first = self.first_shared_layer
        out = []
        for i, kind in enumerate(self.layer_types):
            if i < first:
                out.append(i)
            else:
                out.append(max(j for j in range(first) if self.layer_types[j] == kind))
        return tuple(out)

    def intermediate(self, layer: int) -> int:
        """MLP width of `layer` (doubled on KV-shared layers when `use_double_wide_mlp`)."""
        wide = self.use_double_wide_mlp and layer >= self.first_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def k_eq_v(self, layer: int) -> bool:
        """Full layers with `attention_k_eq_v` take V from the key projection (no v_proj)."""
        return self.attention_k_eq_v and self.layer_types[layer] == FULL


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        return tuple(eos)
    raise ConfigError(f"{f.source}: key '{f.prefix}eos_token_id' must be an integer or a list of integers, "
                      f"got {json.dumps(eos)}")


def _layer_types(f: _Fields, n_layers: int, notes: list[str]) -> tuple[str, ...]:
    raw = f.raw.get("layer_types")
    if raw is None:
        notes.append(f"layer_types absent: every {DEFAULT_PATTERN}th layer full, the rest sliding "
                     "(transformers' default)")
        types = [SLIDING if (i + 1) % DEFAULT_PATTERN else FULL for i in range(n_layers)]
        types[-1] = FULL
        return tuple(types)
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise ConfigError(f"{f.source}: key '{f.prefix}layer_types' must be a list of strings, got {json.dumps(raw)}")
    for v in raw:
        if v not in LAYER_TYPES:
            raise UnsupportedError(f"{f.source}: {f.prefix}layer_types has {v!r}, a layer type Gemma 4 does not "
                                   f"have (expected {' or '.join(LAYER_TYPES)})")
    if len(raw) != n_layers:
        raise ConfigError(f"{f.source}: key '{f.prefix}layer_types' has {len(raw)} entries for "
                          f"num_hidden_layers {n_layers}")
    if raw[-1] != FULL:  # transformers rewrites it (with a warning); a file it wrote never has this
        raise ConfigError(f"{f.source}: {f.prefix}layer_types ends with {raw[-1]!r}; Gemma 4's last layer is {FULL!r}")
    return tuple(raw)


def _rope(f: _Fields, layer_types: tuple[str, ...], notes: list[str]) -> dict:
    params = f.obj("rope_parameters")
    if params is None:
        notes.append("rope_parameters absent: transformers' defaults (sliding: default, theta 1e4; "
                      "full: proportional 0.25, theta 1e6)")
        params = _Fields(DEFAULT_ROPE, f.source, f.prefix + "rope_parameters.")
    out = {}
    for kind in sorted(set(layer_types)):
        p = params.obj(kind)
        if p is None:
            raise ConfigError(f"{f.source}: required key '{params.prefix}{kind}' is missing "
                              "(each layer type has its rope)")
        rtype = p.str("rope_type", default="default")
        if rtype not in ROPE_TYPES:
            raise UnsupportedError(f"{f.source}: {p.prefix}rope_type={rtype!r} is not implemented for Gemma 4 "
                                   f"(supported: {', '.join(ROPE_TYPES)})")
        partial = p.float("partial_rotary_factor", default=1.0) if rtype == "proportional" else 1.0
        if partial > 1:
            raise ConfigError(f"{f.source}: {p.prefix}partial_rotary_factor {partial} is above 1")
        factor = p.float("factor", default=1.0) if rtype == "proportional" else 1.0
        out[kind] = Gemma4Rope(rtype, p.float("rope_theta"), partial, factor)
    return out


def _head_shapes(f: _Fields, layer_types, head_dim: int, n_kv: int, k_eq_v: bool,
                 notes: list[str]) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Per-layer (head_dims, kv_heads) and which layout gave them."""
    dims, kvs = [head_dim] * len(layer_types), [n_kv] * len(layer_types)
    per_layer = f.obj("per_layer_config")
    if per_layer is not None:
        for key, value in per_layer.raw.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < len(layer_types)):
                raise ConfigError(f"{f.source}: key '{per_layer.prefix}{key}' is not a layer index below "
                                  f"{len(layer_types)}")
            entry = per_layer.obj(key)
            unknown = sorted(set(entry.raw) - set(PER_LAYER_KEYS))
            if unknown:
                raise UnsupportedError(f"{f.source}: {entry.prefix}{unknown[0]} is a per-layer override memra does not "
                                       f"implement (supported: {', '.join(PER_LAYER_KEYS)})")
            dims[int(key)] = entry.int("head_dim", default=head_dim)
            kvs[int(key)] = entry.int("num_key_value_heads", default=n_kv)
        return tuple(dims), tuple(kvs), "per_layer_config"
    global_dim = f.int("global_head_dim", default=None)
    if global_dim is None:
        global_dim = DEFAULT_GLOBAL_HEAD_DIM
        notes.append(f"global_head_dim absent: {DEFAULT_GLOBAL_HEAD_DIM} (transformers' default)")
    global_kv = f.int("num_global_key_value_heads", default=None) if k_eq_v else None
    for i, kind in enumerate(layer_types):
        if kind == FULL:
            dims[i] = global_dim
            kvs[i] = global_kv or n_kv
    return tuple(dims), tuple(kvs), "global_head_dim"


def _ple_width(f: _Fields) -> int:
    """`hidden_size_per_layer_input`: absent means transformers' default 256; an explicit null (which
    some exports of the large variants write, and transformers 5.25's strict config rejects) means
    none, as the modeling code's truth test of the value reads it."""
    if "hidden_size_per_layer_input" in f.raw and f.raw["hidden_size_per_layer_input"] is None:
        return 0
    return f.int("hidden_size_per_layer_input", default=256, minimum=0)


def _moe(f: _Fields) -> Gemma4Moe | None:
    """The MoE block's keys when `enable_moe_block` is set (every layer then has one), else None."""
    if not f.bool("enable_moe_block", default=False):
        return None
    experts, top_k = f.int("num_experts"), f.int("top_k_experts")
    if top_k > experts:
        raise ConfigError(f"{f.source}: {f.prefix}top_k_experts {top_k} is more than {f.prefix}num_experts {experts}")
    return Gemma4Moe(experts, top_k, f.int("moe_intermediate_size"))


def _refusals(f: _Fields) -> None:
    act = f.str("hidden_activation", default="gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedError(f"{f.source}: {f.prefix}hidden_activation={act!r} is not implemented "
                               "(gelu_pytorch_tanh only)")
    if f.bool("attention_bias", default=False):
        raise UnsupportedError(f"{f.source}: {f.prefix}attention_bias=true is not implemented for Gemma 4")
    if f.str("use_bidirectional_attention", default=None) == "all":
        raise UnsupportedError(f"{f.source}: {f.prefix}use_bidirectional_attention='all' is not a causal LM "
                               "(only causal text attention is implemented)")


def _text_fields(top: _Fields, source: str) -> tuple[_Fields, str, bool]:
    """The language model's fields, the layout, and tie_word_embeddings."""
    model_type = top.str("model_type")
    if model_type not in MODEL_TYPES:
        raise UnsupportedError(f"{source}: model_type {model_type!r} is not a Gemma 4 target "
                               f"(supported: {', '.join(MODEL_TYPES)})")
    if model_type == TEXT_TYPE:
        return top, "text", top.bool("tie_word_embeddings", default=True)
    f = top.obj("text_config")
    if f is None:
        raise ConfigError(f"{source}: required key 'text_config' is missing (model_type {MULTIMODAL_TYPE} keeps the "
                          "language model's config there)")
    inner = f.str("model_type", default=TEXT_TYPE)
    if inner != TEXT_TYPE:
        raise UnsupportedError(f"{source}: text_config.model_type {inner!r} is not {TEXT_TYPE!r}")
    tie_top, tie_text = top.bool("tie_word_embeddings", default=None), f.bool("tie_word_embeddings", default=None)
    if tie_top is not None and tie_text is not None and tie_top != tie_text:
        raise ConfigError(f"{source}: 'tie_word_embeddings' ({json.dumps(tie_top)}) and "
                          f"'text_config.tie_word_embeddings' ({json.dumps(tie_text)}) disagree")
    return f, "multimodal", tie_top if tie_top is not None else (True if tie_text is None else tie_text)


def parse_gemma4_config(raw: dict[str, Any], source: str) -> Gemma4Config:
    """Normalize a Gemma 4 config.json (already parsed), either layout."""
    top = _Fields(raw, source)
    f, layout, tie = _text_fields(top, source)
    _refusals(f)
    notes: list[str] = []
    n_layers, n_heads = f.int("num_hidden_layers"), f.int("num_attention_heads")
    layer_types = _layer_types(f, n_layers, notes)
    k_eq_v = f.bool("attention_k_eq_v", default=False)
    dims, kvs, head_layout = _head_shapes(f, layer_types, f.int("head_dim", default=256),
                                          f.int("num_key_value_heads"), k_eq_v, notes)
    for i, kv in enumerate(kvs):
        if n_heads % kv:
            raise ConfigError(f"{source}: layer {i}: num_attention_heads {n_heads} is not a multiple of its "
                              f"{kv} key/value heads")
    shared = f.int("num_kv_shared_layers", default=0, minimum=0)
    if shared and (shared >= n_layers or set(layer_types[:n_layers - shared]) != set(layer_types)):
        raise ConfigError(f"{source}: {f.prefix}num_kv_shared_layers {shared}: every layer type must keep a layer "
                          f"of its own K/V among the first {n_layers - shared}")
    softcap = f.float("final_logit_softcapping", default=None)
    eos_f = f if f.has("eos_token_id") else top
    return Gemma4Config(
        source=source, layout=layout, head_layout=head_layout, model_type=top.str("model_type"),
        vocab_size=f.int("vocab_size"), hidden_size=f.int("hidden_size"),
        intermediate_size=f.int("intermediate_size"), num_hidden_layers=n_layers,
        num_attention_heads=n_heads, layer_types=layer_types,
        sliding_window=f.int("sliding_window", default=512), head_dims=dims, kv_heads=kvs,
        rope=_rope(f, layer_types, notes), attention_k_eq_v=k_eq_v, final_logit_softcapping=softcap,
        hidden_size_per_layer_input=_ple_width(f),
        vocab_size_per_layer_input=f.int("vocab_size_per_layer_input", default=262_144),
        num_kv_shared_layers=shared, use_double_wide_mlp=f.bool("use_double_wide_mlp", default=False),
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        max_position_embeddings=f.int("max_position_embeddings", default=131_072),
        tie_word_embeddings=tie, eos_token_ids=_eos_ids(eos_f),
        bos_token_id=f.int("bos_token_id", default=None, minimum=0),
        pad_token_id=f.int("pad_token_id", default=None, minimum=0),
        dtype=(f.str("dtype", default=None) or f.str("torch_dtype", default=None)
               or top.str("dtype", default=None) or top.str("torch_dtype", default=None)),
        notes=tuple(notes), moe=_moe(f),
    )


def load_gemma4_config(directory: Path) -> Gemma4Config:
    """Read `directory/config.json` as a Gemma 4 target config (either layout)."""
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory (expected an HF model directory)")
    path = directory / "config.json"
    return parse_gemma4_config(read_json_object(path), str(path))


# --------------------------------------------------------------------------- DeepSpec's Gemma 4 drafter

DRAFT_MODEL_TYPES = (TEXT_TYPE,)


def _draft_refusals(f: _Fields) -> list[str]:
    """What DeepSpec's Gemma 4 drafter layers do not have (its modeling asserts them away) or memra
    does not implement, refused by name; returns the notes of the defaults applied."""
    _refusals(f)
    notes = []
    if "hidden_size_per_layer_input" not in f.raw:
        notes.append("hidden_size_per_layer_input absent: none (DeepSpec's drafter layers take no per-layer inputs)")
    elif _ple_width(f):
        raise UnsupportedError(f"{f.source}: hidden_size_per_layer_input={f.raw['hidden_size_per_layer_input']}: "
                               "a Gemma 4 DSpark drafter has no per-layer inputs (expected 0 or null)")
    if f.int("num_kv_shared_layers", default=0, minimum=0) and f.bool("use_double_wide_mlp", default=False):
        raise UnsupportedError(f"{f.source}: num_kv_shared_layers with use_double_wide_mlp=true: which drafter "
                               "layers get the double-wide MLP is not implemented (expected false or 0 shared layers)")
    if f.bool("enable_moe_block", default=False):
        raise UnsupportedError(f"{f.source}: enable_moe_block=true: a Gemma 4 DSpark drafter's layers have no MoE "
                               "block in memra (expected false)")
    types = f.raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != FULL for t in types)):
        raise UnsupportedError(f"{f.source}: layer_types {json.dumps(types)}: a Gemma 4 DSpark drafter's layers "
                               f"are all {FULL!r}")
    return notes


def _draft_heads(f: _Fields, n_heads: int) -> tuple[int, int, bool]:
    """(head_dim, KV heads, k_eq_v) of every draft layer: the full layers' own shape, from the
    published keys (DeepSpec's export requires `global_head_dim`)."""
    if f.has("per_layer_config") and not f.has("global_head_dim"):
        raise UnsupportedError(f"{f.source}: per_layer_config without global_head_dim: a Gemma 4 DSpark drafter "
                               "names its layers' head shape with global_head_dim (and num_global_key_value_heads)")
    head_dim = f.int("global_head_dim")
    k_eq_v = f.bool("attention_k_eq_v", default=False)
    n_kv = f.int("num_global_key_value_heads") if k_eq_v else f.int("num_key_value_heads")
    if n_heads % n_kv:
        raise ConfigError(f"{f.source}: num_attention_heads {n_heads} is not a multiple of its {n_kv} key/value heads")
    return head_dim, n_kv, k_eq_v


def parse_gemma4_draft_config(raw: dict[str, Any], source: str) -> DraftConfig:
    """DeepSpec's `Gemma4DSparkModel` config.json (the target's Gemma 4 text config with the DSpark
    keys) -> a `DraftConfig` whose layers are Gemma 4 full-attention layers: `global_head_dim`,
    the full layers' KV heads, the `full_attention` rope, `attention_k_eq_v`, the softcap."""
    f = _Fields(raw, source)
    model_type = f.str("model_type", default=None)
    if model_type not in DRAFT_MODEL_TYPES:
        raise UnsupportedError(f"{source}: model_type {model_type!r}: a Gemma 4 DSpark drafter config is "
                               f"{' or '.join(map(repr, DRAFT_MODEL_TYPES))}")
    notes = _draft_refusals(f)
    n_layers, n_heads = f.int("num_hidden_layers"), f.int("num_attention_heads")
    head_dim, n_kv, k_eq_v = _draft_heads(f, n_heads)
    rope = _rope(f, (FULL,), notes)[FULL]
    max_pos = f.int("max_position_embeddings", default=131_072)
    return DraftConfig(
        source=source, exporter="deepspec",
        architectures=tuple(a for a in raw.get("architectures") or () if isinstance(a, str)),
        model_type=model_type, hidden_size=f.int("hidden_size"), num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        intermediate_size=f.int("intermediate_size"), rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        vocab_size=f.int("vocab_size"), max_position_embeddings=max_pos,
        rope=RopeConfig(theta=rope.theta, type=rope.type, factor=rope.factor,
                        partial_rotary_factor=rope.partial_rotary_factor,
                        source_key=f"rope_parameters.{FULL}"),
        dtype=f.str("dtype", default=None) or f.str("torch_dtype", default=None), attention_bias=False,
        layer_types=(FULL,) * n_layers, sliding_window=None, causal=None, causal_source=None,
        strategy_dspark=True,  # DeepSpec's format: a DSpark class whether or not `architectures` names it
        gemma4=Gemma4DraftFacts(k_eq_v, f.float("final_logit_softcapping", default=None), tuple(notes)),
        **drafting_keys(lambda key: f, f, n_layers),
    )
