#!/usr/bin/env python3
"""decode_attention on a GPU: one launch (FUSED_COMBINE) vs two, per tile set, Qwen3-8B shape.

Run on a CUDA machine (bf16):  python benchmarks/gpu/attention_tiles.py [--quick]

32 q / 8 kv heads, head_dim 128. For each tile set (SPLIT_KEYS, BLOCK_N, stages) of TILES and
each merge path (two launches: split kernel + combine kernel; one launch: the last split program
of a (row tile, KV head) merges):

1. exactness: one launch == two launches bit for bit (torch.equal) at live contexts 512 / 4096 /
   32768 and 1 / 16 rows (the merge is shared, so any difference is a bug: a race or a stale
   read); a stress pass replays one captured graph of many one-launch calls and compares every
   output with the two-launch result (a missing barrier or acquire shows up as rare mismatches);
2. row-count invariance of the one-launch path: each row of a 16-row step at random positions
   (split boundaries planted) == the same row alone, and CUDA-graph replay with positions
   rewritten in place == eager (the counters must be back at 0 after every replay);
3. timing: median GPU us per call from CUDA-graph replays of 36 calls over 36 distinct per-layer
   caches (K/V from HBM, as in a real step), rows 1 and 16, positions ending at the context;
   then a few merge shapes of the one-launch path at the module's tile set (they change no bits).

Every case is caught and reported on its own (one failure does not stop the others); a table at
the end, and JSON to $OUT/attention_tiles.json when OUT is set. Exit status 1 when any case
failed or any exactness / invariance check broke.

`--smoke` runs the script itself on the CPU through Triton's interpreter at toy sizes (eager
stand-ins for graphs, wall-clock "timings"): it checks the script, not the kernel's speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

N_HEADS, N_KV, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
CONTEXTS = (512, 4096, 32768)
ROWS = (1, 16)
N_LAYERS = 36
STRESS_KEYS, STRESS_CALLS = 4096, 64  # the graph stress pass: keys, calls per graph
INV_KEYS = 32768  # live keys of the row-alone-vs-step check
REPLAY_KEYS, REPLAY_STORAGE = 8192, 40960  # the graph-replay check (the engine's storage)
DEVICE = "cuda"
SMOKE = False
# (SPLIT_KEYS, BLOCK_N, num_stages); BLOCK_M 64 and 4 warps throughout (the module's).
TILES = ((256, 32, 3), (128, 32, 3), (128, 64, 2), (64, 64, 2), (512, 64, 3))
# One-launch merge shapes timed at the module's tile set: (merge_pairs, merge_unroll).
MERGE_SHAPES = ((32, 2), (16, 4), (64, 1), (64, 2), (16, 2))

RESULTS: dict = {"env": {}, "exact": {}, "invariance": {}, "timing": {}, "merge_shapes": {},
                 "errors": {}}


def _import_attention():
    """`memra_kernels.attention` when memra is installed, else the repo's `kernels/`."""
    if importlib.util.find_spec("memra_kernels") is None:
        root = ROOT / "kernels"
        spec = importlib.util.spec_from_file_location(
            "memra_kernels", root / "__init__.py", submodule_search_locations=[str(root)])
        sys.modules["memra_kernels"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["memra_kernels"])
    from memra_kernels import attention

    return attention


def case(group: str, name: str, fn) -> None:
    """Run fn(), store its result under RESULTS[group][name], or the error (and carry on)."""
    t0 = time.time()
    try:
        RESULTS[group][name] = fn()
        status = "ok"
        if isinstance(RESULTS[group][name], dict) and RESULTS[group][name].get("ok") is False:
            status = "BROKEN"
    except Exception as exc:  # noqa: BLE001 - report and carry on
        RESULTS["errors"][f"{group}/{name}"] = "".join(
            traceback.format_exception_only(type(exc), exc)).strip()[:500]
        traceback.print_exc()
        status = "FAILED"
    print(f"[{group}] {name}: {status} ({time.time() - t0:.1f}s)", flush=True)


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def make_cache(live: int, storage: int, seed: int = 0, fill=float("nan")):
    """K/V `[N_KV, storage, HEAD_DIM]`: random keys 0..live-1, `fill` beyond."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    k = torch.full((N_KV, storage, HEAD_DIM), fill, dtype=DTYPE, device=DEVICE)
    v = torch.full((N_KV, storage, HEAD_DIM), fill, dtype=DTYPE, device=DEVICE)
    k[:, :live] = (torch.randn(N_KV, live, HEAD_DIM, generator=g, device=DEVICE) + 0.2).to(DTYPE)
    v[:, :live] = torch.randn(N_KV, live, HEAD_DIM, generator=g, device=DEVICE).to(DTYPE)
    return k, v


def randn(*shape, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(DTYPE)


def randint(high: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=g, device=DEVICE)


class _EagerGraph:
    """--smoke's stand-in for a CUDA graph: replay() reruns the calls into the first outputs."""

    def __init__(self, fns, outs):
        self.fns, self.outs = fns, outs

    def replay(self):
        for fn, out in zip(self.fns, self.outs):
            out.copy_(fn())


def capture(fns):
    """One CUDA graph of the calls `fns`, warmed up eagerly first (compiles the kernels and
    allocates the one-launch path's counters outside the capture, as the engine does)."""
    outs = [fn() for fn in fns]
    if SMOKE:
        return _EagerGraph(fns, outs), outs
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fns[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for fn in fns]
    return graph, outs


def bench_graph(fns, reps: int = 20) -> float:
    """Median GPU microseconds per call of `fns` captured back to back in one graph."""
    graph, _ = capture(fns)
    if SMOKE:
        t0 = time.perf_counter()
        graph.replay()
        return 1e6 * (time.perf_counter() - t0) / len(fns)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(fns))
    del graph
    return float(sorted(times)[len(times) // 2])


def counters_zero(attention) -> bool:
    """Every counter of the one-launch path on the current device is 0 (after a sync)."""
    sync()
    device = torch.device("cpu") if SMOKE else torch.device("cuda", torch.cuda.current_device())
    return all(int(b.abs().sum()) == 0 for b in attention._COUNTERS.get(device, []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 caches per context, fewer reps")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton interpreter, toy sizes: checks the script only")
    args = parser.parse_args()
    if args.smoke:
        _smoke_settings()
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)")
        return 2
    import triton

    attention = _import_attention()
    RESULTS["env"] = {"gpu": "smoke (CPU interpreter)" if SMOKE else torch.cuda.get_device_name(),
                      "torch": torch.__version__,
                      "triton": triton.__version__, "dtype": str(DTYPE),
                      "shape": dict(n_heads=N_HEADS, n_kv=N_KV, head_dim=HEAD_DIM),
                      "module": dict(split=attention.SPLIT_KEYS, block_m=attention.BLOCK_M,
                                     block_n=attention.BLOCK_N, num_warps=attention.NUM_WARPS,
                                     num_stages=attention.NUM_STAGES,
                                     fused_combine=attention.FUSED_COMBINE,
                                     fused_merge_pairs=attention.FUSED_MERGE_PAIRS,
                                     combine_pairs=attention.COMBINE_PAIRS,
                                     merge_unroll=attention.MERGE_UNROLL),
                      "layers": min(8, N_LAYERS) if args.quick else N_LAYERS}
    print(json.dumps(RESULTS["env"]), flush=True)
    scale = HEAD_DIM ** -0.5
    n_layers = RESULTS["env"]["layers"]
    reps = 10 if args.quick else 20

    def cfg(tile):
        split, block_n, stages = tile
        return dict(split=split, block_m=attention.BLOCK_M, block_n=block_n,
                    num_warps=attention.NUM_WARPS, num_stages=stages)

    def tile_name(tile):
        return "s{}_n{}_st{}".format(*tile)

    # ---------------------------------------------------------------- 1. exactness
    for tile in TILES:
        def exact(tile=tile):
            bad, checked = [], 0
            for ctx in CONTEXTS:
                k, v = make_cache(ctx, ctx + 100, seed=ctx)  # NaN past the live keys
                for rows in ROWS:
                    q = randn(rows, N_HEADS, HEAD_DIM, seed=rows)
                    pos = torch.arange(ctx - rows, ctx, device=DEVICE)
                    one = attention._launch(q, k, v, pos, scale, fused=True, **cfg(tile))
                    two = attention._launch(q, k, v, pos, scale, fused=False, **cfg(tile))
                    checked += 1
                    if not torch.equal(one, two) or not torch.isfinite(one).all():
                        bad.append({"ctx": ctx, "rows": rows,
                                    "max_abs": float((one.float() - two.float()).abs().max()),
                                    "finite": bool(torch.isfinite(one).all())})
            return {"ok": not bad and counters_zero(attention), "cases": checked,
                    "mismatches": bad, "counters_zero": counters_zero(attention)}

        case("exact", tile_name(tile), exact)

    for tile in TILES:
        def stress(tile=tile, calls=STRESS_CALLS):
            """One graph of `calls` one-launch calls at 16 random positions each (a new draw per
            call, spread over STRESS_KEYS keys), replayed 5 times: every output == two launches
            (outputs zeroed before each replay, so an output never written shows too)."""
            k, v = make_cache(STRESS_KEYS, STRESS_KEYS, seed=7)
            g = torch.Generator(device=DEVICE).manual_seed(11)
            qs = [randn(16, N_HEADS, HEAD_DIM, seed=100 + i) for i in range(calls)]
            ps = [randint(STRESS_KEYS, 16, g) for _ in range(calls)]
            want = [attention._launch(q, k, v, p, scale, fused=False, **cfg(tile))
                    for q, p in zip(qs, ps)]
            fns = [lambda q=q, p=p: attention._launch(q, k, v, p, scale, fused=True, **cfg(tile))
                   for q, p in zip(qs, ps)]
            graph, outs = capture(fns)
            bad = 0
            for _ in range(5):
                for o in outs:
                    o.zero_()
                graph.replay()
                sync()
                bad += sum(not torch.equal(o, w) for o, w in zip(outs, want))
            del graph
            return {"ok": bad == 0 and counters_zero(attention), "calls": 5 * calls,
                    "mismatches": bad, "counters_zero": counters_zero(attention)}

        case("exact", f"graph_stress_{tile_name(tile)}", stress)

    # ---------------------------------------------------------------- 2. invariance
    for tile in TILES:
        def alone_vs_step(tile=tile):
            k, v = make_cache(INV_KEYS, INV_KEYS + 232)
            g = torch.Generator(device=DEVICE).manual_seed(10)
            split = tile[0]
            bad = []
            for trial in range(4):
                pos = randint(INV_KEYS, 16, g)
                pos[3], pos[11] = [(0, INV_KEYS - 1), (split - 1, split), (36, INV_KEYS // 8 - 1),
                                   (2 * split - 1, 2 * split)][trial]
                q = randn(16, N_HEADS, HEAD_DIM, seed=20 + trial)
                batch = attention._launch(q, k, v, pos, scale, fused=True, **cfg(tile))
                for i in range(16):
                    alone = attention._launch(q[i:i + 1], k, v, pos[i:i + 1], scale, fused=True,
                                              **cfg(tile))
                    if not torch.equal(alone[0], batch[i]):
                        bad.append((trial, i, int(pos[i])))
            return {"ok": not bad, "rows_checked": 64, "mismatches": bad}

        case("invariance", f"row_alone_vs_step_{tile_name(tile)}", alone_vs_step)

    def graph_replay():
        """decode_attention (the engine's entry) captured once, replayed at new positions."""
        k, v = make_cache(REPLAY_KEYS, REPLAY_STORAGE)
        q = randn(16, N_HEADS, HEAD_DIM, seed=33)
        pos = torch.arange(16, device=DEVICE)
        graph, (out,) = capture([lambda: attention.decode_attention(q, k, v, pos, scale)])
        ok, zero = True, True
        split = attention.SPLIT_KEYS
        for start in (0, REPLAY_KEYS // 16, REPLAY_KEYS // 2, REPLAY_KEYS - 16, split - 1, split):
            pos.copy_(torch.arange(start, start + 16, device=DEVICE))
            graph.replay()
            sync()
            zero &= counters_zero(attention)
            ok &= torch.equal(out, attention._launch(q, k, v, pos, scale, fused=False,
                                                     **cfg((attention.SPLIT_KEYS, attention.BLOCK_N,
                                                            attention.NUM_STAGES))))
        del graph
        return {"ok": bool(ok and zero), "equal_two_launch": bool(ok), "counters_zero": bool(zero)}

    case("invariance", "decode_attention_graph_replay", graph_replay)

    # ---------------------------------------------------------------- 3. timing
    caches = {}

    def layer_caches(ctx):
        if ctx not in caches:
            caches.clear()  # one context's caches at a time (36 x 128 MiB at 32k)
            if not SMOKE:
                torch.cuda.empty_cache()
            caches[ctx] = [make_cache(ctx, ctx, seed=i, fill=0.0) for i in range(n_layers)]
        return caches[ctx]

    for ctx in CONTEXTS:
        for rows in ROWS:
            q = randn(rows, N_HEADS, HEAD_DIM, seed=8)
            pos = torch.arange(ctx - rows, ctx, device=DEVICE)
            for tile in TILES:
                def timing(tile=tile, ctx=ctx, q=q, pos=pos):
                    out = {}
                    for label, fused in (("two_launch_us", False), ("one_launch_us", True)):
                        fns = [lambda k=k, v=v, fused=fused: attention._launch(
                            q, k, v, pos, scale, fused=fused, **cfg(tile))
                               for k, v in layer_caches(ctx)]
                        out[label] = bench_graph(fns, reps=reps)
                    out["saved_us"] = out["two_launch_us"] - out["one_launch_us"]
                    return out

                case("timing", f"ctx{ctx}_rows{rows}_{tile_name(tile)}", timing)

            module_tile = (attention.SPLIT_KEYS, attention.BLOCK_N, attention.NUM_STAGES)
            for pairs, unroll in MERGE_SHAPES:
                def merge_timing(ctx=ctx, q=q, pos=pos, pairs=pairs, unroll=unroll):
                    fns = [lambda k=k, v=v: attention._launch(
                        q, k, v, pos, scale, fused=True, merge_pairs=pairs, merge_unroll=unroll,
                        **cfg(module_tile)) for k, v in layer_caches(ctx)]
                    return {"one_launch_us": bench_graph(fns, reps=reps)}

                case("merge_shapes", f"ctx{ctx}_rows{rows}_pairs{pairs}_unroll{unroll}",
                     merge_timing)

    report()
    broken = [name for group in ("exact", "invariance") for name, r in RESULTS[group].items()
              if not r.get("ok")]
    return 1 if RESULTS["errors"] or broken else 0


def _smoke_settings() -> None:
    """Toy sizes for --smoke (CPU through Triton's interpreter, set before Triton loads)."""
    global N_HEADS, N_KV, HEAD_DIM, CONTEXTS, ROWS, N_LAYERS, TILES, MERGE_SHAPES, DEVICE, SMOKE
    global STRESS_KEYS, STRESS_CALLS, INV_KEYS, REPLAY_KEYS, REPLAY_STORAGE
    os.environ["TRITON_INTERPRET"] = "1"
    # The kernel tests' conftest carries the interpreter shims (NumPy >= 2.4, bf16 rounding).
    spec = importlib.util.spec_from_file_location("_kernel_conftest",
                                                  ROOT / "tests" / "kernels" / "conftest.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    N_HEADS, N_KV, HEAD_DIM = 8, 2, 64
    CONTEXTS, ROWS, N_LAYERS = (70, 300), (1, 16), 2
    TILES, MERGE_SHAPES = ((64, 32, 3), (128, 64, 2)), ((16, 4), (64, 1))
    STRESS_KEYS, STRESS_CALLS, INV_KEYS, REPLAY_KEYS, REPLAY_STORAGE = 300, 2, 300, 300, 400
    DEVICE, SMOKE = "cpu", True


def report() -> None:
    print("\n==== exactness: one launch vs two (torch.equal) ====")
    for name, r in RESULTS["exact"].items():
        print(f"{name:32s} {'OK' if r.get('ok') else 'BROKEN'}  {r}")
    print("\n==== invariance (one launch) ====")
    for name, r in RESULTS["invariance"].items():
        print(f"{name:32s} {'OK' if r.get('ok') else 'BROKEN'}  {r}")
    print("\n==== timing: us per call (CUDA-graph replay over per-layer caches) ====")
    print(f"{'case':32s} {'two launches':>13s} {'one launch':>11s} {'saved':>8s}")
    for name, r in RESULTS["timing"].items():
        print(f"{name:32s} {r['two_launch_us']:13.1f} {r['one_launch_us']:11.1f} "
              f"{r['saved_us']:8.1f}")
    if RESULTS["merge_shapes"]:
        print("\n==== one-launch merge shapes at the module's tile set (us per call) ====")
        for name, r in RESULTS["merge_shapes"].items():
            print(f"{name:40s} {r['one_launch_us']:8.1f}")
    if RESULTS["errors"]:
        print("\n==== errors ====")
        for name, err in RESULTS["errors"].items():
            print(f"{name}: {err}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "attention_tiles.json"
        path.write_text(json.dumps(RESULTS, indent=1, default=str))
        print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
