"""Tiny random Qwen3.5 hybrid targets in both real HF layouts.

`make_tiny_qwen35(dir)` writes config.json + model.safetensors (or shards + index):

- `layout="text"`: what transformers writes for `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`,
  weights under `model.`; `qwen3_5_moe_text` with `moe`);
- `layout="multimodal"`: the published layout (`Qwen3_5ForConditionalGeneration`, model_type
  `qwen3_5`, the text config under `text_config`, text weights under `model.language_model.`),
  plus a few fake vision-tower (`model.visual.*`) and MTP (`mtp.*`) tensors a text target must
  recognize and skip.

The same `seed` gives the same text weights in both layouts. Weights are random but scaled so the
model is not degenerate (greedy streams wander): projections ~1/sqrt(fan_in), zero-centred norms
near 0 (so `1 + w` ~ 1), DeltaNet decays spread over fast and slow (A in [0.5, 8], dt_bias ~ 0),
an lm_head giving logits of std ~2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from memra_cli.tiny.target import _save, make_tiny_tokenizer, special_token_ids

# the real checkpoints' pattern is 3 linear : 1 full; a tiny model wants both kinds early and twice
DEFAULT_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention",
                       "full_attention")


def _text_config(a: dict[str, Any]) -> dict[str, Any]:
    eos = a["eos_token_id"]
    if eos is None:
        eos = special_token_ids(a["vocab"])["<|endoftext|>"]
    cfg = {
        "model_type": "qwen3_5_text",
        "vocab_size": a["vocab"],
        "hidden_size": a["hidden"],
        "intermediate_size": a["intermediate"],
        "num_hidden_layers": len(a["layer_types"]),
        "num_attention_heads": a["heads"],
        "num_key_value_heads": a["kv_heads"],
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": a["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": a["rope_theta"],
                            "partial_rotary_factor": a["partial_rotary_factor"],
                            "mrope_section": a["mrope_section"], "mrope_interleaved": True},
        "partial_rotary_factor": a["partial_rotary_factor"],
        "attention_bias": a["attention_bias"],
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": a["conv_kernel"],
        "linear_key_head_dim": a["linear_key_head_dim"],
        "linear_value_head_dim": a["linear_value_head_dim"],
        "linear_num_key_heads": a["linear_key_heads"],
        "linear_num_value_heads": a["linear_value_heads"],
        "mamba_ssm_dtype": "float32",
        "tie_word_embeddings": a["tie"],
        "bos_token_id": special_token_ids(a["vocab"])["<|endoftext|>"],
        "eos_token_id": eos,
        "dtype": "bfloat16" if a["dtype"] == torch.bfloat16 else "float32",
        "use_cache": True,
    }
    if a["moe"] is not None:  # transformers' Qwen3_5MoeTextConfig has no dense intermediate_size
        del cfg["intermediate_size"]
        cfg["model_type"] = "qwen3_5_moe_text"
        cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"] = a["moe"]
        cfg["shared_expert_intermediate_size"] = a["intermediate"]
    if a["write_layer_types"]:
        cfg["layer_types"] = list(a["layer_types"])
    else:  # the interval rule must reproduce the given types
        interval = a["full_attention_interval"]
        derived = tuple("linear_attention" if (i + 1) % interval else "full_attention"
                        for i in range(len(a["layer_types"])))
        assert derived == tuple(a["layer_types"]), (derived, a["layer_types"])
        cfg["full_attention_interval"] = interval
    return cfg


def _config(a: dict[str, Any]) -> dict[str, Any]:
    text = _text_config(a)
    moe = "Moe" if a["moe"] is not None else ""
    if a["layout"] == "text":
        return {"architectures": [f"Qwen3_5{moe}ForCausalLM"], **text}
    vision = {"model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision", "depth": 1, "hidden_size": 32,
              "intermediate_size": 64,
              "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "out_hidden_size": a["hidden"], "num_position_embeddings": 16,
              "hidden_act": "gelu_pytorch_tanh"}
    return {
        "architectures": [f"Qwen3_5{moe}ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": a["vocab"] - 8, "video_token_id": a["vocab"] - 7,
        "vision_start_token_id": a["vocab"] - 6, "vision_end_token_id": a["vocab"] - 5,
        "tie_word_embeddings": a["tie"],
    }


def _tensors(a: dict[str, Any], gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    h, hd, ff, v = a["hidden"], a["head_dim"], a["intermediate"], a["vocab"]
    nh, nkv = a["heads"], a["kv_heads"]
    hk, hv = a["linear_key_heads"], a["linear_value_heads"]
    dk, dv, kern = a["linear_key_head_dim"], a["linear_value_head_dim"], a["conv_kernel"]
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim

    def proj(out: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) * (gain / math.sqrt(fan_in))

    def znorm(n: int) -> torch.Tensor:  # zero-centred: the model multiplies by 1 + w
        return 0.1 * torch.randn(n, generator=gen)

    t = {prefix + "embed_tokens.weight": torch.randn(v, h, generator=gen)}
    for i, kind in enumerate(a["layer_types"]):
        p = f"{prefix}layers.{i}."
        if kind == "full_attention":
            s = p + "self_attn."
            t.update({
                s + "q_proj.weight": proj(2 * nh * hd, h), s + "k_proj.weight": proj(nkv * hd, h),
                s + "v_proj.weight": proj(nkv * hd, h), s + "o_proj.weight": proj(h, nh * hd, 0.7),
                s + "q_norm.weight": znorm(hd), s + "k_norm.weight": znorm(hd),
            })
            if a["attention_bias"]:
                for name, n in (("q_proj", 2 * nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", h)):
                    t[s + name + ".bias"] = 0.1 * torch.randn(n, generator=gen)
        else:
            g = p + "linear_attn."
            t.update({
                g + "in_proj_qkv.weight": proj(conv_dim, h), g + "in_proj_z.weight": proj(value_dim, h),
                g + "in_proj_b.weight": proj(hv, h), g + "in_proj_a.weight": proj(hv, h),
                g + "conv1d.weight": torch.randn(conv_dim, 1, kern, generator=gen) / math.sqrt(kern),
                g + "dt_bias": 0.5 * torch.randn(hv, generator=gen),
                g + "A_log": torch.empty(hv).uniform_(0.5, 8.0, generator=gen).log(),
                g + "norm.weight": 1.0 + 0.1 * torch.randn(dv, generator=gen),
                g + "out_proj.weight": proj(h, value_dim, 0.7),
            })
        m = p + "mlp."
        t.update({
            p + "input_layernorm.weight": znorm(h), p + "post_attention_layernorm.weight": znorm(h),
            m + "gate_proj.weight": proj(ff, h), m + "up_proj.weight": proj(ff, h),
            m + "down_proj.weight": proj(h, ff, 0.7),
        })
    t[prefix + "norm.weight"] = znorm(h)
    if not a["tie"]:
        t["lm_head.weight"] = proj(v, h, 2.0)
    return t


def _moe_tensors(a: dict[str, Any], t: dict[str, torch.Tensor], prefix: str) -> None:
    """Turn every layer's MLP of `t` into the MoE block, in the per-expert layout the published
    checkpoints (and transformers' save_pretrained) use: the MLP becomes the shared expert, and a
    router wide enough that tokens pick different experts, a shared-expert gate and the experts
    are added (their own generator: the rest stay the dense weights of the same seed)."""
    gen = torch.Generator().manual_seed(a["seed"] + 7)
    h, (e, _, inter) = a["hidden"], a["moe"]
    for i in range(len(a["layer_types"])):
        m = f"{prefix}layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[f"{m}shared_expert.{name}.weight"] = t.pop(f"{m}{name}.weight")
        t[m + "gate.weight"] = 2.0 * torch.randn(e, h, generator=gen) / math.sqrt(h)
        t[m + "shared_expert_gate.weight"] = torch.randn(1, h, generator=gen) / math.sqrt(h)
        for x in range(e):
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                t[f"{m}experts.{x}.{name}.weight"] = torch.randn(*shape, generator=gen) / math.sqrt(shape[1])


def _extras(a: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Fake vision-tower and MTP tensors (names as published; values irrelevant: they are skipped)."""
    h = a["hidden"]
    gen = torch.Generator().manual_seed(a["seed"] + 1000)
    return {
        "model.visual.patch_embed.proj.weight": torch.randn(32, 3, 2, 4, 4, generator=gen),
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=gen),
        "model.visual.blocks.0.attn.qkv.bias": torch.randn(96, generator=gen),
        "model.visual.merger.linear_fc2.weight": torch.randn(h, 128, generator=gen),
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=gen),
        "mtp.norm.weight": torch.randn(h, generator=gen),
        "mtp.layers.0.mlp.down_proj.weight": torch.randn(h, a["intermediate"], generator=gen),
    }


def make_tiny_qwen35(
    directory: Path | str,
    *,
    layout: str = "text",
    vocab: int = 512,
    hidden: int = 64,
    layer_types: tuple[str, ...] = DEFAULT_LAYER_TYPES,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 128,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    conv_kernel: int = 4,
    partial_rotary_factor: float = 0.25,
    mrope_section: tuple[int, int, int] = (2, 1, 1),
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    tie: bool = False,
    attention_bias: bool = False,
    write_layer_types: bool = True,
    full_attention_interval: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shards: int = 1,
    eos_token_id: int | list[int] | None = None,
    tokenizer: bool = False,
    moe: tuple[int, int, int] | None = None,
) -> Path:
    """Write a tiny random Qwen3.5 hybrid target to `directory`; returns the directory.

    `write_layer_types=False` writes `full_attention_interval` instead of `layer_types` (the given
    types must follow the interval rule). `tokenizer=True` also writes the tiny tokenizer.
    `moe=(experts, top_k, intermediate)`: the mixture-of-experts hybrid (`qwen3_5_moe` /
    `qwen3_5_moe_text`), its shared expert of `intermediate` (`_moe_tensors`)."""
    if layout not in ("text", "multimodal"):
        raise ValueError(f"layout must be 'text' or 'multimodal', got {layout!r}")
    a = dict(locals())
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(a), indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    prefix = "model." if layout == "text" else "model.language_model."
    tensors = _tensors(a, gen, prefix)
    if moe is not None:
        _moe_tensors(a, tensors, prefix)
    if layout == "multimodal":
        tensors.update(_extras(a))
    _save(out, {k: v.to(dtype).contiguous() for k, v in tensors.items()}, shards)
    if tokenizer:
        make_tiny_tokenizer(out, vocab)
    return out
