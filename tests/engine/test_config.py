"""config.json parsing across the public exporters, and its refusals."""

from __future__ import annotations

import json

import pytest

from memra_cli.engine.formats.config import (
    default_target_layer_ids,
    dspark_strategy,
    load_draft_config,
    load_target_config,
    parse_draft_config,
)
from memra_cli.engine.errors import ConfigError, UnsupportedError


def _cfg(draft_dir, fmt, **kw):
    return load_draft_config(draft_dir(fmt, **kw) / "config.json")


def test_zlab_new_keys(draft_dir):
    c = _cfg(draft_dir, "zlab")
    assert (c.exporter, c.strategy_dspark, c.block_size, c.mask_token_id) == ("zlab-dflash", False, 8, 511)
    assert c.target_layer_ids == (0, 2) and not c.target_layer_ids_defaulted
    assert c.rope.type == "default" and c.rope.theta == 10000.0 and c.rope.source_key == "rope_parameters"
    assert c.dtype == "float32" and c.markov_rank == 0


def test_zlab_legacy_keys_with_yarn(draft_dir):
    c = _cfg(draft_dir, "zlab", legacy=True, yarn=True)
    assert c.block_size == 8  # top-level block_size
    assert c.rope.source_key == "rope_scaling" and c.rope.type == "yarn"
    assert (c.rope.factor, c.rope.original_max_position_embeddings) == (4.0, 64)
    assert c.dtype == "float32"  # from torch_dtype


def test_deepspec_top_level_keys_and_embedding_tap(draft_dir):
    c = _cfg(draft_dir, "deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3))
    assert c.exporter == "deepspec" and c.strategy_dspark
    assert c.target_layer_ids == (-1, 1, 3)
    assert (c.markov_rank, c.markov_head_type) == (32, "vanilla")
    assert (c.enable_confidence_head, c.confidence_head_with_markov) == (True, True)


def test_nested_dspark_config_and_projector(draft_dir):
    n = _cfg(draft_dir, "nested", markov_rank=16, confidence="plain")
    assert n.exporter == "dspark-nested" and n.strategy_dspark and n.markov_rank == 16
    assert n.confidence_head_with_markov is False
    p = _cfg(draft_dir, "projector")
    assert p.exporter == "dflash-projector-dspark" and p.strategy_dspark


def test_strategy_census_reads_the_checkpoint():
    assert dspark_strategy({"architectures": ["Qwen3DSparkModel"], "dflash_config": {"projector_type": "dspark"}})
    assert dspark_strategy({"architectures": ["Qwen3DSparkModel"]})
    assert dspark_strategy({"dflash_config": {"projector_type": "dspark"}})
    assert not dspark_strategy({"architectures": ["Qwen3DFlashModel"], "dflash_config": {"attention_mode": "gqa"}})
    assert not dspark_strategy({})


def test_default_target_layer_ids_rule():
    # Qwen3-8B (36 layers) with a 5-layer drafter: z-lab's published taps.
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    # ties round to even, as Python's round in the reference does: 1 + 1*6/4 = 2.5 -> 2
    assert default_target_layer_ids(10, 5) == (1, 2, 4, 6, 7)


def test_default_rule_applied_when_taps_absent(draft_dir):
    d = draft_dir("zlab", target_layer_ids=None, num_target_layers=36, layers=5)
    c = load_draft_config(d / "config.json")
    assert c.target_layer_ids == (1, 9, 17, 25, 33) and c.target_layer_ids_defaulted


BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "rope_theta": 10000.0, "block_size": 8,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]},
}


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"hidden_size": None}, "required key 'hidden_size' is missing"),
        ({"hidden_size": "64"}, "key 'hidden_size' must be an integer, got \"64\""),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [2, 0]}}, "strictly increasing"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [-2]}}, "integers >= -1"),
        ({"dflash_config": {"mask_token_id": 5}}, "neither 'target_layer_ids' nor 'num_target_layers'"),
        ({"block_size": 1}, "key 'block_size' must be an integer >= 2"),
        ({"layer_types": ["full_attention"]}, "'layer_types' has 1 entries"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "'sliding_window' is missing"),
        ({"rope_theta": None}, "'rope_theta'"),
        ({"markov_rank": 8, "markov_head_type": "lstm"}, "markov_head_type' must be one of vanilla|gated|rnn"),
    ],
)
def test_refusals_name_the_key_and_value(patch, message):
    raw = {**BASE, **patch}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("|", r"\|")) as exc:
        parse_draft_config(raw, "ckpt/config.json")
    assert str(exc.value).startswith("ckpt/config.json: ")
    assert "\n" not in str(exc.value)


def test_unsupported_rope_is_refused_by_name():
    raw = {**BASE, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    with pytest.raises(UnsupportedError, match="rope_parameters.rope_type='dynamic' is not implemented"):
        parse_draft_config(raw, "c.json")


def test_file_level_refusals(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_draft_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_draft_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_draft_config(tmp_path / "config.json")


def test_target_config_old_and_new_rope(tmp_path):
    raw = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "max_position_embeddings": 512, "rope_theta": 1e6, "rope_scaling": None, "eos_token_id": [1, 2],
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    t = load_target_config(tmp_path)
    assert t.rope.theta == 1e6 and t.rope.type == "default" and t.eos_token_ids == (1, 2) and t.tie_word_embeddings
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    t = load_target_config(tmp_path)
    assert t.rope.type == "yarn" and t.rope.original_max_position_embeddings == 128
    raw["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedError, match="model_type 'mistral' is not a supported target"):
        load_target_config(tmp_path)


LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
def test_llama_target_config_reads_llama3_scaling_from_either_key(tmp_path, layout):
    raw = dict(LLAMA)
    if layout == "rope_scaling":  # the published 3.1 layout: theta beside, `rope_type` inside
        raw.update(rope_theta=5e5, rope_scaling=dict(LLAMA3_SCALING))
    else:
        raw.update(rope_parameters={**LLAMA3_SCALING, "rope_theta": 5e5})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    t = load_target_config(tmp_path)
    assert (t.model_type, t.qk_norm, t.head_dim) == ("llama", False, 8)  # head_dim: hidden / heads
    r = t.rope
    assert (r.type, r.theta, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings,
            r.source_key) == ("llama3", 5e5, 8.0, 1.0, 4.0, 64, layout)


@pytest.mark.parametrize("edit,error,match", [
    ({"attention_bias": True}, UnsupportedError, "attention_bias=true is not implemented for model_type 'llama'"),
    ({"mlp_bias": True}, UnsupportedError, "mlp_bias=true is not implemented for model_type 'llama'"),
    ({"hidden_act": "gelu"}, UnsupportedError, "hidden_act 'gelu' is not implemented \\(expected 'silu'\\)"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, UnsupportedError,
     "rope_parameters.rope_type='longrope' is not implemented \\(supported: default, yarn, llama3\\)"),
    ({"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 1e4, "low_freq_factor": None}}, ConfigError,
     "required key 'rope_parameters.low_freq_factor' is missing"),
    ({"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 1e4, "high_freq_factor": 1.0}}, ConfigError,
     "'rope_parameters.high_freq_factor' must be greater than low_freq_factor 1.0, got 1.0"),
])
def test_llama_target_config_refusals_name_the_key(tmp_path, edit, error, match):
    raw = {**LLAMA, "rope_theta": 1e4, **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(error, match=match):
        load_target_config(tmp_path)
