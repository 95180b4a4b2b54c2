"""A Qwen3-MoE target step of vt rows against the read floor of the weights it touched, on the
torch expert op (the twin) and on memra's few-row MoE kernels, side by side in one process.

Random weights at a published shape (built in memory, no checkpoint), one process:

- the step (`static_step`) for vt = 1..16 with each step-ops variant (`--ops`: `torch` = the
  twin and torch ops, `triton` = the Triton step ops with the MoE kernels, `triton-unfused` =
  those with the step's launch fusions undone, `TritonStepOps.unfused()`: the A/B of the MoE
  combine's residual add + norm, and of the embedding + first norm; `triton-a3b-cublas` = the
  kernels with the A3B q/k/v and lm_head on cuBLAS, the q/k/v's rope a launch of its own,
  `A3B_DENSE_SHAPES`: the A/B of their place in `dense_linear.TUNED`; `triton-unrouted` = the
  kernels with the expert matmuls' grid over every expert in expert order, `moe.TAKE_ROUTED`
  off: the A/B of the router's ranked list): median ms of eager
  steps (device synchronised), and on CUDA with the kernels the step replayed as a CUDA graph
  (a captured twin runs every expert, so it has no graphed number); each step of vt rows alone
  and, for vt below `--width` (16), the `--width`-row step with vt live rows and the rest
  padding, which is what the engine's fixed-width steps run (`ops` "triton/16" in the table);
- the MoE feed-forward alone, every sparse layer once per call (each layer its own weights, so
  no expert is read from L2 twice): the twin eager, the kernels eager and as a CUDA graph (and
  graphed over each layer's ranked expert list, as a step's router hands it over), the ratio
  twin / kernels, and the kernels' graphed time against the read floor of the experts the rows
  routed to; and the routing alone from the router logits (the twin's ~14 launches eager
  and graphed, the routing kernel's one graphed), and from x with the router's matmul (the
  step ops' `linear` then the routing kernel, against `router_route`'s one launch, graphed, and
  with `--router-chunks` that launch at other hidden chunks), per layer;
- per step: the experts run per sparse layer (counted by the target), the bytes those weights
  hold (attention, router, dense MLPs, lm_head, and the measured expert union), the read
  bandwidth measured in the same process (a large tensor's sum), the ratio of time to that
  floor, and peak memory;
- with `--profile` (CUDA, Triton ops): where one eager `--width`-row step's GPU time goes, at 1
  live row and at `--width` live rows, for `triton` and `triton-unrouted` where `--ops` has
  them: its kernels under the torch profiler grouped by name (count, summed µs;
  `timing.kernel_table`), with programmatic dependent launch off so each kernel is charged its
  own time.

    python -m benchmarks.moe_step --shape a3b --device cuda --dtype bfloat16 --json OUT.json
    python benchmarks/moe_step.py --shape tiny --device cpu --iters 1   # the CPU smoke test's run
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


# `triton-a3b-cublas`: the Qwen3-30B-A3B q/k/v and lm_head, which dense_linear.TUNED puts on the
# dense kernel (the q/k/v's rope in its epilogue), back on cuBLAS: the A/B that keeps them there
# (docs/moe.md#the-a3b-weights-on-the-dense-kernel)
A3B_DENSE_SHAPES = ((5120, 2048), (151936, 2048))


def step_ops(name: str):
    """The step-ops variant `name`: `torch` (the twin), `triton` (the MoE kernels; CUDA),
    `triton-unfused` (those with the launch fusions undone), `triton-route4w` (the kernels with
    every routing tile on at most 4 warps), `triton-a3b-cublas` (the kernels with
    `A3B_DENSE_SHAPES`' weights on cuBLAS) or `triton-unrouted` (the expert matmuls' grid over
    every expert, not the router's ranked list first); run the last three inside `variant_knobs`."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    if name == "torch":
        return TorchStepOps()
    return TritonStepOps().unfused() if name == "triton-unfused" else TritonStepOps()


@contextlib.contextmanager
def variant_knobs(name: str):
    """The kernels' module constants a variant changes, set for its steps and restored after:
    `triton-route4w` routes a 256-expert tile on 4 warps (32 logits a thread, the layout that
    spilled) instead of `route_warps`' 8 (docs/moe.md, "Measured: the Qwen3.5-35B-A3B step");
    `triton-a3b-cublas` takes `A3B_DENSE_SHAPES` out of `dense_linear.TUNED` (so `F.linear` runs
    them, and the q/k/v's rope is a launch of its own); `triton-unrouted` has the expert matmuls
    ignore the router's ranked list (`moe.TAKE_ROUTED` off: the grid over every expert in expert
    order, the A/B of the routed experts' programs first; docs/moe.md#the-expert-kernels)."""
    from memra_kernels import dense_linear, moe, moe_route

    saved, table, routed = moe_route.TILE_PER_THREAD, dict(dense_linear.TUNED), moe.TAKE_ROUTED
    if name == "triton-unrouted":
        moe.TAKE_ROUTED = False
    if name == "triton-route4w":
        moe_route.TILE_PER_THREAD = moe_route.BLOCK_T * 256 // (32 * 4)  # a 256-expert tile on 4 warps
    if name == "triton-a3b-cublas":
        for shape in A3B_DENSE_SHAPES:
            dense_linear.TUNED.pop(shape, None)
    try:
        yield
    finally:
        moe_route.TILE_PER_THREAD = saved
        moe.TAKE_ROUTED = routed
        dense_linear.TUNED.clear()
        dense_linear.TUNED.update(table)


def graphed_ms(fn, iters: int) -> tuple[float | None, str | None]:
    """`timing.graph_ms` of `fn`, or the capture's error in one line (the torch op reads on the host)."""
    from benchmarks.timing import graph_ms

    try:
        return graph_ms(fn, iters), None
    except Exception as exc:  # a capture refused: recorded, the other numbers still come
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def one_step(model: Qwen3MoeTarget, rows: int, live: int, context: int, reads: int | None = None):
    """A step of `rows` random ids, the first `live` real, at `context` cached positions: a
    callable that runs it (the same state and inputs each call). `reads`: only that many first
    rows are read (`state.reading_rows`: the plain decode round's step, 1)."""
    dev = model.device
    cache = model.new_state(context + rows)
    model.ensure_positions(cache.max_len)
    cache.length = context
    cache.set_live_rows(live if live < rows else None)
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), device=dev)
    positions = torch.arange(context, context + rows, device=dev)
    if reads is None:
        return lambda: model.static_step(ids, positions, cache)

    def step():
        with cache.reading_rows(reads):
            return model.static_step(ids, positions, cache)

    return step


@torch.no_grad()
def measure(model: Qwen3MoeTarget, vt: int, context: int, iters: int, width: int | None = None,
            reads: int | None = None) -> dict:
    """Median ms of one vt-row step at `context` cached positions, and the experts it ran.
    `width`: a step of `width` rows whose first vt are live, the rest padding (what the engine's
    fixed-width steps run: `state.set_live_rows`); None: a step of the vt rows alone. `reads`:
    only that many rows read (the plain decode round's step: `width` rows, 1 live, 1 read)."""
    dev = model.device
    step = one_step(model, width or vt, vt, context, reads)
    times, before = [], model.expert_reads
    for _ in range(iters + 1):
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    after = model.expert_reads
    calls, experts = after[0] - before[0], after[1] - before[1]
    row = {"vt": vt, "width": width, "ms": 1e3 * statistics.median(times[1:]), "experts_per_layer": experts / calls}
    if reads is not None:
        row["reads"] = reads
    if dev.type == "cuda" and model.step_ops.name == "triton":
        row["graph_ms"], row["graph_error"] = graphed_ms(step, iters)
    return row


@torch.no_grad()
def profile_step(model: Qwen3MoeTarget, live: int, width: int, context: int) -> dict:
    """`timing.kernel_table` of one eager `width`-row step with `live` live rows at `context`."""
    from benchmarks.timing import kernel_table

    return {"live": live, "width": width, **kernel_table(one_step(model, width, live, context), top=40)}


def step_rows(model, name: str, vts: list[int], width: int, cost, bw: float, measure_one) -> list[dict]:
    """Per vt, the step of the vt rows alone and, below `width` (0: none), the `width`-row step
    with vt live rows (a verify's), and at vt = 1 that step with one row read (the plain decode
    round's: `reading_rows(1)`, "NAME/16 plain"), each with its read floor; printed as they
    come. `measure_one(vt, width or None, reads)` times one (`measure`'s row)."""
    rows = []
    for vt in vts:
        shapes = [(None, None)] + ([(width, None)] if 0 < vt < width else []) + \
            ([(width, 1)] if vt == 1 and width > 1 else [])
        for w, reads in shapes:
            r = with_floor({"ops": name, **measure_one(vt, w, reads)}, cost, bw, vt)
            rows.append(r)
            print(step_line(name if w is None else f"{name}/{w}" + (" plain" if reads else ""), vt, r))
    return rows


def parse_tiles(raw: str):
    """`--tiles` "IxNxKxWxS[xP],..." (block_i, block_n, block_k, warps, stages, and the matmuls'
    programs per multiprocessor: 0 for a program per (expert, tile); `moe.CONFIG`'s when left
    out) -> MoeConfigs."""
    from memra_kernels.moe import CONFIG, MoeConfig

    out = []
    for item in raw.split(","):
        fields = [int(v) for v in item.split("x")]
        if len(fields) not in (5, 6):
            raise ValueError(f"{item!r} has {len(fields)} fields, not 5 or 6")
        i, n, k, w, s = fields[:5]
        per_sm = fields[5] if len(fields) == 6 else CONFIG.programs_per_sm
        out.append(MoeConfig(block_i=i, block_n=n, block_k=k, num_warps=w, num_stages=s,
                             programs_per_sm=per_sm).check())
    return out


def parse_router_chunks(raw: str) -> list[int] | None:
    """`--router-chunks` "256,512" -> [256, 512] ([] when empty); None when a field is not a power
    of two >= 16 (the kernel's tile width)."""
    try:
        chunks = [int(c) for c in raw.split(",")] if raw else []
    except ValueError:
        return None
    return chunks if all(c >= 16 and c & (c - 1) == 0 for c in chunks) else None


def tiles_name(cfg) -> str:
    return f"{cfg.block_i}x{cfg.block_n}x{cfg.block_k}x{cfg.num_warps}x{cfg.num_stages}x{cfg.programs_per_sm}"


# The router launch's A/B (memra_kernels.moe_route's knobs, set before each capture): its row tiles
# unrolled or looped, at Triton's default pipeline stages and at one (docs/moe.md#the-routing-kernel)
ROUTER_FORMS = {"unrolled": (True, None), "looped": (False, None), "unrolled/1stage": (True, 1),
                "looped/1stage": (False, 1)}


def router_forms(x: torch.Tensor, routers, moe, counts: torch.Tensor, iters: int, width: int = 16) -> dict:
    """The router's one launch graphed (µs a layer) in each of ROUTER_FORMS, over `x`'s rows alone
    and as a `width`-row step with those rows live (what the engine runs): `{form: {"rows": us,
    "width": us}}`, an error string in place of a number where a capture failed."""
    from memra_kernels import moe_route as mr
    from memra_kernels.moe_route import router_route

    vt = x.shape[0]
    wide = torch.cat([x, torch.zeros(width - vt, x.shape[1], dtype=x.dtype, device=x.device)]) if vt < width else x
    live = torch.tensor([vt], dtype=torch.int32, device=x.device)
    kept = mr.STATIC_ROW_TILES, mr.ROUTER_STAGES
    out = {}
    try:
        for form, (static, stages) in ROUTER_FORMS.items():
            mr.STATIC_ROW_TILES, mr.ROUTER_STAGES = static, stages
            out[form] = {}
            for name, rows, lv in (("rows", x, None), ("width", wide, live)):
                ms, err = graphed_ms(lambda: [router_route(rows, r, moe.top_k, moe.norm_topk_prob, lv, counts)
                                              for r in routers], iters)
                out[form][name] = err if ms is None else 1e3 * ms / len(routers)
    finally:
        mr.STATIC_ROW_TILES, mr.ROUTER_STAGES = kept
    return out


@torch.no_grad()
def measure_op(model: Qwen3MoeTarget, vt: int, iters: int, bw: float, tiles=(), router_chunks=()) -> dict:
    """The MoE feed-forward alone over every sparse layer (its own weights and routing, one
    random normed input of vt rows): ms per layer of the twin (eager) and of the kernels (eager
    and graphed), and the kernels' graphed time against the read floor of the routed experts;
    with `tiles`, the kernels' graphed time at each of those tile configurations too; with
    `router_chunks`, the router's one launch graphed at each of those hidden chunks."""
    from benchmarks.timing import median_ms
    from memra_cli.engine.layers.moe import route
    from memra_kernels.moe import moe_swiglu
    from memra_kernels.moe_ref import moe_swiglu_ref
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps
    from memra_cli.engine.layers.unfused import unfused_router_route
    from memra_kernels import moe_route as mr
    from memra_kernels.moe_route import moe_route, router_route
    from memra_kernels.moe_route_ref import moe_route_ref, routed_experts_ref

    dev, moe = model.device, model.moe
    x = torch.nn.functional.rms_norm(torch.randn(vt, model.cfg.hidden_size, device=dev), (model.cfg.hidden_size,))
    x = x.to(model.dtype)
    calls, union, lists = [], 0, []
    for ex in (layer.experts for layer in model.layers if layer.experts is not None):
        weights, ids = route(x, ex.router, moe.top_k, moe.norm_topk_prob)
        union += int(torch.unique(ids).numel())
        calls.append((weights, ids, ex.w_gate_up, ex.w_down))
        lists.append(routed_experts_ref(ids, moe.num_experts))  # what the router's launch ranks in a step

    def every_layer(op):
        return lambda: [op(x, *c) for c in calls]

    def every_layer_routed(op):  # the matmuls over each layer's ranked list (the step's form)
        return lambda: [op(x, *c, routed=r) for c, r in zip(calls, lists)]

    n = len(calls)
    routers = [layer.experts.router for layer in model.layers if layer.experts is not None]
    logits = [torch.nn.functional.linear(x, r) for r in routers]
    counts = torch.zeros(2, dtype=torch.int64, device=dev)

    def route_every_layer(op):  # the router's picks and the count from its logits, every sparse layer
        return lambda: [op(lg, moe.top_k, moe.norm_topk_prob, None, counts) for lg in logits]

    expert_bytes = 3 * moe.moe_intermediate_size * model.cfg.hidden_size * model.dtype.itemsize
    floor_us = 1e6 * union * expert_bytes / bw / n
    row = {"vt": vt, "experts_per_layer": union / n, "floor_us": floor_us,
           "twin_us": 1e3 * median_ms(every_layer(moe_swiglu_ref), iters, warmup=1, device=dev) / n,
           "route_twin_us": 1e3 * median_ms(route_every_layer(moe_route_ref), iters, warmup=1, device=dev) / n}
    if dev.type == "cuda":
        row["kernel_us"] = 1e3 * median_ms(every_layer(moe_swiglu), iters, warmup=1, device=dev) / n
        graph, row["kernel_graph_error"] = graphed_ms(every_layer(moe_swiglu), iters)
        row["kernel_graph_us"] = None if graph is None else 1e3 * graph / n
        row["twin_over_kernel"] = row["twin_us"] / row["kernel_us"]
        if graph is not None:
            row["kernel_graph_over_floor"] = row["kernel_graph_us"] / floor_us
        graph, err = graphed_ms(every_layer_routed(moe_swiglu), iters)
        row["kernel_routed_graph_us"] = err if graph is None else 1e3 * graph / n
        for name, op in (("twin", moe_route_ref), ("kernel", moe_route)):  # graphed: launches, not bytes, cost here
            ms, err = graphed_ms(route_every_layer(op), iters)
            row[f"route_{name}_graph_us"] = err if ms is None else 1e3 * ms / n
        kernels = TritonStepOps()
        for name, op in (("router_unfused", lambda *a: unfused_router_route(kernels, *a)),
                         ("router_kernel", router_route)):  # from x: the router's matmul too, the A/B of the fusion
            ms, err = graphed_ms(lambda op=op: [op(x, r, moe.top_k, moe.norm_topk_prob, None, counts) for r in routers],
                                 iters)
            row[f"{name}_graph_us"] = err if ms is None else 1e3 * ms / n
        row["router_chunks_graph_us"] = {}
        kept = mr.ROUTER_CHUNK
        try:
            for chunk in router_chunks:  # the module constant, set before each capture (as TILES is)
                mr.ROUTER_CHUNK = chunk
                ms, err = graphed_ms(lambda: [router_route(x, r, moe.top_k, moe.norm_topk_prob, None, counts)
                                              for r in routers], iters)
                row["router_chunks_graph_us"][str(chunk)] = err if ms is None else 1e3 * ms / n
        finally:
            mr.ROUTER_CHUNK = kept
        row["router_forms_graph_us"] = router_forms(x, routers, moe, counts, iters)
        row["tiles_graph_us"], row["tiles_routed_graph_us"] = {}, {}
        for cfg in tiles:
            ms, err = graphed_ms(every_layer(lambda *a, cfg=cfg: moe_swiglu(*a, config=cfg)), iters)
            row["tiles_graph_us"][tiles_name(cfg)] = err if ms is None else 1e3 * ms / n
            ms, err = graphed_ms(every_layer_routed(lambda *a, cfg=cfg, **kw: moe_swiglu(*a, config=cfg, **kw)), iters)
            row["tiles_routed_graph_us"][tiles_name(cfg)] = err if ms is None else 1e3 * ms / n
    return row


OPS = ("torch", "triton", "triton-unfused", "triton-route4w", "triton-a3b-cublas", "triton-unrouted")
PROFILED = ("triton", "triton-unrouted")  # the variants `--profile` profiles, where `--ops` has them


def parse_ops(raw: str | None, dev: torch.device) -> list[str] | None:
    """`--ops` -> variants (None: refused); unset: both on CUDA, the twin alone elsewhere (the
    kernels need CUDA)."""
    ops = (["torch", "triton"] if dev.type == "cuda" else ["torch"]) if raw is None else raw.split(",")
    if any(o not in OPS for o in ops) or (any(o != "torch" for o in ops) and dev.type != "cuda"):
        return None
    return ops



def with_floor(r: dict, cost, bw: float, vt: int) -> dict:
    """A step row `r` (its `ms`, `experts_per_layer`, optional `graph_ms`) with the read floor of
    the bytes it touched at `bw` bytes/s (fixed bytes + the expert union it ran), the ratios to it
    and the independent-routing union for `vt` rows."""
    floor = cost.fixed_bytes + cost.sparse_layers * r["experts_per_layer"] * cost.expert_bytes
    r.update(floor_gb=floor / 1e9, floor_ms=1e3 * floor / bw, ratio=r["ms"] / (1e3 * floor / bw),
             model_union=cost.expected_union(vt))
    if r.get("graph_ms"):
        r["graph_ratio"] = r["graph_ms"] / r["floor_ms"]
    return r


def step_line(name: str, vt: int, r: dict) -> str:
    """One printed row of the step table (`with_floor`'s keys; a failed capture named)."""
    graphed = f"  graph {r['graph_ms']:8.3f} ms x{r['graph_ratio']:.2f}" if r.get("graph_ms") else (
        f"  graph failed: {r['graph_error']}" if r.get("graph_error") else "")
    return (f"{name:9s} vt={vt:2d}  {r['ms']:8.3f} ms  experts/layer {r['experts_per_layer']:6.1f} "
            f"(independent {r['model_union']:6.1f})  floor {r['floor_gb']:.3f} GB {r['floor_ms']:.3f} ms  "
            f"x{r['ratio']:.2f}{graphed}")

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--vts", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--ops", default=None, help="step-ops variants, comma-separated: torch, triton, triton-unfused, "
                    "triton-route4w, triton-a3b-cublas, triton-unrouted (default: torch and triton on CUDA, torch "
                    "elsewhere)")
    ap.add_argument("--tiles", default="", help="also time the graphed MoE kernels at these tile "
                    "configurations: comma-separated block_i x block_n x block_k x warps x stages [x programs per "
                    "multiprocessor, 0: a program per (expert, tile)], e.g. 64x64x128x4x3 or 64x64x128x4x3x0")
    ap.add_argument("--router-chunks", default="", help="also time the router's one launch, graphed, at these "
                    "hidden chunks (memra_kernels.moe_route.ROUTER_CHUNK; powers of two >= 16), comma-separated")
    ap.add_argument("--width", type=int, default=16, help="also time each vt below it as a step of this many "
                    "rows, vt of them live (the engine's fixed-width step); 0: only the vt-row steps")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also profile one eager --width-row step's "
                    "kernels at 1 and --width live rows (CUDA, Triton ops)")
    ap.add_argument("--dense-tuned", type=Path, default=None, help="the dense kernel's TUNED table from "
                    "this file (benchmarks/gpu/dense_linear_sweep.py --tuned) before any launch")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    ops = parse_ops(a.ops, dev)
    if ops is None:
        print(f"error: --ops {a.ops!r}: expected some of {', '.join(OPS)} (the triton ones need "
              "--device cuda)", file=sys.stderr)
        return 2
    try:
        tiles = parse_tiles(a.tiles) if a.tiles else []
    except ValueError as exc:
        print(f"error: --tiles {a.tiles!r}: {exc} (expected e.g. 64x64x128x4x3 or 64x64x128x4x3x0)", file=sys.stderr)
        return 2
    if tiles and dev.type != "cuda":
        print(f"error: --tiles {a.tiles!r}: the kernels need --device cuda", file=sys.stderr)
        return 2
    chunks = parse_router_chunks(a.router_chunks)
    if chunks is None:
        print(f"error: --router-chunks {a.router_chunks!r}: expected powers of two >= 16, comma-separated "
              "(e.g. 256,512,1024)", file=sys.stderr)
        return 2
    if chunks and dev.type != "cuda":
        print(f"error: --router-chunks {a.router_chunks!r}: the kernels need --device cuda", file=sys.stderr)
        return 2
    if a.profile and (dev.type != "cuda" or "triton" not in ops or a.width < 1):
        print("error: --profile: needs --device cuda, triton in --ops and --width >= 1", file=sys.stderr)
        return 2
    if a.width < 0:
        print(f"error: --width {a.width}: expected a row count (0: only the vt-row steps)", file=sys.stderr)
        return 2
    if a.dense_tuned:
        from memra_kernels import dense_linear

        try:
            dense_linear.load_tuned(a.dense_tuned)  # before any launch
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: --dense-tuned {a.dense_tuned}: {exc}", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    model = build(a.shape, dtype, dev)
    cost = step_cost_of(model)
    bw = read_bandwidth(dev, 1 << (32 if dev.type == "cuda" else 26), a.iters)
    vts = [int(v) for v in a.vts.split(",")]
    rows = []
    for name in ops:
        model.step_ops = step_ops(name)
        with variant_knobs(name):
            rows += step_rows(model, name, vts, a.width, cost, bw,
                              lambda vt, w, reads: measure(model, vt, a.context, a.iters, w, reads))
    op_rows = []
    for vt in vts:
        r = measure_op(model, vt, a.iters, bw, tiles, chunks)
        op_rows.append(r)
        kernel = "" if "kernel_us" not in r else (
            f"  kernels {r['kernel_us']:8.1f} us eager, "
            + (f"{r['kernel_graph_us']:8.1f} us graphed (x{r['kernel_graph_over_floor']:.2f} of the floor)"
               if r.get("kernel_graph_us") else "graph failed")
            + f"  twin/kernels x{r['twin_over_kernel']:.1f}")
        print(f"op vt={vt:2d}  experts/layer {r['experts_per_layer']:6.1f}  floor {r['floor_us']:7.1f} us  "
              f"twin {r['twin_us']:8.1f} us{kernel}")
        route = f"   routing: twin {r['route_twin_us']:7.1f} us eager"
        for name in ("twin", "kernel"):
            us = r.get(f"route_{name}_graph_us")
            if us is not None:
                route += f", {name} " + (f"{us:7.1f} us graphed" if isinstance(us, float) else us)
        for name, what in (("router_unfused", "from x: matmul + routing"), ("router_kernel", "one launch")):
            us = r.get(f"{name}_graph_us")
            if us is not None:
                route += f"; {what} " + (f"{us:7.1f} us graphed" if isinstance(us, float) else us)
        print(route)
        if "kernel_routed_graph_us" in r:
            us = r["kernel_routed_graph_us"]
            print("   kernels over the ranked list: " + (f"{us:8.1f} us graphed" if isinstance(us, float) else us))
        for name, us in r.get("tiles_graph_us", {}).items():
            ranked = r.get("tiles_routed_graph_us", {}).get(name)
            print(f"   tiles {name}: " + (f"{us:8.1f} us graphed" if isinstance(us, float) else us)
                  + ("" if ranked is None else ", ranked list " + (f"{ranked:8.1f} us" if isinstance(ranked, float)
                                                                   else ranked)))
        for name, us in r.get("router_chunks_graph_us", {}).items():
            print(f"   router chunk {name}: " + (f"{us:8.1f} us graphed" if isinstance(us, float) else us))
        for form, got in r.get("router_forms_graph_us", {}).items():
            print(f"   router {form}: " + ", ".join(
                f"{name} " + (f"{us:6.1f} us" if isinstance(us, float) else us) for name, us in got.items()))
    profiles = []
    if a.profile:
        import os

        os.environ["MEMRA_PDL"] = "0"  # each kernel charged its own time, not its early wait
        for variant in [o for o in ops if o in PROFILED]:
            model.step_ops = step_ops(variant)
            with variant_knobs(variant):
                for live in sorted({1, a.width}):
                    prof = {"ops": variant, **profile_step(model, live, a.width, a.context)}
                    profiles.append(prof)
                    print(f"profile {variant} width {a.width}, {live} live: {prof['kernels']} kernels, "
                          f"{prof['gpu_us']:.1f} us GPU")
                    for name, count, us in prof["top"]:
                        print(f"   {us:9.1f} us  x{count:4d}  {name}")
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    out = {"shape": a.shape, "device": str(dev), "dtype": a.dtype, "context": a.context, "iters": a.iters,
           "read_tbps": bw / 1e12, "peak_gib": peak, "rows": rows, "op_rows": op_rows, "profiles": profiles,
           "command": "python -m benchmarks.moe_step " + " ".join(argv)}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
