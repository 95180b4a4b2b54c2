"""LLaMA dense causal LM (HF `model_type: llama`, e.g. LLaMA-3.1-8B-Instruct).

The layer math is Qwen3's dense decoder (models/qwen3.py) with the family's switches read
from its config (formats/config.py): no per-head q/k RMSNorm (`cfg.qk_norm` false, so the
fixed step takes the step ops' `rope_kv_write`), `llama3` rope scaling in the rope tables
(layers/rope.py), an untied lm_head unless `tie_word_embeddings`. Projection biases
(`attention_bias`, `mlp_bias`) and activations other than SiLU are refused at config parse.

Numerics follow `transformers.LlamaForCausalLM`: the same RMSNorm, rope and lm_head roundings
as Qwen3's, minus the q/k norm.
"""

from __future__ import annotations

from memra_cli.engine.models.qwen3 import Qwen3Target


class LlamaTarget(Qwen3Target):
    """LlamaForCausalLM inference: Qwen3Target's decoder, loaded from a `llama` config (whose
    `qk_norm` is false, so no q/k norm weights are read or applied)."""

    model_type = "llama"
