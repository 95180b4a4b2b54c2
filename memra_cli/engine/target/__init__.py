"""Target models the round loop verifies with (one module per HF `model_type`)."""

from memra_cli.engine.target.greedy import greedy_reference
from memra_cli.engine.target.qwen3 import KVCache, PromptError, Qwen3Target

__all__ = ["KVCache", "PromptError", "Qwen3Target", "greedy_reference"]
