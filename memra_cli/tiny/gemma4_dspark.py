"""A tiny random DeepSpec `Gemma4DSparkModel` drafter, in the layout DeepSpec's export has.

DeepSpec builds its Gemma 4 drafter config from the target's text config (every Gemma 4 key kept:
`global_head_dim`, `num_global_key_value_heads`, `attention_k_eq_v`, `rope_parameters` keyed by
layer type, `final_logit_softcapping`, ...) and overrides `architectures ["Gemma4DSparkModel"]`,
`num_hidden_layers`, `layer_types` (all `full_attention`), `tie_word_embeddings false` and the DSpark
keys (`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`, ...).
Its state dict: `embed_tokens` and `lm_head` (copies of the target's), `fc`, `hidden_norm`, `norm`,
Gemma 4 layers (q/k/[v]/o projections, q/k norms, four sandwich norms, `layer_scalar`, MLP), the
markov head (`markov_head.markov_w1/w2`) and the confidence head (`confidence_head.proj`).

`make_tiny_gemma4_dspark(dir, target=...)` copies the tiny target's embedding (and its tied head)
and shape keys, so the pair loads without a warning; without `target` the tables are random.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memra_cli.tiny.gemma4 import DEFAULT_LAYER_TYPES, _text_config
from memra_cli.tiny.target import save_weights, special_token_ids

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


def _config(shape: dict, layers: int, block_size: int, taps: tuple[int, ...], markov_rank: int,
            confidence: str | None, softcap: float | None) -> dict:
    cfg = _text_config({"moe": None, **shape, "softcap": softcap, "tie": True})  # a drafter has no MoE block
    cfg.update(architectures=["Gemma4DSparkModel"], num_target_layers=cfg["num_hidden_layers"],
               num_hidden_layers=layers, layer_types=["full_attention"] * layers, tie_word_embeddings=False,
               block_size=block_size, mask_token_id=special_token_ids(shape["vocab"])["<|MASK|>"],
               target_layer_ids=list(taps), num_anchors=512, markov_rank=markov_rank,
               enable_confidence_head=confidence is not None, target_model_type="gemma4",
               target_text_model_type="gemma4_text")
    if markov_rank:
        cfg["markov_head_type"] = "vanilla"
    if confidence is not None:
        cfg["confidence_head_with_markov"] = confidence == "markov"
    return cfg


def _layer(p: str, shape: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, nh, hd = shape["hidden"], shape["heads"], shape["global_head_dim"]
    kv = shape["global_kv_heads"] if shape["k_eq_v"] else shape["kv_heads"]
    inter = shape["intermediate"]

    def lin(out: int, fan_in: int) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) / fan_in ** 0.5

    def norm(d: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    # q/k norms near 0.4: attention scaling is 1.0, so RMS-normed q.k scores reach ~head_dim x
    # the norms' product; at 1.0 the tiny softmax saturates and bfloat16 rounding of q/k swings it
    t = {p + "self_attn.q_proj.weight": lin(nh * hd, h), p + "self_attn.k_proj.weight": lin(kv * hd, h),
         p + "self_attn.o_proj.weight": lin(h, nh * hd), p + "self_attn.q_norm.weight": 0.4 * norm(hd),
         p + "self_attn.k_norm.weight": 0.4 * norm(hd), p + "mlp.gate_proj.weight": lin(inter, h),
         p + "mlp.up_proj.weight": lin(inter, h), p + "mlp.down_proj.weight": lin(h, inter),
         p + "layer_scalar": 0.8 + 0.4 * torch.rand(1, generator=gen)}
    if not shape["k_eq_v"]:
        t[p + "self_attn.v_proj.weight"] = lin(kv * hd, h)
    t.update({p + name + ".weight": norm(h) for name in LAYER_NORMS})
    return t


def _target_tables(target: Path) -> dict[str, torch.Tensor]:
    """The tiny Gemma target's embedding and head (tied: the embedding), under the drafter's names."""
    from safetensors.torch import load_file

    weights = load_file(str(target / "model.safetensors"))
    embed = next(weights[k] for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
                 if k in weights)
    return {"embed_tokens.weight": embed, "lm_head.weight": weights.get("lm_head.weight", embed).clone()}


def make_tiny_gemma4_dspark(
    directory: Path | str,
    *,
    target: Path | str | None = None,
    layers: int = 2,
    block_size: int = 8,
    taps: tuple[int, ...] = (-1, 1, 3),
    markov_rank: int = 16,
    confidence: str | None = "markov",  # None | "plain" | "markov"
    k_eq_v: bool = True,
    softcap: float | None = 30.0,
    vocab: int = 512,
    hidden: int = 64,
    intermediate: int = 96,
    seed: int = 5,
    config_overrides: dict | None = None,
) -> Path:
    """Write a tiny Gemma4DSparkModel drafter (module docstring) shaped like `tiny.gemma4`'s default
    target (heads 4, KV heads 2 x 16 sliding / 1 x 32 full, 5 layers) and return its path."""
    shape = dict(vocab=vocab, hidden=hidden, intermediate=intermediate, heads=4, kv_heads=2, head_dim=16,
                 global_head_dim=32, global_kv_heads=1, layer_types=DEFAULT_LAYER_TYPES, window=8,
                 k_eq_v=k_eq_v, ple=0, shared=0, heads_layout="global")
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": torch.randn(hidden, len(taps) * hidden, generator=gen) / (len(taps) * hidden) ** 0.5,
               "hidden_norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
               "norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen)}
    for i in range(layers):
        tensors.update(_layer(f"layers.{i}.", shape, gen))
    if markov_rank:
        tensors["markov_head.markov_w1.weight"] = torch.randn(vocab, markov_rank, generator=gen)
        tensors["markov_head.markov_w2.weight"] = torch.randn(vocab, markov_rank, generator=gen) * 0.5
    if confidence is not None:
        in_dim = hidden + (markov_rank if confidence == "markov" else 0)
        tensors["confidence_head.proj.weight"] = torch.randn(1, in_dim, generator=gen) * 0.2
        tensors["confidence_head.proj.bias"] = torch.randn(1, generator=gen) * 0.5
    if target is not None:
        tensors.update(_target_tables(Path(target)))
    else:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5 * 0.5
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"].clone()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(shape, layers, block_size, taps, markov_rank, confidence, softcap)
    cfg.update(config_overrides or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_weights({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out
