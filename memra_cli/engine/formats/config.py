"""config.json -> frozen dataclasses, with validation.

Reads every public drafter exporter (see docs/formats.md):

- z-lab DFlash v1 (`DFlashDraftModel`, model_type qwen3): `dflash_config {mask_token_id,
  target_layer_ids}`, `block_size` top-level or in `dflash_config`, old keys (`rope_theta`,
  `rope_scaling`, `torch_dtype`) or new ones (`rope_parameters`, `dtype`).
- DeepSpec (`Qwen3DSparkModel`): top-level `block_size`, `mask_token_id`, `target_layer_ids`
  (may hold -1 = the embedding output), `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`.
- other DSpark exports: `architectures ["DSparkDraftModel"]` with a nested `dspark_config`, or
  `dflash_config.projector_type == "dspark"`.
- DeepSpec's Gemma 4 export (`Gemma4DSparkModel`, a Gemma 4 text config with the DSpark keys): detected
  here (`is_gemma4_dspark`) and read by `gemma4_config.parse_gemma4_draft_config`, which fills the same
  `DraftConfig` plus its `gemma4` facts; `census.py` picks the reader.

and the dense targets' HF configs (Qwen3, LLaMA). Nothing is inferred from a folder name; every error names the
file, the key, the value and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memra_cli.engine.errors import ConfigError, UnsupportedError

SUPPORTED_ROPE_TYPES = ("default", "yarn", "llama3")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
ATTENTION_TYPES = ("full_attention", "sliding_attention")


# --------------------------------------------------------------------------- raw JSON access


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse `path` as a JSON object or refuse naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (expected an HF-style config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level, got {type(raw).__name__}")
    return raw


class _Fields:
    """Typed look-ups over one JSON object, with errors that name file and key."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _bad(self, key: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(
            f"{self.source}: key '{self.prefix}{key}' must be {expected}, "
            f"got {json.dumps(value)} ({type(value).__name__})"
        )

    def _missing(self, key: str, why: str = "") -> ConfigError:
        tail = f" ({why})" if why else ""
        return ConfigError(f"{self.source}: required key '{self.prefix}{key}' is missing{tail}")

    def int(self, key: str, default: Any = ..., minimum: int | None = 1) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is ...:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "an integer")
        if minimum is not None and value < minimum:
            raise self._bad(key, value, f"an integer >= {minimum}")
        return value

    def float(self, key: str, default: Any = ..., positive: bool = True) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is ...:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, value, "a number")
        if positive and not value > 0:
            raise self._bad(key, value, "a positive number")
        return float(value)

    def bool(self, key: str, default: Any = ...) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is ...:
                raise self._missing(key)
            return default
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def str(self, key: str, default: Any = ..., choices: tuple[str, ...] | None = None) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is ...:
                raise self._missing(key)
            return default
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        if choices is not None and value not in choices:
            raise self._bad(key, value, "one of " + "|".join(choices))
        return value

    def int_list(self, key: str, minimum: int) -> tuple[int, ...] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        ok = isinstance(value, list) and value and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
        )
        if not ok:
            raise self._bad(key, value, f"a non-empty list of integers >= {minimum}")
        return tuple(value)

    def str_list(self, key: str, choices: tuple[str, ...]) -> tuple[str, ...] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) and v in choices for v in value):
            raise self._bad(key, value, "a list of " + "|".join(choices))
        return tuple(value)

    def obj(self, key: str) -> "_Fields | None":
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._bad(key, value, "a JSON object")
        return _Fields(value, self.source, f"{self.prefix}{key}.")


# --------------------------------------------------------------------------- shared pieces


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / legacy `rope_scaling`).

    `type` is "default", "yarn" or "llama3"; the fields a type does not use are None.
    Frequencies and the attention scaling are computed in `rope.py`.
    """

    theta: float
    type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    source_key: str = "rope_theta"
    low_freq_factor: float | None = None  # llama3: wavelengths past original/low are divided by factor
    high_freq_factor: float | None = None  # llama3: wavelengths below original/high are kept
    partial_rotary_factor: float | None = None  # proportional (Gemma 4 full layers): the rotated share


def parse_rope(f: _Fields, max_position_embeddings: int) -> RopeConfig:
    """Read `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older)."""
    params = f.obj("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = f.obj("rope_scaling")
        key = "rope_scaling" if params is not None else "rope_theta"
    theta = None
    if params is not None and params.has("rope_theta"):
        theta = params.float("rope_theta")
    if theta is None:
        theta = f.float("rope_theta", default=None)
    if theta is None:
        raise ConfigError(
            f"{f.source}: required key 'rope_theta' (or 'rope_parameters.rope_theta') is missing"
        )
    if params is None:
        return RopeConfig(theta=theta, source_key=key)
    kind_key = "rope_type" if params.has("rope_type") else "type"
    kind = params.str(kind_key, default="default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"{f.source}: {params.prefix}{kind_key}={kind!r} is not implemented "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if kind == "default":
        return RopeConfig(theta=theta, source_key=key)
    original = params.int("original_max_position_embeddings", default=None)
    if original is None:
        original = f.int("original_max_position_embeddings", default=max_position_embeddings)
    if kind == "llama3":
        return _llama3_rope(params, theta, original, key)
    factor = params.float("factor", default=None)
    if factor is None:
        factor = max_position_embeddings / original  # transformers' rule when factor is absent
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=params.float("beta_fast", default=None),
        beta_slow=params.float("beta_slow", default=None),
        attention_factor=params.float("attention_factor", default=None),
        mscale=params.float("mscale", default=None),
        mscale_all_dim=params.float("mscale_all_dim", default=None),
        truncate=params.bool("truncate", default=True),
        source_key=key,
    )


def _llama3_rope(params: _Fields, theta: float, original: int, key: str) -> RopeConfig:
    """LLaMA-3.1's scaling: `factor`, `low_freq_factor`, `high_freq_factor` are required (no
    transformers default), and the ramp between them needs high > low."""
    low, high = params.float("low_freq_factor"), params.float("high_freq_factor")
    if not high > low:
        raise ConfigError(f"{params.source}: key '{params.prefix}high_freq_factor' must be greater than "
                          f"low_freq_factor {low}, got {high}")
    return RopeConfig(theta=theta, type="llama3", factor=params.float("factor"),
                      original_max_position_embeddings=original, low_freq_factor=low,
                      high_freq_factor=high, source_key=key)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's rule when `target_layer_ids` is absent: spread n taps over layers 1..L-3.

    `round(1 + i*(L-4)/(n-1))` for n > 1 (Python's round, ties to even, as the reference), `L//2`
    for n = 1. n is the drafter's layer count.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


# --------------------------------------------------------------------------- drafter


@dataclass(frozen=True)
class Gemma4DraftFacts:
    """What a Gemma 4-layer drafter (DeepSpec `Gemma4DSparkModel`) adds to `DraftConfig`: its layers
    are Gemma 4 full-attention layers (head_dim / KV heads in `DraftConfig` are the full layers' own)."""

    attention_k_eq_v: bool  # V is the raw key projection (no v_proj)
    final_logit_softcapping: float | None  # its logits: cap * tanh(z / cap)
    notes: tuple[str, ...] = ()  # defaults applied, said in the census


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash / DSpark drafter's config.json, normalized across exporters."""

    source: str
    exporter: str  # "zlab-dflash" | "deepspec" | "dspark-nested" | "dflash-projector-dspark"
    architectures: tuple[str, ...]
    model_type: str | None
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int | None
    max_position_embeddings: int
    rope: RopeConfig
    dtype: str | None
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_layer_ids_defaulted: bool
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: bool | None  # declared `is_causal` / `dflash_config.causal`; None = not declared
    causal_source: str | None  # "is_causal" | "dflash_config.causal" | None
    strategy_dspark: bool
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool | None
    confidence_head_with_markov: bool | None
    gemma4: Gemma4DraftFacts | None = None  # set for a Gemma 4-layer backbone (else Qwen3 layers)

    @property
    def backbone(self) -> str:
        """The drafter's layer family: "gemma4" (DeepSpec's Gemma4DSparkModel) or "qwen3"."""
        return "gemma4" if self.gemma4 is not None else "qwen3"

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def dspark_class(self) -> bool:
        """True for DeepSpec-class exports (their tensor gate refuses unknown names)."""
        return self.strategy_dspark


def dspark_strategy(raw: dict[str, Any]) -> bool:
    """The reference engine's `dspark_strategy_census` over parsed JSON: a DSpark class in `architectures`
    or `dflash_config.projector_type == "dspark"`. z-lab mask-fill exports carry neither."""
    archs = raw.get("architectures")
    arch = isinstance(archs, list) and any(isinstance(a, str) and "DSpark" in a for a in archs)
    dflash = raw.get("dflash_config")
    proj = isinstance(dflash, dict) and dflash.get("projector_type") == "dspark"
    return arch or proj


def _exporter(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if isinstance(raw.get("dspark_config"), dict):
        return "dspark-nested"
    if isinstance(raw.get("dflash_config"), dict) and raw["dflash_config"].get("projector_type") == "dspark":
        return "dflash-projector-dspark"
    if isinstance(archs, list) and any(isinstance(a, str) and "DSpark" in a for a in archs):
        return "deepspec"
    return "zlab-dflash"


def _first(*scopes: _Fields | None, key: str) -> _Fields | None:
    """The first scope that holds `key` (nested exporter blocks before the top level)."""
    for scope in scopes:
        if scope is not None and scope.has(key):
            return scope
    return None


TARGET_ARCHITECTURE_ENDINGS = ("ForCausalLM", "ForConditionalGeneration")


def _refuse_a_target(raw: dict[str, Any], source: str) -> None:
    """A config.json without a block size that names a causal LM (or a multimodal model) is a
    target, not a drafter: say so, rather than that `block_size` is missing."""
    names = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    arch = next((a for a in names if a.endswith(TARGET_ARCHITECTURE_ENDINGS)), None)
    if arch is not None:
        raise ConfigError(f"{source}: a target model ({arch}, model_type {raw.get('model_type')!r}), not a drafter "
                          "(a drafter's config.json has block_size and mask_token_id); give it as --target")


GEMMA4_DRAFTER_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text", "gemma4", "gemma4_unified")


def is_gemma4_dspark(raw: dict[str, Any]) -> bool:
    """DeepSpec's `Gemma4DSparkModel` export: a Gemma 4 DSpark class in `architectures`, or a Gemma 4
    text model_type with a top-level `block_size` (its config is the target's text config plus the
    DSpark keys)."""
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    if any(a.startswith("Gemma4") and "DSpark" in a for a in archs):
        return True
    return raw.get("block_size") is not None and raw.get("model_type") in GEMMA4_DRAFTER_MODEL_TYPES


def drafting_keys(pick, top: _Fields, n_layers: int) -> dict[str, Any]:
    """The keys every drafter format shares, as `DraftConfig` fields: block, mask token, taps
    (z-lab's default rule when absent), markov and confidence head declarations. `pick(key)` is
    the scope that holds `key` (a nested exporter block, else the top level)."""
    source = top.source
    block_size = pick("block_size").int("block_size", minimum=2)
    mask_scope = pick("mask_token_id")
    mask_token_id = mask_scope.int("mask_token_id", minimum=0)
    num_target_layers = top.int("num_target_layers", default=None)
    tli_scope = pick("target_layer_ids")
    tli = tli_scope.int_list("target_layer_ids", minimum=-1)
    defaulted = tli is None
    if tli is None:
        if num_target_layers is None:
            raise ConfigError(
                f"{source}: neither 'target_layer_ids' nor 'num_target_layers' is present "
                "(one is needed to know which target layers to tap)"
            )
        tli = default_target_layer_ids(num_target_layers, n_layers)
    if any(b <= a for a, b in zip(tli, tli[1:])):
        raise ConfigError(
            f"{source}: key '{tli_scope.prefix}target_layer_ids' must be strictly increasing, got {list(tli)}"
        )
    if num_target_layers is not None and tli[-1] >= num_target_layers:
        raise ConfigError(
            f"{source}: target_layer_ids {list(tli)} reach layer {tli[-1]} but num_target_layers "
            f"is {num_target_layers}"
        )
    markov_rank = pick("markov_rank").int("markov_rank", default=0, minimum=0)
    markov_type = None
    if markov_rank > 0:
        markov_type = pick("markov_head_type").str("markov_head_type", default="vanilla").lower()
        if markov_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"{source}: key 'markov_head_type' must be one of {'|'.join(MARKOV_HEAD_TYPES)}, "
                f"got {json.dumps(markov_type)}"
            )
    conf_enabled = pick("enable_confidence_head").bool("enable_confidence_head", default=None)
    conf_markov = pick("confidence_head_with_markov").bool("confidence_head_with_markov", default=None)
    return dict(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=tli,
                target_layer_ids_defaulted=defaulted, num_target_layers=num_target_layers,
                markov_rank=markov_rank, markov_head_type=markov_type, enable_confidence_head=conf_enabled,
                confidence_head_with_markov=conf_markov)


def parse_draft_config(raw: dict[str, Any], source: str) -> DraftConfig:
    """Normalize a drafter config.json (already parsed) into a `DraftConfig`."""
    top = _Fields(raw, source)
    nested = top.obj("dspark_config")
    dflash = top.obj("dflash_config")
    scopes = (nested, dflash, top)
    if is_gemma4_dspark(raw):  # its layers are not this reader's: census.py sends it to gemma4_config
        raise ConfigError(f"{source}: a Gemma 4 DSpark drafter config; read it with "
                          "gemma4_config.parse_gemma4_draft_config")
    if _first(*scopes, key="block_size") is None:
        _refuse_a_target(raw, source)

    def pick(key: str) -> _Fields:
        return _first(*scopes, key=key) or top

    hidden = top.int("hidden_size")
    n_heads = top.int("num_attention_heads")
    n_layers = top.int("num_hidden_layers")
    head_dim = top.int("head_dim", default=None)
    if head_dim is None:
        if hidden % n_heads:
            raise ConfigError(
                f"{source}: 'head_dim' is absent and hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {n_heads}"
            )
        head_dim = hidden // n_heads
    n_kv = top.int("num_key_value_heads", default=n_heads)
    if n_heads % n_kv:
        raise ConfigError(
            f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}"
        )
    max_pos = top.int("max_position_embeddings", default=32768)

    drafting = drafting_keys(pick, top, n_layers)

    layer_types = top.str_list("layer_types", ATTENTION_TYPES) or ("full_attention",) * n_layers
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"{source}: 'layer_types' has {len(layer_types)} entries for num_hidden_layers {n_layers}"
        )
    sliding_window = top.int("sliding_window", default=None)
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ConfigError(f"{source}: a layer is 'sliding_attention' but 'sliding_window' is missing")
    # z-lab's key is the top-level `is_causal` (it overrides every layer); `dflash_config.causal`
    # is vLLM's / ModelOpt's: honoured only where `is_causal` is absent, a contradiction refused.
    causal, causal_source = top.bool("is_causal", default=None), "is_causal"
    nested = dflash.bool("causal", default=None) if dflash is not None else None
    if causal is not None and nested is not None and causal != nested:
        raise ConfigError(f"{source}: 'is_causal' is {str(causal).lower()} but 'dflash_config.causal' is "
                          f"{str(nested).lower()}; a drafter's block is one or the other")
    if causal is None:
        causal, causal_source = nested, ("dflash_config.causal" if nested is not None else None)

    return DraftConfig(
        source=source,
        exporter=_exporter(raw),
        architectures=tuple(a for a in raw.get("architectures") or () if isinstance(a, str)),
        model_type=top.str("model_type", default=None),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=top.int("intermediate_size"),
        rms_norm_eps=top.float("rms_norm_eps", default=1e-6),
        vocab_size=top.int("vocab_size", default=None),
        max_position_embeddings=max_pos,
        rope=parse_rope(top, max_pos),
        dtype=top.str("dtype", default=None) or top.str("torch_dtype", default=None),
        attention_bias=top.bool("attention_bias", default=False),
        layer_types=layer_types,
        sliding_window=sliding_window,
        causal=causal,
        causal_source=causal_source,
        strategy_dspark=dspark_strategy(raw),
        **drafting,
    )


def load_draft_config(path: Path) -> DraftConfig:
    """Read and validate `path` (a config.json)."""
    return parse_draft_config(read_json_object(path), str(path))


# --------------------------------------------------------------------------- target


@dataclass(frozen=True)
class TargetConfig:
    """A dense decoder's config.json: Qwen3 (`qwen3`) or LLaMA (`llama`). The families share
    the layer math and differ in the switches below (`qk_norm`)."""

    source: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    dtype: str | None
    model_type: str = "qwen3"
    qk_norm: bool = True  # per-head RMSNorm of q and k before rope (Qwen3 has it, LLaMA not)


TARGET_MODEL_TYPES = ("qwen3", "llama")


def _refuse_llama_switches(f: _Fields) -> None:
    """LLaMA checkpoints with projection biases exist (`attention_bias`, `mlp_bias`); the dense
    decoder here has none for this family, so such a config is refused by name."""
    for key in ("attention_bias", "mlp_bias"):
        if f.bool(key, default=False):
            raise UnsupportedError(f"{f.source}: {key}=true is not implemented for model_type 'llama' "
                                   "(expected false or absent)")


def parse_target_config(raw: dict[str, Any], source: str) -> TargetConfig:
    f = _Fields(raw, source)
    model_type = f.str("model_type")
    if model_type not in TARGET_MODEL_TYPES:
        raise UnsupportedError(
            f"{source}: model_type {model_type!r} is not a supported target "
            f"(supported: {', '.join(TARGET_MODEL_TYPES)})"
        )
    if f.bool("use_sliding_window", default=False):
        raise UnsupportedError(f"{source}: use_sliding_window=true targets are not implemented")
    act = f.str("hidden_act", default="silu")
    if act != "silu":
        raise UnsupportedError(f"{source}: hidden_act {act!r} is not implemented (expected 'silu')")
    if model_type == "llama":
        _refuse_llama_switches(f)
    hidden = f.int("hidden_size")
    n_heads = f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", default=n_heads)
    if n_heads % n_kv:
        raise ConfigError(
            f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}"
        )
    max_pos = f.int("max_position_embeddings")
    eos = raw.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise ConfigError(f"{source}: key 'eos_token_id' must be an integer or a list of integers, got {json.dumps(eos)}")
    return TargetConfig(
        source=source,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers"),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=f.int("head_dim", default=hidden // n_heads),
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        max_position_embeddings=max_pos,
        rope=parse_rope(f, max_pos),
        tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
        attention_bias=f.bool("attention_bias", default=False),
        eos_token_ids=eos_ids,
        bos_token_id=f.int("bos_token_id", default=None, minimum=0),
        pad_token_id=f.int("pad_token_id", default=None, minimum=0),
        dtype=f.str("dtype", default=None) or f.str("torch_dtype", default=None),
        model_type=model_type,
        qk_norm=model_type == "qwen3",
    )


def load_target_config(directory: Path) -> TargetConfig:
    """Read `directory/config.json` as a dense target config (Qwen3 or LLaMA)."""
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a directory (expected an HF model directory)")
    path = directory / "config.json"
    return parse_target_config(read_json_object(path), str(path))
