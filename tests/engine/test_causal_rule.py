"""The block-attention rule per layer: declared keys, their precedence, and the census' words."""

from __future__ import annotations

import pytest

from memra_cli.engine.errors import ConfigError
from memra_cli.engine.formats.census import attention_layout
from memra_cli.engine.formats.config import parse_draft_config

BASE = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "rope_theta": 10000.0, "block_size": 8, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
}


def _layout(is_causal=None, nested=None):
    raw = dict(BASE, dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2]})
    if is_causal is not None:
        raw["is_causal"] = is_causal
    if nested is not None:
        raw["dflash_config"]["causal"] = nested
    return attention_layout(parse_draft_config(raw, "ckpt/config.json"))


def test_undeclared_sliding_layers_are_causal_and_full_layers_are_not():
    sliding, full = _layout()
    assert (sliding.causal_in_block, full.causal_in_block) == (True, False)
    assert "undeclared" in sliding.rule and "SGLang" in sliding.rule


@pytest.mark.parametrize("value", [True, False])
def test_top_level_is_causal_overrides_every_layer(value):
    layers = _layout(is_causal=value)
    assert {layer.causal_in_block for layer in layers} == {value}
    assert all(layer.rule == f"declared is_causal={str(value).lower()}" for layer in layers)


def test_dflash_config_causal_counts_only_where_is_causal_is_absent():
    assert all(l.rule == "declared dflash_config.causal=false" for l in _layout(nested=False))
    assert all(l.causal_in_block for l in _layout(is_causal=True, nested=True))


def test_a_contradiction_between_the_two_keys_is_refused():
    with pytest.raises(ConfigError, match="'is_causal' is true but 'dflash_config.causal' is false"):
        _layout(is_causal=True, nested=False)
