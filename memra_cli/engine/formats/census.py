"""What a drafter checkpoint is, and whether it is safe to load.

`take_census(path)` reads config.json and the weight headers (never the weights) and returns one
`Census`: kind and training strategy, heads, rope, per-layer attention layout, the tensor gate
(every tensor consumed or named; unknown tensors refuse on DSpark-class exports and warn on plain
DFlash), shape checks against the config, parameter count and bytes. Pure apart from header I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from memra_cli.engine.formats.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from memra_cli.engine.formats.config import DraftConfig, is_gemma4_dspark, parse_draft_config, read_json_object
from memra_cli.engine.formats.gemma4_config import parse_gemma4_draft_config
from memra_cli.engine.errors import CensusError, ConfigError, UnsupportedError
from memra_cli.engine.formats.names import (
    CONF_B, CONF_W, MARKOV_W1, MARKOV_W2, OWN_EMBED, OWN_LM_HEAD,
)
from memra_cli.engine.formats.yarn import yarn_divisors, yarn_mscale

IMPLEMENTED_MARKOV = ("vanilla",)


@dataclass(frozen=True)
class MarkovInfo:
    rank: int
    type: str


@dataclass(frozen=True)
class ConfidenceInfo:
    in_dim: int
    with_markov: bool


@dataclass(frozen=True)
class RopeInfo:
    type: str
    theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    divisors: tuple[float, ...] | None = None  # spec form: inv_freq_j = plain_j / divisors[j]
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    partial_rotary_factor: float | None = None  # proportional (a Gemma 4 drafter's full-attention rope)


@dataclass(frozen=True)
class LayerLayout:
    index: int
    attention: str  # "full" | "sliding"
    window: int | None
    causal_in_block: bool
    rule: str  # why causal_in_block has its value


@dataclass(frozen=True)
class Census:
    path: Path
    config: DraftConfig
    checkpoint_format: str
    files: tuple[Path, ...]
    kind: str  # "dflash" | "dspark"
    markov: MarkovInfo | None
    confidence: ConfidenceInfo | None
    rope: RopeInfo
    layers: tuple[LayerLayout, ...]
    tensors: tuple[TensorInfo, ...]
    unknown_tensors: tuple[str, ...]
    own_embed_tokens: bool
    own_lm_head: bool
    n_params: int
    n_bytes: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def strategy_dspark(self) -> bool:
        return self.config.strategy_dspark


# --------------------------------------------------------------------------- pieces


GEMMA4_LAYER_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


def _expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
    }
    if cfg.gemma4 is not None:  # Gemma 4 layers: sandwich norms, a layer scalar, no v_proj with k_eq_v
        per_layer.update({name: (h,) for name in GEMMA4_LAYER_NORMS}, layer_scalar=(1,))
        if cfg.gemma4.attention_k_eq_v:
            del per_layer["self_attn.v_proj.weight"]
    shapes = {"fc.weight": (h, cfg.n_taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"layers.{i}.{suffix}"] = shape
    return shapes


def _check_shape(ckpt: Checkpoint, name: str, want: tuple[int, ...]) -> None:
    info = ckpt.tensors.get(name)
    if info is None:
        raise CensusError(f"{ckpt.root}: tensor '{name}' is missing (expected shape {list(want)})")
    if info.shape != want:
        raise CensusError(
            f"{ckpt.root}: tensor '{name}' has shape {list(info.shape)}, expected {list(want)} from config"
        )


def _markov(cfg: DraftConfig, ckpt: Checkpoint) -> MarkovInfo | None:
    has_w1, has_w2 = MARKOV_W1 in ckpt, MARKOV_W2 in ckpt
    if not (has_w1 or has_w2 or cfg.markov_rank):
        return None
    if cfg.markov_head_type not in (None, *IMPLEMENTED_MARKOV):
        raise UnsupportedError(
            f"{cfg.source}: markov_head_type '{cfg.markov_head_type}' is recognized but not "
            f"implemented (implemented: {', '.join(IMPLEMENTED_MARKOV)}); refusing rather than "
            "approximating it"
        )
    for name, present in ((MARKOV_W1, has_w1), (MARKOV_W2, has_w2)):
        if not present:
            raise CensusError(f"{ckpt.root}: tensor '{name}' is missing (markov head declared or half present)")
    w1 = ckpt.tensors[MARKOV_W1]
    if len(w1.shape) != 2:
        raise CensusError(f"{ckpt.root}: tensor '{MARKOV_W1}' has shape {list(w1.shape)}, expected [vocab, rank]")
    vocab, rank = w1.shape
    if cfg.markov_rank and cfg.markov_rank != rank:
        raise CensusError(
            f"{ckpt.root}: tensor '{MARKOV_W1}' has rank {rank} but config markov_rank is {cfg.markov_rank}"
        )
    if cfg.vocab_size is not None and vocab != cfg.vocab_size:
        raise CensusError(f"{ckpt.root}: tensor '{MARKOV_W1}' has {vocab} rows but vocab_size is {cfg.vocab_size}")
    _check_shape(ckpt, MARKOV_W2, (vocab, rank))
    return MarkovInfo(rank=rank, type=cfg.markov_head_type or "vanilla")


def _confidence(cfg: DraftConfig, ckpt: Checkpoint, markov: MarkovInfo | None) -> ConfidenceInfo | None:
    present = CONF_W in ckpt
    if not present:
        if cfg.enable_confidence_head:
            raise CensusError(f"{ckpt.root}: tensor '{CONF_W}' is missing (config enable_confidence_head=true)")
        return None
    if cfg.enable_confidence_head is False:
        raise CensusError(f"{ckpt.root}: tensor '{CONF_W}' is present but config says enable_confidence_head=false")
    w = ckpt.tensors[CONF_W]
    if len(w.shape) != 2 or w.shape[0] != 1:
        raise CensusError(f"{ckpt.root}: tensor '{CONF_W}' has shape {list(w.shape)}, expected [1, in_dim]")
    in_dim = w.shape[1]
    with_markov = markov is not None and in_dim == cfg.hidden_size + markov.rank
    if not with_markov and in_dim != cfg.hidden_size:
        rank_note = f" nor hidden+markov_rank {cfg.hidden_size + markov.rank}" if markov else ""
        raise CensusError(
            f"{ckpt.root}: tensor '{CONF_W}' has in_dim {in_dim}, which matches neither hidden_size "
            f"{cfg.hidden_size}{rank_note}"
        )
    if cfg.confidence_head_with_markov is not None and cfg.confidence_head_with_markov != with_markov:
        raise CensusError(
            f"{ckpt.root}: confidence head in_dim {in_dim} implies with_markov={with_markov} but config "
            f"confidence_head_with_markov={cfg.confidence_head_with_markov}"
        )
    _check_shape(ckpt, CONF_B, (1,))
    return ConfidenceInfo(in_dim=in_dim, with_markov=with_markov)


def _rope(cfg: DraftConfig) -> RopeInfo:
    r = cfg.rope
    if r.type == "default":
        return RopeInfo(type="default", theta=r.theta)
    if r.type == "proportional":
        return RopeInfo(type="proportional", theta=r.theta, factor=r.factor, partial_rotary_factor=r.partial_rotary_factor)
    if r.type == "llama3":
        return RopeInfo(type="llama3", theta=r.theta, factor=r.factor,
                        original_max_position_embeddings=r.original_max_position_embeddings,
                        low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    return RopeInfo(
        type="yarn", theta=r.theta, factor=r.factor,
        original_max_position_embeddings=r.original_max_position_embeddings,
        beta_fast=r.beta_fast or 32.0, beta_slow=r.beta_slow or 1.0,
        mscale=yarn_mscale(r), divisors=tuple(yarn_divisors(r, cfg.head_dim)),
    )


def attention_layout(cfg: DraftConfig) -> tuple[LayerLayout, ...]:
    """Per-layer attention. A `sliding_attention` layer is causal within the block unless the
    config declares otherwise; a full layer is non-causal unless it declares `is_causal: true`.
    A declared value (top-level `is_causal`, else `dflash_config.causal`) overrides every layer.
    The window is per query on absolute positions (causal: p-W < k <= p; else |k-p| < W).
    z-lab's current model code, SGLang and SpecForge agree on this; z-lab's code up to commit
    44947fb passed no mask (sliding layers ran full and non-causal) and no published v1 drafter
    relied on that."""
    out = []
    for i, kind in enumerate(cfg.layer_types):
        sliding = kind == "sliding_attention"
        if cfg.gemma4 is not None:  # every layer full; DeepSpec's drafting forward passes is_causal=False
            out.append(LayerLayout(i, "full", None, False, "Gemma 4 DSpark: full, non-causal (DeepSpec's eval)"))
            continue
        if cfg.causal is None:
            causal = sliding
            rule = ("sliding => causal in block (undeclared; z-lab model code, SGLang, SpecForge)" if sliding
                    else "full => non-causal (undeclared)")
        else:
            causal = cfg.causal
            rule = f"declared {cfg.causal_source}={str(cfg.causal).lower()}"
        out.append(LayerLayout(i, "sliding" if sliding else "full", cfg.sliding_window if sliding else None, causal, rule))
    return tuple(out)


def _gate(cfg: DraftConfig, ckpt: Checkpoint, markov, confidence) -> tuple[tuple[str, ...], list[str]]:
    """Every tensor consumed or named. Returns (unknown names, warnings); refuses on DSpark."""
    known = set(_expected_shapes(cfg)) | {OWN_EMBED, OWN_LM_HEAD}
    if markov:
        known |= {MARKOV_W1, MARKOV_W2}
    if confidence:
        known |= {CONF_W, CONF_B}
    unknown = tuple(sorted(n for n in ckpt.names() if n not in known))
    warnings: list[str] = []
    if unknown:
        listed = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        if cfg.dspark_class:
            raise CensusError(
                f"{ckpt.root}: unrecognized tensors on a DSpark-class export: {listed} "
                "(a silently dropped tensor is a dropped program)"
            )
        warnings.append(f"unmapped tensors ignored: {listed}")
    return unknown, warnings


def _own_table(cfg: DraftConfig, ckpt: Checkpoint, name: str) -> bool:
    info = ckpt.tensors.get(name)
    if info is None:
        return False
    if len(info.shape) != 2 or info.shape[1] != cfg.hidden_size or (
        cfg.vocab_size is not None and info.shape[0] != cfg.vocab_size
    ):
        want = [cfg.vocab_size or "vocab", cfg.hidden_size]
        raise CensusError(f"{ckpt.root}: tensor '{name}' has shape {list(info.shape)}, expected {want}")
    return True


# --------------------------------------------------------------------------- entry point


def read_draft_config(raw: dict, source: str) -> DraftConfig:
    """A drafter config.json (parsed) by the reader of its layers: DeepSpec's Gemma 4 export, or the
    Qwen3-layer formats."""
    return (parse_gemma4_draft_config if is_gemma4_dspark(raw) else parse_draft_config)(raw, source)


def load_draft_config(path: Path) -> DraftConfig:
    return read_draft_config(read_json_object(path), str(path))


def _config_for(path: Path, ckpt: Checkpoint) -> DraftConfig:
    embedded = getattr(ckpt, "embedded_config", None)
    if embedded is not None:  # a GGUF carries its source config.json in its metadata
        return read_draft_config(embedded, f"{path}:config.json")
    return load_draft_config(path / "config.json")


def take_census(path: Path) -> Census:
    """Census of a drafter directory (config.json + safetensors) or a memra GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json (expected a drafter checkpoint directory)")
    if path.is_dir():
        cfg = load_draft_config(path / "config.json")  # config errors before weight errors
        ckpt = open_checkpoint(path)
    elif path.suffix != ".gguf":  # a lone weights file has no config: its directory is the checkpoint
        raise ConfigError(f"{path}: expected a drafter checkpoint directory (config.json + safetensors) or a memra "
                          f".gguf file; for this file's checkpoint give its directory {path.parent}")
    else:
        ckpt = open_checkpoint(path)
        cfg = _config_for(path, ckpt)
    if cfg.attention_bias:
        raise UnsupportedError(f"{cfg.source}: attention_bias=true drafters are not implemented")
    if cfg.vocab_size is not None and cfg.mask_token_id >= cfg.vocab_size:
        raise ConfigError(f"{cfg.source}: mask_token_id {cfg.mask_token_id} is outside vocab_size {cfg.vocab_size}")
    for name, shape in _expected_shapes(cfg).items():
        _check_shape(ckpt, name, shape)
    markov = _markov(cfg, ckpt)
    confidence = _confidence(cfg, ckpt, markov)
    own_embed, own_head = _own_table(cfg, ckpt, OWN_EMBED), _own_table(cfg, ckpt, OWN_LM_HEAD)
    unknown, warnings = _gate(cfg, ckpt, markov, confidence)
    return Census(
        path=path, config=cfg, checkpoint_format=ckpt.format, files=ckpt.files,
        kind="dspark" if cfg.strategy_dspark else "dflash",
        markov=markov, confidence=confidence, rope=_rope(cfg), layers=attention_layout(cfg),
        tensors=tuple(ckpt.tensors.values()), unknown_tensors=unknown,
        own_embed_tokens=own_embed, own_lm_head=own_head,
        n_params=sum(t.numel for t in ckpt.tensors.values()), n_bytes=ckpt.total_bytes,
        warnings=tuple(warnings),
    )
