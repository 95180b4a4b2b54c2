"""Writing a trained drafter in the formats everyone reads: z-lab DFlash (`DFlashDraftModel`)
for `dflash`, DeepSpec (`Qwen3DSparkModel`, or `Gemma4DSparkModel` over a Gemma 4 target, with
copies of the target's embedding and lm_head) for `dspark` — the layouts `memra census` reads
(docs/formats.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from memra_cli.train.geometry import Geometry

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def drafter_config(geo: Geometry, dtype: str, num_anchors: int, target_config: dict | None = None) -> dict:
    """config.json of the exported drafter (`target_config`: the target's text config, which a
    Gemma4DSparkModel config is built from)."""
    if geo.backbone == "gemma4":
        return _gemma4_config(geo, dtype, num_anchors, target_config)
    base = {
        "model_type": "qwen3", "hidden_size": geo.hidden, "num_hidden_layers": geo.layers,
        "num_attention_heads": geo.heads, "num_key_value_heads": geo.kv_heads, "head_dim": geo.head_dim,
        "intermediate_size": geo.ffn, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": geo.vocab,
        "max_position_embeddings": geo.max_positions, "attention_bias": False, "tie_word_embeddings": False,
        "num_target_layers": geo.target_layers, "layer_types": ["full_attention"] * geo.layers,
        "sliding_window": None,
    }
    if geo.kind == "dflash":  # z-lab DFlash v1 (legacy keys, as its exports carry)
        return {**base, "architectures": ["DFlashDraftModel"], "rope_theta": geo.rope_theta, "rope_scaling": None,
                "torch_dtype": dtype, "block_size": geo.block,
                "dflash_config": {"mask_token_id": geo.mask_id, "target_layer_ids": list(geo.taps)}}
    cfg = {**base, "architectures": ["Qwen3DSparkModel"],
           "rope_parameters": {"rope_type": "default", "rope_theta": geo.rope_theta}, "dtype": dtype,
           "block_size": geo.block, "mask_token_id": geo.mask_id, "target_layer_ids": list(geo.taps),
           "num_anchors": num_anchors, "markov_rank": geo.markov_rank, "enable_confidence_head": geo.confidence}
    if geo.markov_rank:
        cfg["markov_head_type"] = "vanilla"
    if geo.confidence:
        cfg["confidence_head_with_markov"] = bool(geo.markov_rank)
    return cfg


# Gemma 4 target keys a Gemma4DSparkModel drafter does not carry: its layers are all full attention,
# with no per-layer inputs, KV sharing or MoE block (the census refuses them on a drafter)
_GEMMA4_TARGET_ONLY = ("per_layer_config", "num_experts", "top_k_experts", "moe_intermediate_size", "architectures",
                       "auto_map", "sliding_window")


def _gemma4_config(geo: Geometry, dtype: str, num_anchors: int, target_config: dict | None) -> dict:
    """DeepSpec's Gemma4DSparkModel config.json: the target's Gemma 4 text config with the draft
    layers' keys and the DSpark keys (the layout memra_cli/tiny/gemma4_dspark.py writes)."""
    if target_config is None:
        raise ValueError("a Gemma4DSparkModel config is built from the target's text config (target_config)")
    cfg = {k: v for k, v in target_config.items() if k not in _GEMMA4_TARGET_ONLY}
    cfg.update(architectures=["Gemma4DSparkModel"], model_type="gemma4_text", num_target_layers=geo.target_layers,
               num_hidden_layers=geo.layers, layer_types=["full_attention"] * geo.layers, tie_word_embeddings=False,
               global_head_dim=geo.head_dim, attention_k_eq_v=geo.k_eq_v, hidden_size_per_layer_input=0,
               num_kv_shared_layers=0, use_double_wide_mlp=False, enable_moe_block=False, dtype=dtype,
               block_size=geo.block, mask_token_id=geo.mask_id, target_layer_ids=list(geo.taps),
               num_anchors=num_anchors, markov_rank=geo.markov_rank, enable_confidence_head=geo.confidence,
               target_model_type="gemma4", target_text_model_type="gemma4_text")
    cfg["num_global_key_value_heads" if geo.k_eq_v else "num_key_value_heads"] = geo.kv_heads
    if geo.markov_rank:
        cfg["markov_head_type"] = "vanilla"
    if geo.confidence:
        cfg["confidence_head_with_markov"] = bool(geo.markov_rank)
    return cfg


def drafter_tensors(drafter: torch.nn.Module, geo: Geometry, source, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: the drafter's state_dict (its names are the format's), plus for
    DeepSpec the target's tables under `embed_tokens.weight` / `lm_head.weight`."""
    dt = DTYPES[dtype]
    out = {k: v.detach().to(dt).contiguous().cpu() for k, v in drafter.state_dict().items()}
    if geo.kind == "dspark":
        out["embed_tokens.weight"] = source.embed_weight.detach().to(dt).cpu().clone()
        out["lm_head.weight"] = source.head_weight.detach().to(dt).cpu().clone()
    return out


def write_drafter(directory: Path, drafter: torch.nn.Module, geo: Geometry, source, *, dtype: str = "bfloat16",
                  num_anchors: int = 512, extra: dict[str, str] | None = None,
                  target_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors (+ `extra` text files) into a fresh temporary
    sibling of `directory`, then rename it into place: a stop leaves no half-written drafter."""
    from safetensors.torch import save_file

    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(drafter_config(geo, dtype, num_anchors, target_config), indent=2) + "\n")
        save_file(drafter_tensors(drafter, geo, source, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
