"""A drafter's geometry for a target: every option of `memra train` that shapes the drafter, with
the defaults the published drafters use, resolved from the target's config and tokenizer.

Every default applied is returned as a note line (the front end shows them and puts them in
--json), so nothing about the trained drafter is implicit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from memra_cli.engine.errors import ConfigError, SettingError

KINDS = ("dflash", "dspark")
# z-lab's DFlash drafters draft 16-token blocks; DeepSpec's DSpark configs use block_size=7
DEFAULT_BLOCK = {"dflash": 16, "dspark": 7}
DEFAULT_MARKOV_RANK = 256  # DeepSpec's DSpark configs (vanilla markov head)
PUBLISHED_LAYERS = 5  # z-lab's and DeepSpec's 8B-class drafters: 5 layers, 5 taps
MASK_NAMES = ("<|MASK|>", "<|mask|>", "<mask>", "<|mask_token|>")
# targets whose DeepSpec DSpark drafter has the target's own layers (Gemma4DSparkModel, written with
# the `gemma4` backbone: train/drafter_gemma4.py, its √hidden-scaled embedding and softcapped logits)
OWN_LAYER_DSPARK = {"gemma4": "Gemma4DSparkModel", "gemma4_text": "Gemma4DSparkModel"}


@dataclass(frozen=True)
class Geometry:
    """Everything the checkpoint's config.json says about the drafter."""

    kind: str
    layers: int
    block: int
    taps: tuple[int, ...]
    mask_id: int
    markov_rank: int
    confidence: bool
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    target_layers: int
    rope_theta: float = 10000.0  # the trainable drafter's rope (train/drafter.py)
    max_positions: int = 32768  # config.json's max_position_embeddings (the target's)
    # the block embedding's multiplier: 1 (the target's raw rows) or the target's embed_scale
    # (Gemma's √hidden, `--emb-scale`); z-lab's config.json has no key for it (train_report.json says it)
    emb_scale: float = 1.0
    # "qwen3" (z-lab / Qwen3DSparkModel layers) or "gemma4" (Gemma4DSparkModel: the target's full-
    # attention layer shape, head_dim/kv_heads the full layers', its full-attention rope below)
    backbone: str = "qwen3"
    k_eq_v: bool = False
    rope_type: str = "default"
    rope_partial: float = 1.0
    rope_factor: float = 1.0
    rms_eps: float = 1e-6

    def as_json(self) -> dict:
        d = asdict(self)
        d["taps"] = list(self.taps)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Geometry":
        return cls(**{**d, "taps": tuple(d["taps"])})


def spread_taps(n: int, target_layers: int) -> tuple[int, ...]:
    """`n` taps over the target's depth as the published drafters place them:
    round(1 + i*(L-4)/(n-1)) for n > 1 (Qwen3-8B, L=36, n=5: 1, 9, 17, 25, 33), L//2 for n = 1."""
    if n == 1:
        return (target_layers // 2,)
    return tuple(int(round(1 + i * (target_layers - 4) / (n - 1))) for i in range(n))


def text_config(target: Path) -> dict:
    """The target's config.json (its `text_config` for a multimodal layout)."""
    raw = json.loads((target / "config.json").read_text())
    return raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw


def default_mask_token(target: Path, vocab: int) -> tuple[int, str]:
    """(mask id, how it was chosen): a mask special token of the tokenizer by name, else the first
    embedding row past the tokenizer's tokens (z-lab's Qwen3 drafters use 151669 so)."""
    path = target / "tokenizer.json"
    if not path.is_file():
        raise SettingError("mask_token", None, f"{path} is missing: give the mask token id",
                           flag_text="--mask-token: the target has no tokenizer.json to find one in; give the id")
    tok = json.loads(path.read_text())
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    for name in MASK_NAMES:
        if name in added:
            return added[name], f"mask token {added[name]} ({name} in the tokenizer; --mask-token)"
    n_tok = max([*tok.get("model", {}).get("vocab", {}).values(), *added.values()], default=-1) + 1
    if n_tok < vocab:
        return n_tok, f"mask token {n_tok} (the first embedding row past the tokenizer's {n_tok} tokens; --mask-token)"
    raise SettingError("mask_token", None, "the tokenizer has no mask token and no spare embedding row",
                       flag_text=f"--mask-token: {path} has no mask token and the vocabulary has no spare row; give one")


def resolve_geometry(target: Path, kind: str, *, layers: int | None = None, block: int | None = None,
                     taps: tuple[int, ...] | None = None, mask_token: int | None = None,
                     markov_rank: int | None = None, confidence: bool | None = None) -> tuple[Geometry, list[str]]:
    """The geometry for `kind` over the target directory, and one note per default applied.
    Refuses taps outside [-1, L-1]. The engine's taps are raw layer outputs, the last layer's
    included (as DeepSpec's training cache records them), so training and inference agree."""
    if kind not in KINDS:
        raise SettingError("kind", kind, f"expected {'|'.join(KINDS)}", quote=False)
    cfg, notes = text_config(target), []
    L, hidden, vocab = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if layers is None:
        layers = PUBLISHED_LAYERS if L >= 4 * PUBLISHED_LAYERS else 1
        notes.append(f"drafter layers: {layers} (default for a {L}-layer target: {PUBLISHED_LAYERS} from 20 target "
                     "layers up, as the published drafters, else 1; --layers)")
    if block is None:
        block = DEFAULT_BLOCK[kind]
        notes.append(f"block size: {block} (default for {kind}; --block)")
    if taps is None:
        taps = spread_taps(layers, L)
        notes.append(f"taps: {','.join(map(str, taps))} ({layers} spread over the target's {L} layers; --taps)")
    bad = [t for t in taps if not -1 <= t <= L - 1]
    if bad:
        raise SettingError("taps", ",".join(map(str, taps)),
                           f"tap {bad[0]} is outside the target's layers (expected -1..{L - 1} for {L} layers; -1 is "
                           "the embedding output)")
    if mask_token is None:
        mask_token, note = default_mask_token(target, vocab)
        notes.append(note)
    elif not 0 <= mask_token < vocab:
        raise SettingError("mask_token", mask_token, f"expected 0..{vocab - 1} (the target's vocabulary)")
    if kind == "dflash":
        if markov_rank or confidence:
            raise SettingError("kind", kind, "a DFlash drafter has no markov or confidence head (use --kind dspark)")
        markov_rank, confidence = 0, False
    else:
        if markov_rank is None:
            markov_rank = min(DEFAULT_MARKOV_RANK, vocab)
            notes.append(f"markov rank: {markov_rank} (default, as DeepSpec's DSpark configs; --markov-rank)")
        if confidence is None:
            confidence = True
            notes.append("confidence head: on, fed the markov state (default for dspark; --no-confidence)")
    if layers < 1 or block < 2:
        raise SettingError("layers" if layers < 1 else "block", layers if layers < 1 else block,
                           "expected layers >= 1 and block >= 2")
    geo = Geometry(kind, layers, block, tuple(taps), mask_token, markov_rank, confidence, hidden, heads, kv, head_dim,
                   int(cfg.get("intermediate_size") or 4 * hidden), vocab, L,
                   max_positions=int(cfg.get("max_position_embeddings") or 32768))
    if kind == "dspark" and _own_layer_format(target, cfg):
        geo = _gemma4_backbone(target, geo)
        notes.append("drafter format: Gemma4DSparkModel (DeepSpec's DSpark drafter for a Gemma 4 target: its "
                     "full-attention layers, block embedding scaled by its embed_scale, softcapped logits)")
    return geo, notes


def _own_layer_format(target: Path, cfg: dict) -> str | None:
    """The DSpark format of a family whose DeepSpec drafter is built of its own layers, else None."""
    raw = json.loads((target / "config.json").read_text())
    return next((OWN_LAYER_DSPARK[t] for t in (raw.get("model_type"), cfg.get("model_type")) if t in OWN_LAYER_DSPARK),
                None)


def _gemma4_backbone(target: Path, geo: Geometry) -> Geometry:
    """A Gemma4DSparkModel geometry: every draft layer has the target's full-attention shape
    (head dim, KV heads, k_eq_v) and rope, and its MLP width (the target's base width)."""
    from dataclasses import replace

    from memra_cli.engine.formats.gemma4_config import FULL, load_gemma4_config

    g = load_gemma4_config(target)
    if FULL not in g.layer_types:
        raise SettingError("kind", "dspark", f"{target}: a Gemma4DSparkModel drafter takes the target's "
                           f"{FULL} layer shape and rope, and its layer_types have no {FULL} layer", quote=False)
    full = g.layer_types.index(FULL)
    rope = g.rope[FULL]
    return replace(geo, backbone="gemma4", head_dim=g.head_dims[full], kv_heads=g.kv_heads[full],
                   ffn=g.intermediate_size, k_eq_v=g.attention_k_eq_v, rope_type=rope.type, rope_theta=rope.theta,
                   rope_partial=rope.partial_rotary_factor, rope_factor=rope.factor, rms_eps=g.rms_norm_eps,
                   max_positions=g.max_position_embeddings)


def check_target_dir(target: Path) -> None:
    """Refuse what is not a model directory before anything loads."""
    if not (target / "config.json").is_file():
        raise ConfigError(f"{target}: expected a target model directory (config.json + safetensors)")
