"""A tiny random Qwen3-MoE target (`model_type: qwen3_moe`), written without transformers.

It is the tiny Qwen3 target (tiny/target.py) with each sparse layer's dense MLP replaced by a
router and `experts` SwiGLU experts in the per-expert layout transformers saves; layer 1 stays
dense (`mlp_only_layers`), so both feed-forwards run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from memra_cli.tiny.target import make_tiny_qwen3


def make_tiny_qwen3_moe(directory: Path | str, *, experts: int = 8, top_k: int = 2, moe_intermediate: int = 32,
                        layers: int = 4, seed: int = 0, tokenizer: bool = False) -> Path:
    """Write a tiny random Qwen3MoeForCausalLM to `directory`; returns the directory."""
    out = make_tiny_qwen3(directory, layers=layers, seed=seed, tokenizer=tokenizer)
    cfg = json.loads((out / "config.json").read_text())
    dense = [1] if layers > 1 else []
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=dense)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    h = cfg["hidden_size"]
    for i in (i for i in range(layers) if i not in dense):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + name + ".weight"]
        tensors[p + "gate.weight"] = torch.randn(experts, h, generator=gen) / math.sqrt(h)
        for e in range(experts):
            for name, shape in (("gate_proj", (moe_intermediate, h)), ("up_proj", (moe_intermediate, h)),
                                ("down_proj", (h, moe_intermediate))):
                tensors[f"{p}experts.{e}.{name}.weight"] = torch.randn(*shape, generator=gen) / math.sqrt(shape[1])
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
