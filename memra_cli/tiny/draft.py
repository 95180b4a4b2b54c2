"""Tiny random drafter checkpoints in the real public formats (for tests, docs and scripts).

`make_tiny_draft(dir, fmt=...)` writes config.json + model.safetensors as each exporter does:

- "zlab":       z-lab DFlash v1 (`DFlashDraftModel`, `dflash_config {mask_token_id,
                target_layer_ids}`, block_size top-level; `legacy=True` uses rope_theta /
                rope_scaling / torch_dtype, else rope_parameters / dtype / dflash_config.block_size)
- "deepspec":   DeepSpec `Qwen3DSparkModel` (top-level DSpark keys; ships embed_tokens and lm_head)
- "nested":     `DSparkDraftModel` with a nested `dspark_config`
- "projector":  z-lab layout with `dflash_config.projector_type = "dspark"`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from memra_cli.tiny.target import save_weights

FORMATS = ("zlab", "deepspec", "nested", "projector")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}


def _config(fmt: str, a: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "qwen3", "hidden_size": a["hidden"], "num_hidden_layers": a["layers"],
        "num_attention_heads": a["heads"], "num_key_value_heads": a["kv_heads"],
        "head_dim": a["head_dim"], "intermediate_size": a["intermediate"], "rms_norm_eps": 1e-6,
        "vocab_size": a["vocab"], "max_position_embeddings": 4096, "attention_bias": False,
        "num_target_layers": a["num_target_layers"], "hidden_act": "silu",
        "layer_types": a["layer_types"], "sliding_window": a["sliding_window"],
    }
    if a["is_causal"] is not None:
        cfg["is_causal"] = a["is_causal"]
    rope = dict(YARN) if a["yarn"] else None
    dtype_name = "bfloat16" if a["dtype"] == torch.bfloat16 else "float32"
    if a["legacy"]:
        cfg.update(rope_theta=10000.0, rope_scaling=rope, torch_dtype=dtype_name)
    else:
        cfg.update(rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": 10000.0}, dtype=dtype_name)
    tli = list(a["target_layer_ids"]) if a["target_layer_ids"] is not None else None
    dspark_keys = {
        "block_size": a["block_size"], "mask_token_id": a["mask_token_id"],
        "markov_rank": a["markov_rank"], "enable_confidence_head": a["confidence"] is not None,
    }
    if a["markov_rank"]:
        dspark_keys["markov_head_type"] = a["markov_type"]
    if a["confidence"] is not None:
        dspark_keys["confidence_head_with_markov"] = a["confidence"] == "markov"
    if tli is not None:
        dspark_keys["target_layer_ids"] = tli
    if fmt == "zlab":
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["dflash_config"] = {"mask_token_id": a["mask_token_id"]}
        if tli is not None:
            cfg["dflash_config"]["target_layer_ids"] = tli
        if a["legacy"]:
            cfg["block_size"] = a["block_size"]
        else:
            cfg["dflash_config"]["block_size"] = a["block_size"]
    elif fmt == "deepspec":
        cfg["architectures"] = ["Qwen3DSparkModel"]
        cfg.update(dspark_keys, num_anchors=512, tie_word_embeddings=False)
    elif fmt == "nested":
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["dspark_config"] = dspark_keys
    elif fmt == "projector":
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["dflash_config"] = {"projector_type": "dspark", **dspark_keys}
    else:
        raise ValueError(f"unknown format {fmt!r} (expected one of {FORMATS})")
    return cfg


def _tensors(a: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd, ff, n_taps = a["hidden"], a["head_dim"], a["intermediate"], len(a["target_layer_ids"] or [0] * a["layers"])
    q, kv, std = a["heads"] * hd, a["kv_heads"] * hd, a["std"]

    def rnd(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {"fc.weight": rnd(h, n_taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(a["layers"]):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": rnd(ff, h), p + "mlp.up_proj.weight": rnd(ff, h),
            p + "mlp.down_proj.weight": rnd(h, ff),
        })
    r, v = a["markov_rank"], a["vocab"]
    if r:
        t["markov_head.markov_w1.weight"] = rnd(v, r, scale=1.0)
        t["markov_head.markov_w2.weight"] = rnd(v, r, scale=0.5)
    if a["confidence"] is not None:
        in_dim = h + (r if a["confidence"] == "markov" else 0)
        t["confidence_head.proj.weight"] = rnd(1, in_dim, scale=0.2)
        t["confidence_head.proj.bias"] = rnd(1, scale=0.5)
    if a["own_tables"]:
        t["embed_tokens.weight"] = rnd(v, h, scale=1.0)
        t["lm_head.weight"] = rnd(v, h, scale=0.2)
    return t


def make_tiny_draft(
    directory: Path | str,
    fmt: str = "zlab",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    vocab: int = 512,
    block_size: int = 8,
    mask_token_id: int = 511,  # the tiny target's <|MASK|> (special tokens sit at the top)
    target_layer_ids: tuple[int, ...] | None = (0, 2),
    num_target_layers: int = 4,
    markov_rank: int = 0,
    markov_type: str = "vanilla",
    confidence: str | None = None,  # None | "plain" | "markov"
    yarn: bool = False,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    legacy: bool = False,
    own_tables: bool | None = None,
    dtype: torch.dtype = torch.float32,
    std: float = 0.08,
    seed: int = 0,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random drafter in `fmt` to `directory`; returns the directory."""
    a = dict(locals())
    a["layer_types"] = list(layer_types or ("full_attention",) * layers)
    a["own_tables"] = (fmt == "deepspec") if own_tables is None else own_tables
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(fmt, a)
    cfg.update(config_overrides or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v.to(dtype).contiguous() for k, v in _tensors(a, gen).items()}
    tensors.update(extra_tensors or {})
    save_weights(tensors, out / "model.safetensors")
    return out
