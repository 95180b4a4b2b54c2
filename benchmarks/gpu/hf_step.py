"""transformers' own decode at a published target shape: ms per token and peak memory, the
yardstick the target-family issues put beside memra's step (target_step.py, gemma4_step.py,
moe_step.py).

Builds the Hugging Face model of `--shape` from its config alone (random init, no checkpoint) in
`--dtype` on `--device`, prefills `--context` random ids with transformers' default cache, then
times `--iters` one-token decode forwards (greedy: each step feeds the previous step's argmax),
eagerly, device synchronised around each: the median is `ms_per_token`. Shapes are the same ones
memra's scripts build (each imported from there, so the two cannot drift):

- `llama-8b`: LLaMA-3.1-8B (gpu_shapes.SHAPES["llama-8b"], llama3 rope);
- `gemma4-31b`: the Gemma 4 31B text shape (gemma4_step.GEMMA4_31B, published key layout);
- `qwen3-30b-a3b`: Qwen3-30B-A3B (moe_step.SHAPES["a3b"]);
- `tiny-llama`, `tiny-gemma4`, `tiny-moe`: small ones of each family for the CPU smoke test.

    python -m benchmarks.gpu.hf_step --shape llama-8b --json OUT.json
    python -m benchmarks.gpu.hf_step --shape tiny-gemma4 --device cpu --dtype float32 --iters 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from memra_cli.hf_compat import protect_kernels_name


def _llama(s: dict) -> dict:
    return {"model_type": "llama", "vocab_size": s["vocab"], "hidden_size": s["hidden"],
            "intermediate_size": s["ffn"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"], "head_dim": s["hd"], "max_position_embeddings": s.get("max_pos", 40960),
            "rope_parameters": s["rope"], "tie_word_embeddings": False}


def _moe(s: dict) -> dict:
    return {**s, "model_type": "qwen3_moe", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "norm_topk_prob": True,
            "tie_word_embeddings": False}


def config_of(shape: str) -> dict:
    """config.json keys of `shape` (see the module docstring)."""
    from benchmarks import moe_step
    from benchmarks.gpu import gemma4_step
    from benchmarks.gpu_shapes import SHAPES

    builders = {"llama-8b": lambda: _llama(SHAPES["llama-8b"]), "tiny-llama": lambda: _llama(SHAPES["llama-small"]),
                "gemma4-31b": lambda: gemma4_step.gemma4_raw(gemma4_step.GEMMA4_31B),
                "tiny-gemma4": lambda: gemma4_step.gemma4_raw(gemma4_step.SMALL),
                "qwen3-30b-a3b": lambda: _moe(moe_step.SHAPES["a3b"]),
                "tiny-moe": lambda: _moe(moe_step.SHAPES["tiny"])}
    return builders[shape]()


SHAPE_NAMES = ("llama-8b", "gemma4-31b", "qwen3-30b-a3b", "tiny-llama", "tiny-gemma4", "tiny-moe")


def build(raw: dict, dtype: torch.dtype, device: torch.device):
    """transformers' causal LM for config keys `raw`, randomly initialised on `device`."""
    protect_kernels_name()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values: the name every 5.x reads
    keys = {k: v for k, v in raw.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(raw["model_type"], **keys)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_ms(model, vocab: int, context: int, iters: int, device: torch.device) -> list[float]:
    """ms of each of `iters` one-token decode forwards after a `context`-token prefill (the first
    two steps untimed)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=g).to(device)
    out = model(input_ids=ids, use_cache=True)
    past, times = out.past_key_values, []
    for step in range(iters + 2):
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        sync(device)
        if step >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
        past = out.past_key_values
    return times


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPE_NAMES, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {a.device}: CUDA is not available here (use --device cpu with a tiny shape)",
              file=sys.stderr)
        return 2
    raw = config_of(a.shape)
    t0 = time.perf_counter()
    model = build(raw, dtype, device)
    built_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = decode_ms(model, raw["vocab_size"], a.context, a.iters, device)
    out = {"shape": a.shape, "model": type(model).__name__, "device": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "dtype": a.dtype, "context": a.context, "iters": a.iters,
           "ms_per_token": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "build_s": built_s,
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "config": raw, "command": "python -m benchmarks.gpu.hf_step " + " ".join(argv)}
    print(f"{a.shape}: transformers {out['model']} {out['ms_per_token']:.3f} ms/token (median of {a.iters}, "
          f"context {a.context}), {out['params_b']:.2f} B params"
          + (f", peak {out['peak_gib']:.1f} GiB" if out["peak_gib"] is not None else ""), flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
