"""Writing a trained drafter in the formats everyone reads: z-lab DFlash (`DFlashDraftModel`)
for `dflash`, DeepSpec (`Qwen3DSparkModel`, with copies of the target's embedding and lm_head)
for `dspark` — the layouts `memra census` reads (docs/formats.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from memra_cli.train.geometry import Geometry

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def drafter_config(geo: Geometry, dtype: str, num_anchors: int) -> dict:
    """config.json of the exported drafter."""
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
                  num_anchors: int = 512, extra: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors (+ `extra` text files) into a fresh temporary
    sibling of `directory`, then rename it into place: a stop leaves no half-written drafter."""
    from safetensors.torch import save_file

    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(drafter_config(geo, dtype, num_anchors), indent=2) + "\n")
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
