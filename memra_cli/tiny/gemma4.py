"""Tiny random Gemma 4 text targets in the real HF layouts.

`make_tiny_gemma4(dir)` writes config.json + model.safetensors (or shards + index):

- `layout="text"`: what transformers writes for `Gemma4ForCausalLM` (model_type `gemma4_text`,
  weights under `model.`); `heads="global"` names the full layers' shape with the published
  `global_head_dim` / `num_global_key_value_heads`, `heads="per_layer"` with `per_layer_config`;
- `layout="multimodal"`: `Gemma4ForConditionalGeneration`'s (model_type `gemma4`, the text config
  under `text_config`, text weights under `model.language_model.`), plus a few fake vision /
  audio tower tensors a text target must recognize and skip.

The same `seed` gives the same text weights in every layout. Switches: sliding window, k_eq_v,
per-layer inputs (`ple`), KV-shared layers (`shared`, double-wide MLP), softcap, tied or not, the
MoE block (`moe`, stacked experts as transformers writes them).
Weights are random but scaled so greedy streams wander: projections ~1/sqrt(fan_in), norms near 1,
layer scalars near 1, embeddings of std 0.5/sqrt(hidden) (the model scales them by sqrt(hidden):
the scaled rows stay below the normed layer outputs, so a tied head does not echo the last token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from memra_cli.tiny.target import _save, make_tiny_tokenizer, special_token_ids

DEFAULT_LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                       "full_attention")


def _text_config(a: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "gemma4_text", "vocab_size": a["vocab"], "hidden_size": a["hidden"],
        "intermediate_size": a["intermediate"], "num_hidden_layers": len(a["layer_types"]),
        "num_attention_heads": a["heads"], "num_key_value_heads": a["kv_heads"], "head_dim": a["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": a["tie"], "sliding_window": a["window"], "layer_types": list(a["layer_types"]),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "final_logit_softcapping": a["softcap"], "attention_k_eq_v": a["k_eq_v"],
        "hidden_size_per_layer_input": a["ple"], "vocab_size_per_layer_input": a["vocab"],
        "num_kv_shared_layers": a["shared"], "use_double_wide_mlp": a["shared"] > 0,
        "enable_moe_block": a["moe"] is not None, "attention_bias": False,
        "eos_token_id": special_token_ids(a["vocab"])["<|endoftext|>"], "pad_token_id": 0, "bos_token_id": None,
        "dtype": "float32",
    }
    if a["moe"] is not None:
        cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"] = a["moe"]
    full_kv = a["global_kv_heads"] if a["k_eq_v"] else a["kv_heads"]
    if a["heads_layout"] == "global":
        cfg["global_head_dim"] = a["global_head_dim"]
        cfg["num_global_key_value_heads"] = a["global_kv_heads"]
    else:
        cfg["per_layer_config"] = {str(i): {"head_dim": a["global_head_dim"], "num_key_value_heads": full_kv}
                                   for i, t in enumerate(a["layer_types"]) if t == "full_attention"}
    return cfg


def _config(a: dict[str, Any]) -> dict[str, Any]:
    text = _text_config(a)
    if a["layout"] == "text":
        return {**text, "architectures": ["Gemma4ForCausalLM"]}
    return {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
            "vision_config": None, "audio_config": None, "tie_word_embeddings": a["tie"], "dtype": "float32"}


def _layer_shape(a: dict[str, Any], i: int) -> tuple[int, int, bool, bool, int]:
    """(head_dim, kv_heads, owns K/V, k_eq_v, mlp width) of layer i."""
    full = a["layer_types"][i] == "full_attention"
    n = len(a["layer_types"])
    shared = i >= n - a["shared"]
    hd = a["global_head_dim"] if full else a["head_dim"]
    kv = a["global_kv_heads"] if (full and a["k_eq_v"]) else a["kv_heads"]
    return hd, kv, not shared, full and a["k_eq_v"], a["intermediate"] * (2 if shared else 1)


def _moe_tensors(a: dict[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """Every layer's MoE block in the stacked layout transformers writes for Gemma 4: a router
    (`proj` wide enough that tokens pick different experts, `scale` and `per_expert_scale` near
    1), experts ~1/sqrt(fan_in), the block's norms near 1. Its own generator: the dense weights
    stay those of the same seed without the block."""
    gen = torch.Generator().manual_seed(a["seed"] + 7)
    h, (e, _, inter) = a["hidden"], a["moe"]
    t = {}
    for i in range(len(a["layer_types"])):
        p = f"{prefix}layers.{i}."
        t.update({p + "router.proj.weight": 2.0 * torch.randn(e, h, generator=gen) / h ** 0.5,
                  p + "router.scale": 1.0 + 0.1 * torch.randn(h, generator=gen),
                  p + "router.per_expert_scale": 1.0 + 0.2 * torch.randn(e, generator=gen),
                  p + "experts.gate_up_proj": torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5,
                  p + "experts.down_proj": torch.randn(e, h, inter, generator=gen) / inter ** 0.5})
        for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            t[p + name + ".weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    return t


def _tensors(a: dict[str, Any], gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    h, nh, ple, n = a["hidden"], a["heads"], a["ple"], len(a["layer_types"])

    def lin(out: int, fan_in: int) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) / fan_in ** 0.5

    def norm(d: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    t = {prefix + "embed_tokens.weight": torch.randn(a["vocab"], h, generator=gen) / h ** 0.5 * 0.5,
         prefix + "norm.weight": norm(h)}
    for i in range(n):
        hd, kv, owns, k_eq_v, inter = _layer_shape(a, i)
        p = f"{prefix}layers.{i}."
        t.update({p + "self_attn.q_proj.weight": lin(nh * hd, h), p + "self_attn.o_proj.weight": lin(h, nh * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "layer_scalar": 0.8 + 0.4 * torch.rand(1, generator=gen),
                  p + "mlp.gate_proj.weight": lin(inter, h), p + "mlp.up_proj.weight": lin(inter, h),
                  p + "mlp.down_proj.weight": lin(h, inter)})
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + name + ".weight"] = norm(h)
        if owns:
            t[p + "self_attn.k_proj.weight"] = lin(kv * hd, h)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
            if not k_eq_v:
                t[p + "self_attn.v_proj.weight"] = lin(kv * hd, h)
        if ple:
            t.update({p + "per_layer_input_gate.weight": lin(ple, h), p + "per_layer_projection.weight": lin(h, ple),
                      p + "post_per_layer_input_norm.weight": norm(h)})
    if ple:
        t.update({prefix + "embed_tokens_per_layer.weight": torch.randn(a["vocab"], n * ple, generator=gen) / ple ** 0.5,
                  prefix + "per_layer_model_projection.weight": lin(n * ple, h),
                  prefix + "per_layer_projection_norm.weight": norm(ple)})
    if not a["tie"]:
        t["lm_head.weight"] = torch.randn(a["vocab"], h, generator=gen) * (4.0 / h ** 0.5)
    return t


def make_tiny_gemma4(
    directory: Path | str,
    *,
    layout: str = "text",
    heads_layout: str = "global",
    vocab: int = 512,
    hidden: int = 64,
    intermediate: int = 96,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    global_head_dim: int = 32,
    global_kv_heads: int = 1,
    layer_types: tuple[str, ...] = DEFAULT_LAYER_TYPES,
    window: int = 8,
    k_eq_v: bool = True,
    ple: int = 0,
    shared: int = 0,
    softcap: float | None = 30.0,
    tie: bool = True,
    seed: int = 0,
    shards: int = 1,
    tokenizer: bool = False,
    moe: tuple[int, int, int] | None = None,
) -> Path:
    """Write a tiny Gemma 4 target to `directory` (module docstring) and return its path.
    `moe=(experts, top_k, intermediate)`: `enable_moe_block` with every layer's block."""
    if layout not in ("text", "multimodal") or heads_layout not in ("global", "per_layer"):
        raise ValueError(f"layout {layout!r} / heads_layout {heads_layout!r}: expected text|multimodal, global|per_layer")
    a = dict(layout=layout, heads_layout=heads_layout, vocab=vocab, hidden=hidden, intermediate=intermediate,
             heads=heads, kv_heads=kv_heads, head_dim=head_dim, global_head_dim=global_head_dim,
             global_kv_heads=global_kv_heads, layer_types=tuple(layer_types), window=window, k_eq_v=k_eq_v,
             ple=ple, shared=shared, softcap=softcap, tie=tie, moe=moe, seed=seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    prefix = "model." if layout == "text" else "model.language_model."
    tensors = _tensors(a, gen, prefix)
    if moe is not None:
        tensors.update(_moe_tensors(a, prefix))
    if layout == "multimodal":
        tensors.update({"model.vision_tower.encoder.layers.0.mlp.weight": torch.zeros(4, 4),
                        "model.embed_vision.embedding_projection.weight": torch.zeros(hidden, 4),
                        "model.audio_tower.layers.0.weight": torch.zeros(4)})
    _save(out, tensors, shards)
    (out / "config.json").write_text(json.dumps(_config(a), indent=2) + "\n")
    if tokenizer:
        make_tiny_tokenizer(out, vocab)
    return out
