"""Where a target step's GPU time goes: per-kernel tables of one eager step, in one process.

For the Qwen3-8B shape (random weights, 16-row step at live context 512) and the Qwen3.5-4B
hybrid shape (random weights, one-row and 16-row steps after a 512-token prompt), each with the
step ops `select_step_ops` picks (Triton on CUDA): the CUDA kernels of one eager step under the
torch profiler, grouped by kernel name (count, summed GPU µs), the sum, and the graphed step's
replay time beside it (GPU time between kernels is what a graph cannot remove); then the
hybrid's graphed plain token and verify + rollback (hybrid_step.py's sections).

Section `attention` times the attention kernel's tiles (`attention.Tile`; the engine runs
`attention.tile_for(head_dim)`) per call, one CUDA graph over a model's per-layer caches, at
live contexts 512 / 4,096 / 32,768 and 1 and 16 rows: first the hybrid shape (8 caches, 16 q / 4
kv heads of 256) over TILES_HD256, then the 8B shape (36 caches, 32 q / 8 kv heads of 128) over
a short TILES_8B list (informational). Its key `best_hd256` is the hd-256 candidate of least
score (sum over contexts of one-row + 16-row µs, weights 1 / 1 / 0.25: short contexts are what
the engine runs), as [split, block_n, block_m, stages, warps], the form of hybrid_step.py's
`--attn-tile`:

    python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['attention']['best_hd256'])))" OUT.json

(absent when no candidate ran: then the command fails, as a script should). `--skip attention`
leaves the section out; `--skip attention8b` only its 8B part.

    python -m benchmarks.gpu.step_profile [--json OUT.json] [--skip gdn,8b,hybrid,attention,attention8b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import timing
from benchmarks.gpu import hybrid_step
from benchmarks.gpu_shapes import SHAPES, random_target
from benchmarks.timing import kernel_table
from memra_cli.engine.api import Engine
from memra_cli.engine.layers.step_ops import select_step_ops
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime import cuda_graphs

W = 16


def replay_ms(replay, reps: int = 30) -> float:
    return timing.median_ms(replay, reps, device="cuda")


def profile_8b() -> dict:
    target = random_target(SHAPES["8b"], torch.bfloat16, torch.device("cuda"))
    target.step_ops, note = select_step_ops(torch.device("cuda"))
    out = {"step_ops": note}
    engine = Engine.from_model(target, step_width=W, cuda_graphs=True)
    runner = engine.runner
    state = runner.new_state(600)
    state.length = 512
    ids = torch.randint(0, 1000, (W,), device="cuda")
    pos = torch.arange(512, 512 + W, device="cuda")
    out["rows16"] = kernel_table(lambda: target.static_step(ids, pos, state))
    runner.fixed_step(ids, 512, state)
    out["rows16"]["replay_ms"] = replay_ms(state.graphs[("step", ())].graph.replay)
    runner.release(state)
    del target
    torch.cuda.empty_cache()
    return out


def profile_hybrid(ckpt: Path) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    if not (ckpt / "config.json").exists():
        from memra_cli.tiny.qwen3_5 import make_tiny_qwen35
        make_tiny_qwen35(ckpt, dtype=dt, seed=0, **hybrid_step.SHAPE_4B)
    target = Qwen35Target.from_dir(ckpt, dtype=dt, device=dev)
    target.step_ops, note = select_step_ops(dev)
    out = {"step_ops": note, "rollback_default": target.rollback_mode}
    prompt = torch.randint(0, 248000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    for width in (1, W):
        runner = hybrid_step.make_runner(target, width, False)
        state = runner.new_state(len(prompt) + 64)
        runner.prefill(torch.tensor(prompt, device=dev), state)
        ids = torch.randint(0, 1000, (width,), device=dev)
        pos = torch.arange(state.length, state.length + width, device=dev)

        def step():
            target.static_step(ids, pos, state)
            state._pending = None  # the profile runs the same uncommitted step again

        out[f"width{width}"] = kernel_table(step)
        runner.release(state)
    with torch.inference_mode():
        out["plain"] = hybrid_step.plain(target, prompt, True, 24, 20)
        out["verify"] = hybrid_step.verify(target, prompt, True, 8)
    del target
    torch.cuda.empty_cache()
    return out


# Attention tiles, as (split, block_n, block_m, stages, warps): the order of attention.Tile's
# fields and of hybrid_step.py's --attn-tile, so `best_hd256` can be passed on as it is.
# The 8B list is informational (the module's entry first): the engine's hd-128 tile stays
# the one the module's comment records.
TILES_8B = ((256, 32, 64, 3, 4), (512, 64, 64, 3, 4), (128, 64, 64, 2, 4), (128, 32, 32, 3, 4))
# head_dim 256 (Qwen3.5's gated attention): the 128 tile (the entry before the table), then
# smaller M tiles (a one-row step folds 4 (row, head) pairs, a 16-row verify 64) and splits.
TILES_HD256 = ((256, 32, 64, 3, 4), (128, 32, 16, 3, 4), (128, 32, 32, 3, 4), (64, 32, 16, 3, 4),
               (64, 32, 32, 2, 4), (128, 64, 16, 2, 4), (64, 16, 16, 3, 4), (128, 32, 64, 3, 4),
               (32, 32, 16, 3, 4))
TILE_CONTEXTS = (512, 4096, 32768)
# best_hd256's score: sum over contexts of weight * (one-row us + 16-row us). The engine's
# hybrid decode runs one-row steps and 16-row verifies at short contexts; 32k counts a quarter.
TILE_SCORE_WEIGHTS = {512: 1.0, 4096: 1.0, 32768: 0.25}


def sweep_tiles(heads: int, kv: int, hd: int, n_caches: int, candidates) -> list[dict]:
    """µs per call of `attention._launch` for each candidate tile, at TILE_CONTEXTS x rows 1 and
    16 (positions ctx-rows..ctx-1): one CUDA graph over `n_caches` per-layer caches
    `[2, kv, ctx + 64, hd]` bf16, replay time / n_caches. One dict per candidate: its "tile"
    [split, block_n, block_m, stages, warps], "ctx{C}_rows{R}" -> µs (or the error, a string),
    and "score" (TILE_SCORE_WEIGHTS; None if any of its timings failed)."""
    from memra_kernels import attention as A

    rows_list = (1, W)
    out = []
    for c in candidates:
        row = {"tile": list(c)}
        try:
            row["launch"] = dataclasses.asdict(A.Tile(*c))  # raises on a tile the kernel cannot run
        except (TypeError, ValueError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        out.append(row)
    for ctx in TILE_CONTEXTS:
        caches = [torch.randn(2, kv, ctx + 64, hd, dtype=torch.bfloat16, device="cuda") for _ in range(n_caches)]
        for rows in rows_list:
            q = torch.randn(rows, heads, hd, dtype=torch.bfloat16, device="cuda")
            pos = torch.arange(ctx - rows, ctx, device="cuda")
            for row in out:
                if "error" in row:
                    continue

                def calls(kw=row["launch"]):
                    for cache in caches:
                        A._launch(q, cache[0], cache[1], pos, hd ** -0.5, **kw)
                try:  # capture() runs calls() twice first: a compile error raises outside the graph
                    graph, _ = cuda_graphs.capture(calls, torch.device("cuda"))
                    us = 1e3 * replay_ms(graph.replay, 20) / n_caches
                    del graph
                except Exception as exc:  # noqa: BLE001
                    us = f"{type(exc).__name__}: {exc}"[:200]
                row[f"ctx{ctx}_rows{rows}"] = us
        del caches
        torch.cuda.empty_cache()
    for row in out:
        timed = [row.get(f"ctx{ctx}_rows{r}") for ctx in TILE_CONTEXTS for r in rows_list]
        row["score"] = (sum(TILE_SCORE_WEIGHTS[ctx] * (row[f"ctx{ctx}_rows1"] + row[f"ctx{ctx}_rows{W}"])
                            for ctx in TILE_CONTEXTS)
                        if all(isinstance(x, float) for x in timed) else None)
    return out


def attention_tiles(with_8b: bool = True) -> dict:
    """decode_attention's tiles: the hybrid shape (8 caches, 16 q / 4 kv heads of 256) over
    TILES_HD256 (plus the module's current entry), then the 8B shape (36 caches, 32 q / 8 kv
    heads of 128) over TILES_8B, informational. `best_hd256`: the hd-256 candidate of least
    score, [split, block_n, block_m, stages, warps] (absent if none ran)."""
    from memra_kernels import attention as A

    module = A.tile_for(256)
    current = [module.split, module.block_n, module.block_m, module.num_stages, module.num_warps]
    candidates = list(TILES_HD256) + ([tuple(current)] if tuple(current) not in TILES_HD256 else [])
    out = {"score_weights": {str(k): v for k, v in TILE_SCORE_WEIGHTS.items()}, "module_hd256": current}
    h = hybrid_step.SHAPE_4B  # 16 q / 4 kv heads of 256, 8 of its 32 layers attention
    out["hd256"] = sweep_tiles(h["heads"], h["kv_heads"], h["head_dim"],
                               h["layer_types"].count("full_attention"), candidates)
    scored = [row for row in out["hd256"] if row["score"] is not None]
    if scored:
        best = min(scored, key=lambda row: row["score"])
        out["best_hd256"], out["best_hd256_score"] = best["tile"], best["score"]
    if with_8b:
        s = SHAPES["8b"]
        try:
            out["hd128"] = sweep_tiles(s["heads"], s["kv"], s["hd"], 36, TILES_8B)
        except Exception as exc:  # noqa: BLE001 - keep the hd-256 result
            out["hd128"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def gdn_tiles() -> dict:
    """The DeltaNet recurrence kernel's tile (value columns per program, warps) at the 4B shape
    (16 key / 32 value heads of 128): µs per layer, graph over 24 layers, 1 and 16 rows, with and
    without the per-row stash, with row r+1's prep before or after row r's update (LATE_PREP),
    inputs loaded one or two rows ahead (PREFETCH). `best_rows16` = [BLOCK_V, warps, LATE_PREP,
    PREFETCH] of the fastest 16-row no-stash run (informational: the engine uses the module's
    constants)."""
    from memra_kernels import deltanet as D

    hk, hv, dk, dv, layers = 16, 32, 128, 128, 24
    c = 2 * hk * dk + hv * dv
    out = {}
    for rows in (1, W):
        qkv = torch.randn(layers, rows, c, dtype=torch.bfloat16, device="cuda")
        g = -torch.rand(layers, rows, hv, device="cuda")
        beta = torch.rand(layers, rows, hv, device="cuda")
        state = torch.randn(layers, hv, dk, dv, device="cuda") * 0.1
        final = torch.empty_like(state)
        res = torch.empty(rows, hv, dv, device="cuda")
        stash = torch.empty(layers, rows, hv, dk, dv, device="cuda")
        idx = torch.arange(rows, device="cuda")
        for block_v, warps, late, with_stash, ahead in [
                (bv, w, late, st, pf) for bv, w in ((32, 1), (16, 1), (8, 1)) for late in (False, True)
                for st in (False, True) for pf in (1, 2)]:
            def calls():
                for i in range(layers):
                    D._gdn_kernel[(hv, dv // block_v)](
                        qkv[i], g[i], beta[i], state[i], res, final[i], stash[i], idx,
                        rows, hv // hk, 1, 0, rows, 0, 0,
                        qkv.stride(1), g.stride(1), beta.stride(1), float(dk) ** 0.5, D.L2_EPS,
                        HV=hv, KEY_DIM=hk * dk, DK=dk, DV=dv, BLOCK_V=block_v, LATE_PREP=late, WRITE_OUT=True,
                        WRITE_STASH=with_stash, PREFETCH=ahead, num_warps=warps)
            try:
                graph, _ = cuda_graphs.capture(calls, torch.device("cuda"))
                us = 1e3 * replay_ms(graph.replay, 20) / layers
            except Exception as exc:  # noqa: BLE001
                us = f"{type(exc).__name__}: {exc}"[:200]
            out[f"rows{rows}_bv{block_v}_w{warps}_late{int(late)}_stash{int(with_stash)}_pf{ahead}"] = us
        # the batched replay a rollback runs: every layer, `rows` rows, one launch (module constants)
        for ahead in (1, 2):
            D.PREFETCH, saved = ahead, D.PREFETCH
            try:
                graph, _ = cuda_graphs.capture(lambda: D.gated_delta_rule_layers(qkv, g, beta, state, hk, 0, rows, final),
                                               torch.device("cuda"))
                out[f"replay_all_layers_rows{rows}_pf{ahead}_us"] = 1e3 * replay_ms(graph.replay, 20)
            except Exception as exc:  # noqa: BLE001
                out[f"replay_all_layers_rows{rows}_pf{ahead}_us"] = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                D.PREFETCH = saved
    # the tile a replay-mode verify runs fastest with: 16 rows, no stash (ties to the larger tile)
    timed = {k: v for k, v in out.items() if k.startswith(f"rows{W}_") and "stash0" in k and isinstance(v, float)}
    if timed:
        best = min(timed, key=timed.get)
        out["best_rows16"] = [int(best.split("_bv")[1].split("_")[0]), int(best.split("_w")[1].split("_")[0]),
                              int(best.split("_late")[1].split("_")[0]), int(best.split("_pf")[1].split("_")[0])]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "h200-step-profile.json")
    p.add_argument("--ckpt", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "memra-qwen35-4b-random")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: gdn, attention, 8b, hybrid; "
                   "attention8b leaves out only the attention section's 8B part")
    a = p.parse_args()
    skip = set(a.skip.split(","))
    data: dict = {"device": torch.cuda.get_device_name(), "command": "python -m benchmarks.gpu.step_profile " + " ".join(sys.argv[1:])}
    for name, fn in (("gdn", gdn_tiles), ("attention", lambda: attention_tiles("attention8b" not in skip)),
                     ("8b", profile_8b),
                     ("hybrid", lambda: profile_hybrid(a.ckpt))):
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                data[name] = fn()
        except Exception as exc:  # noqa: BLE001 - each section reports its own failure
            data[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2500:]}
        data[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {json.dumps(data[name])[:3000]}", flush=True)
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
