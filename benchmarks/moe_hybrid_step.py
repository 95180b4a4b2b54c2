"""A Qwen3.5 MoE hybrid target step of vt rows against the read floor of the weights it touched,
on the torch step ops (the MoE twin) and on the Triton step ops (the MoE kernels), side by side.

`benchmarks/moe_step.py`'s measurement at the Qwen3.5-35B-A3B shape (random weights built in
memory, one process): per step-ops variant (`--ops`: `torch`, `triton`, `triton-unfused` (the
step ops' launch fusions undone: the A/B of the layer end in the combine); torch and triton by
default on CUDA, the twin alone elsewhere), a context prefilled, then a fixed step of vt rows for vt = 1..16 (median of
--iters eager steps, device synchronised; the step only reads the committed recurrent state, so
it can repeat) and, on CUDA with the kernels, the same step replayed as a CUDA graph (what the
engine runs: the family is capturable); the experts it ran per layer (counted by the target over
the eager steps), the weight bytes it read (every non-expert weight, counted from the loaded
tensors, plus the measured expert union), the read bandwidth measured in the same process, and
the ratio of time to that floor, with peak memory. Each vt below `--width` (16) is also timed as
the `--width`-row step with vt live rows (the engine's fixed-width step, its padding rows skipping
the recurrence and the experts). `--profile` (CUDA): per Triton variant, one eager `--width`-row
step at 1 and `--width` live rows under the torch profiler, its kernels grouped by name (the
fused / unfused A/B kernel by kernel).

    python -m benchmarks.moe_hybrid_step --shape a3b --device cuda --dtype bfloat16 --json OUT.json
    python -m benchmarks.moe_hybrid_step --shape tiny --device cpu --iters 1   # the CPU smoke test's run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.moe_step import graphed_ms, parse_ops, read_bandwidth, step_ops, step_rows, sync, variant_knobs
from memra_cli.engine.formats.qwen3_5_config import FULL, parse_qwen35_config
from memra_cli.engine.models.qwen3_5 import AttnWeights, GdnWeights, LayerWeights
from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeLayerWeights, Qwen35MoeTarget
from memra_cli.engine.models.qwen3_moe import MoeWeights
from memra_cli.engine.spec.priced import step_cost_of

SHAPES = {  # config.json text keys: Qwen3.5-35B-A3B's published shape; a tiny one for the smoke test
    "a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, full_attention_interval=4),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, full_attention_interval=2),
}


def build(shape: str, dtype: torch.dtype, device: torch.device) -> Qwen35MoeTarget:
    """A random-weight target (N(0, 0.02) weights, unit norms, DeltaNet decays in a sane range)."""
    cfg = parse_qwen35_config({**SHAPES[shape], "model_type": "qwen3_5_moe_text", "max_position_embeddings": 4096,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}},
                              f"<{shape}>")
    h, e, i, s = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size, \
        cfg.moe.shared_expert_intermediate_size
    nh, nkv, hd, hv = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads

    def rand(*size):
        return torch.randn(*size, dtype=dtype, device=device) * 0.02

    def f32(*size, fill=1.0):
        return torch.full(size, fill, dtype=torch.float32, device=device)

    layers = []
    for kind in cfg.layer_types:
        base = LayerWeights(kind=kind, attn_norm=f32(h), mlp_norm=f32(h), w_gate_up=rand(2 * s, h), w_down=rand(h, s))
        if kind == FULL:
            base.attn = AttnWeights(rand((2 * nh + 2 * nkv) * hd, h), None, rand(h, nh * hd), None, f32(hd), f32(hd))
        else:
            base.gdn = GdnWeights(rand(cfg.conv_dim + cfg.value_dim + 2 * hv, h),
                                  torch.randn(cfg.conv_dim, cfg.linear_conv_kernel_dim, device=device) * 0.5,
                                  f32(hv, fill=-1.0), f32(hv, fill=0.0),
                                  torch.ones(cfg.linear_value_head_dim, dtype=dtype, device=device),
                                  rand(h, cfg.value_dim))
        layers.append(Qwen35MoeLayerWeights(**vars(base), experts=MoeWeights(rand(e, h), rand(e, 2 * i, h),
                                                                             rand(e, h, i)), shared_gate=rand(1, h)))
    return Qwen35MoeTarget(cfg, rand(cfg.vocab_size, h), layers, f32(h), rand(cfg.vocab_size, h), rollback="replay")


@torch.no_grad()
def measure(model: Qwen35MoeTarget, state, context: int, vt: int, iters: int, width: int | None = None,
            reads: int | None = None) -> dict:
    """Median ms of one vt-row fixed step after `context` committed positions, and the experts it
    ran; `width`: a step of that many rows, the first vt live; `reads`: only that many rows read
    (the plain decode round's step) (`moe_step.measure`'s)."""
    dev = model.device
    rows = width or vt
    state.set_live_rows(vt if vt < rows else None)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), device=dev)
    positions = torch.arange(context, context + rows, device=dev)

    def step():
        with state.reading_rows(reads) if reads else contextlib.nullcontext():
            return model.static_step(ids, positions, state)

    times, before = [], list(model.expert_reads)
    for _ in range(iters + 1):
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    calls, experts = model.expert_reads[0] - before[0], model.expert_reads[1] - before[1]
    row = {"vt": vt, "width": width, "ms": 1e3 * statistics.median(times[1:]), "experts_per_layer": experts / calls}
    if dev.type == "cuda" and model.step_ops.name == "triton":  # a captured twin runs every expert: not timed
        row["graph_ms"], row["graph_error"] = graphed_ms(step, iters)
    if reads is not None:
        row["reads"] = reads
    return row


@torch.no_grad()
def profile_steps(model: Qwen35MoeTarget, state, name: str, context: int, width: int) -> list[dict]:
    """`timing.kernel_table` of one eager `width`-row step at 1 and `width` live rows, printed;
    programmatic dependent launch off meanwhile (each kernel charged its own time, not its wait)."""
    import os

    from benchmarks.timing import kernel_table

    dev, out, before = model.device, [], os.environ.get("MEMRA_PDL")
    ids = torch.randint(0, model.cfg.vocab_size, (width,), device=dev)
    positions = torch.arange(context, context + width, device=dev)
    os.environ["MEMRA_PDL"] = "0"
    try:
        for live in sorted({1, width}):
            state.set_live_rows(live if live < width else None)
            prof = {"ops": name, "live": live, "width": width,
                    **kernel_table(lambda: model.static_step(ids, positions, state), top=40)}
            out.append(prof)
            print(f"profile {name} width {width}, {live} live: {prof['kernels']} kernels, {prof['gpu_us']:.1f} us GPU")
            for kernel, count, us in prof["top"]:
                print(f"   {us:9.1f} us  x{count:4d}  {kernel}")
    finally:
        if before is None:
            os.environ.pop("MEMRA_PDL", None)
        else:
            os.environ["MEMRA_PDL"] = before
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--vts", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--ops", default=None, help="step-ops variants, comma-separated: torch, triton, "
                    "triton-unfused (the launch fusions undone), triton-route4w (256-expert routing tiles on "
                    "4 warps) (default: torch and triton on CUDA, torch elsewhere)")
    ap.add_argument("--width", type=int, default=16, help="also time each vt below it as a step of this many "
                    "rows, vt of them live (the engine's fixed-width step); 0: only the vt-row steps")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also profile one eager --width-row step's kernels "
                    "at 1 and --width live rows, per Triton variant (CUDA)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    ops = parse_ops(a.ops, dev)
    if ops is None:
        print(f"error: --ops {a.ops!r}: expected torch and/or triton (triton needs --device cuda)", file=sys.stderr)
        return 2
    if a.profile and (dev.type != "cuda" or not any(o.startswith("triton") for o in ops) or a.width < 1):
        print("error: --profile: needs --device cuda, a triton variant in --ops and --width >= 1", file=sys.stderr)
        return 2
    if not 0 <= a.width <= 16:
        print(f"error: --width {a.width}: expected a row count in [0, 16] (0: only the vt-row steps)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build(a.shape, dtype, dev)
    cost = step_cost_of(model)
    bw = read_bandwidth(dev, 1 << (32 if dev.type == "cuda" else 26), a.iters)
    prompt = torch.randint(0, model.cfg.vocab_size, (a.context,), device=dev)
    rows, profiles = [], []
    for name in ops:
        model.step_ops = step_ops(name)
        state = model.new_state(a.context + 16)
        with torch.no_grad(), variant_knobs(name):
            model.forward(prompt, 0, state)
            rows += step_rows(model, name, [int(v) for v in a.vts.split(",")], a.width, cost, bw,
                              lambda vt, w, reads: measure(model, state, a.context, vt, a.iters, w, reads))
            if a.profile and name.startswith("triton"):
                profiles += profile_steps(model, state, name, a.context, a.width)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    out = {"shape": a.shape, "device": str(dev), "dtype": a.dtype, "context": a.context, "iters": a.iters,
           "read_tbps": bw / 1e12, "peak_gib": peak, "fixed_gb": cost.fixed_bytes / 1e9, "rows": rows,
           "profiles": profiles,
           "command": "python -m benchmarks.moe_hybrid_step " + " ".join(argv)}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
