"""The census: strategy, heads, rope, layout, tensor gate, shape checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from memra_cli.engine.formats.census import take_census
from memra_cli.engine.errors import CensusError, ConfigError, UnsupportedError


def test_zlab_dflash_without_heads(draft_dir):
    c = take_census(draft_dir("zlab"))
    assert c.kind == "dflash" and not c.strategy_dspark
    assert c.markov is None and c.confidence is None and not c.unknown_tensors
    assert not c.own_embed_tokens and not c.own_lm_head
    assert c.n_params == sum(t.numel for t in c.tensors) and c.n_bytes == 4 * c.n_params


def test_deepspec_with_heads_and_own_tables(draft_dir):
    c = take_census(draft_dir("deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3), dtype=torch.bfloat16))
    assert c.kind == "dspark" and c.strategy_dspark
    assert (c.markov.rank, c.markov.type) == (32, "vanilla")
    assert (c.confidence.in_dim, c.confidence.with_markov) == (64 + 32, True)
    assert c.own_embed_tokens and c.own_lm_head
    assert c.n_bytes == 2 * c.n_params


def test_plain_confidence_head(draft_dir):
    c = take_census(draft_dir("nested", markov_rank=16, confidence="plain"))
    assert (c.confidence.in_dim, c.confidence.with_markov) == (64, False)


def test_markov_rank_inferred_from_tensors_when_config_is_silent(draft_dir):
    w = {"markov_head.markov_w1.weight": torch.randn(512, 8), "markov_head.markov_w2.weight": torch.randn(512, 8)}
    c = take_census(draft_dir("projector", extra_tensors=w))
    assert c.markov.rank == 8


def test_gated_and_rnn_markov_are_refused_by_name(draft_dir):
    for kind in ("gated", "rnn"):
        with pytest.raises(UnsupportedError, match=f"markov_head_type '{kind}' is recognized but not implemented"):
            take_census(draft_dir("deepspec", markov_rank=8, markov_type=kind))


def test_impossible_confidence_width(draft_dir):
    bad = {"confidence_head.proj.weight": torch.randn(1, 70), "confidence_head.proj.bias": torch.randn(1)}
    d = draft_dir("deepspec", markov_rank=8, extra_tensors=bad, config_overrides={"enable_confidence_head": True, "confidence_head_with_markov": True})
    with pytest.raises(CensusError, match="in_dim 70, which matches neither hidden_size 64 nor hidden\\+markov_rank 72"):
        take_census(d)


def test_unknown_tensor_refuses_on_dspark_and_warns_on_dflash(draft_dir):
    extra = {"layers.0.self_attn.mystery.weight": torch.zeros(4)}
    with pytest.raises(CensusError, match="unrecognized tensors on a DSpark-class export: layers.0.self_attn.mystery.weight"):
        take_census(draft_dir("deepspec", extra_tensors=extra))
    c = take_census(draft_dir("zlab", extra_tensors=extra))
    assert c.unknown_tensors == ("layers.0.self_attn.mystery.weight",)
    assert any("layers.0.self_attn.mystery.weight" in w for w in c.warnings)


def test_missing_and_misshapen_tensors(draft_dir):
    d = draft_dir("zlab")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors["layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CensusError, match="tensor 'layers.1.mlp.down_proj.weight' is missing \\(expected shape \\[64, 128\\]\\)"):
        take_census(d)
    d = draft_dir("zlab", target_layer_ids=(0, 1, 2))
    tensors = load_file(str(d / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CensusError, match="'fc.weight' has shape \\[64, 128\\], expected \\[64, 192\\]"):
        take_census(d)


def test_directory_refusals(tmp_path, draft_dir):
    with pytest.raises(ConfigError, match="no such file or directory"):
        take_census(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        take_census(tmp_path)
    d = draft_dir("zlab", config_overrides={"vocab_size": 100})
    with pytest.raises(ConfigError, match="mask_token_id 511 is outside vocab_size 100"):
        take_census(d)


def test_attention_layout_rules(draft_dir):
    types = ("sliding_attention", "full_attention")
    c = take_census(draft_dir("zlab", layer_types=types, sliding_window=16))
    assert [(l.attention, l.window, l.causal_in_block) for l in c.layers] == [("sliding", 16, True), ("full", None, False)]
    c = take_census(draft_dir("zlab", layer_types=types, sliding_window=16, is_causal=False))
    assert [l.causal_in_block for l in c.layers] == [False, False]
    d = draft_dir("zlab", layer_types=types, sliding_window=16, config_overrides={"dflash_config": {"mask_token_id": 511, "target_layer_ids": [0, 2], "block_size": 8, "causal": False}})
    assert [l.causal_in_block for l in take_census(d).layers] == [False, False]


def test_yarn_matches_transformers(draft_dir):
    """The spec's YaRN form (divisors + mscale) against transformers' own YaRN frequencies."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from memra_cli.engine.layers.rope import rope_tables

    d = draft_dir("zlab", yarn=True, head_dim=32, heads=2, kv_heads=1)
    c = take_census(d)
    raw = json.loads((d / "config.json").read_text())
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "architectures")})
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    plain = torch.tensor([10000.0 ** (-2 * j / 32) for j in range(16)], dtype=torch.float64)
    inv_spec = plain / torch.tensor(c.rope.divisors, dtype=torch.float64)
    assert torch.allclose(inv_spec, inv_hf.double(), rtol=1e-6, atol=0)
    assert math.isclose(c.rope.mscale, scale_hf, rel_tol=1e-12)
    assert c.rope.mscale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    tables = rope_tables(c.config.rope, 32)
    assert torch.equal(tables.inv_freq, inv_hf.float())


def _as_gemma4_dspark(path, **overrides):
    """Rewrite a DeepSpec drafter's config.json with the keys DeepSpec's Gemma 4 exporter writes."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["Gemma4DSparkModel"], model_type="gemma4_text", global_head_dim=32,
               num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0,
               layer_types=["full_attention"] * cfg["num_hidden_layers"],
               rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}})
    cfg.update(overrides)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("overrides", [{}, {"architectures": ["DSparkDraftModel"]}])
def test_gemma4_dspark_config_over_qwen_layers_is_refused_by_tensor(draft_dir, overrides):
    """A Gemma 4 DSpark config (by architecture, or by model_type with a block size) is read as Gemma 4
    layers: Qwen3-layout tensors under it fail the census by name, never load as the wrong layers."""
    path = _as_gemma4_dspark(draft_dir("deepspec", markov_rank=16, confidence="markov"), **overrides)
    with pytest.raises(CensusError, match=r"tensor 'layers\.0\.self_attn\.q_proj\.weight' has shape \[64, 64\], "
                                          r"expected \[128, 64\]"):
        take_census(path)
