"""Drafter tensor names: the one list every reader, writer and policy uses.

Layer tensors sit under `layers.{i}.`; the optional heads are DeepSpec's (markov, confidence)
and its copies of the target's embedding / lm_head.
"""

LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
MARKOV_W1 = "markov_head.markov_w1.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"
CONF_W = "confidence_head.proj.weight"
CONF_B = "confidence_head.proj.bias"
OWN_EMBED = "embed_tokens.weight"
OWN_LM_HEAD = "lm_head.weight"
