"""A Qwen3-MoE target step of vt rows against the read floor of the weights it touched.

Random weights at a published shape (built in memory, no checkpoint), one process: the step's
time for vt = 1..16 (median of --iters, device synchronised), the experts it ran per sparse
layer (counted by the target), the bytes those weights hold (attention, router, dense MLPs,
lm_head, and the measured expert union), the read bandwidth measured in the same process (a
large tensor's sum), and the ratio of time to that floor. This times memra's torch MoE op: the
few-row kernel is what should bring the ratio toward 1.

    python benchmarks/moe_step.py --shape a3b --device cuda --dtype bfloat16 --json OUT.json
    python benchmarks/moe_step.py --shape tiny --device cpu --iters 1   # the CPU smoke test's run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


from memra_cli.engine.formats.config import parse_target_config
from memra_cli.engine.models.qwen3 import LayerWeights
from memra_cli.engine.models.qwen3_moe import MoeLayerWeights, MoeWeights, Qwen3MoeTarget, parse_moe
from memra_cli.engine.spec.priced import step_cost_of

SHAPES = {  # config.json keys (Qwen3-30B-A3B's published shape; a tiny one for the smoke test)
    "a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=768),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
}


def build(shape: str, dtype: torch.dtype, device: torch.device) -> Qwen3MoeTarget:
    """A random-weight target (N(0, 0.02) weights, unit norms)."""
    raw = {**SHAPES[shape], "model_type": "qwen3_moe", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "norm_topk_prob": True, "tie_word_embeddings": False}
    cfg = parse_target_config({**raw, "model_type": "qwen3"}, f"<{shape}>")
    moe = parse_moe(raw, f"<{shape}>", cfg.num_hidden_layers)
    h, hd, e, i = cfg.hidden_size, cfg.head_dim, moe.num_experts, moe.moe_intermediate_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rand(*s):
        return (torch.randn(*s, dtype=dtype, device=device) * 0.02)

    ones = lambda n: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    layers = []
    for _ in range(cfg.num_hidden_layers):
        base = LayerWeights(wqkv=rand((nq + 2 * nkv) * hd, h), bqkv=None, wo=rand(h, nq * hd), bo=None,
                            q_norm=ones(hd), k_norm=ones(hd), attn_norm=ones(h), mlp_norm=ones(h),
                            w_gate_up=torch.empty(0), w_down=torch.empty(0))
        experts = MoeWeights(rand(e, h), rand(e, 2 * i, h), rand(e, h, i))
        layers.append(MoeLayerWeights(**vars(base), experts=experts))
    return Qwen3MoeTarget(cfg, moe, rand(cfg.vocab_size, h), layers, ones(h), rand(cfg.vocab_size, h))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes per second of a sum over a `nbytes` float32 tensor (median of `iters`)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(iters + 1):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


@torch.no_grad()
def measure(model: Qwen3MoeTarget, vt: int, context: int, iters: int) -> dict:
    """Median ms of one vt-row step at `context` cached positions, and the experts it ran."""
    dev = model.device
    cache = model.new_state(context + vt)
    model.ensure_positions(cache.max_len)
    cache.length = context
    ids = torch.randint(0, model.cfg.vocab_size, (vt,), device=dev)
    positions = torch.arange(context, context + vt, device=dev)
    times, before = [], list(model.expert_reads)
    for _ in range(iters + 1):
        sync(dev)
        t0 = time.perf_counter()
        model.static_step(ids, positions, cache)
        sync(dev)
        times.append(time.perf_counter() - t0)
    calls, experts = model.expert_reads[0] - before[0], model.expert_reads[1] - before[1]
    return {"vt": vt, "ms": 1e3 * statistics.median(times[1:]), "experts_per_layer": experts / calls}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--vts", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    model = build(a.shape, dtype, dev)
    cost = step_cost_of(model)
    bw = read_bandwidth(dev, 1 << (32 if dev.type == "cuda" else 26), a.iters)
    rows = []
    for vt in (int(v) for v in a.vts.split(",")):
        r = measure(model, vt, a.context, a.iters)
        floor = cost.fixed_bytes + cost.sparse_layers * r["experts_per_layer"] * cost.expert_bytes
        r.update(floor_gb=floor / 1e9, floor_ms=1e3 * floor / bw, ratio=r["ms"] / (1e3 * floor / bw),
                 model_union=cost.expected_union(vt))
        rows.append(r)
        print(f"vt={vt:2d}  {r['ms']:8.3f} ms  experts/layer {r['experts_per_layer']:6.1f} "
              f"(independent {r['model_union']:6.1f})  floor {r['floor_gb']:.3f} GB {r['floor_ms']:.3f} ms  "
              f"x{r['ratio']:.2f}")
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    out = {"shape": a.shape, "device": str(dev), "dtype": a.dtype, "context": a.context, "iters": a.iters,
           "read_tbps": bw / 1e12, "peak_gib": peak, "rows": rows,
           "command": "python benchmarks/moe_step.py " + " ".join(argv)}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
