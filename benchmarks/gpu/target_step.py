"""The target step against its floor, in one process (Qwen3-8B shape, or with ``--family llama``
LLaMA-3.1-8B's: hidden 4096, 32 layers, 32/8 heads x 128, ffn 14336, vocab 128256, llama3 rope;
bf16, random weights).

Prints and writes (``--json``, default ``$OUT/h200-target-step.json``):

- ``floor_ms[ctx]``: the cuBLAS matmul chain of one 16-row step (36 layers' fused qkv / o /
  gate-up / down + lm_head), replayed as a CUDA graph, plus the time to read the live K/V once
  at the measured copy bandwidth (the higher of a graphed and an eager copy: ``copy_gbps``,
  both in ``copy_gbps_measured``);
- ``plain_ms[ctx]`` / ``verify16_ms[ctx]``: the graphed fixed-width step (16 rows; plain decode is
  one real row padded to 16, verify is 16 real rows: the same kernels) with the torch step ops and
  with the Triton step ops, at live context 512 / 4096 / 32768;
- ``greedy_step_ms[ctx]``: a greedy round's step (``round_bodies.greedy_step``: the 16-row step and
  its argmax picks, the lm_head's argmax epilogue with the Triton ops, no float32 logits), graphed;
- ``kernels_per_step``: CUDA kernels in one eager step (torch profiler), per ops; variant
  ``triton-unfused`` runs the q/k/v projection + rope, the embedding + first norm, the lm_head +
  argmax and the o / down projections + the residual add + norm as separate launches
  (``fused_speedup_plain`` / ``_greedy_step``:
  unfused over fused, per context);
- ``peak_gib``: peak allocated GPU memory per context;
- ``prefill``: a long prompt (``--prefill-length``, default 32,768) through the chunked prefill:
  seconds, tokens/s and peak GPU memory (weights included), against the weights alone;
- ``exact``: speculative == plain greedy for the prompts and lengths of the sweep, verify window
  pinned at 16, Triton ops and graphs on, with two proposers: an oracle that proposes the plain
  stream's continuation with one slot in a random place corrupted (or none), so rounds accept
  0..15 drafts and every verify, partial acceptance and rollback path runs; and the random-weight
  DFlash drafter (its drafts are never right: every round a full 16-row verify of one real token)
  on the first length.

    python -m benchmarks.gpu.target_step [--family qwen3|llama] [--contexts 512,4096,32768]
        [--sweep-lengths 512,4096] [--sweep-prompts 3] [--sweep-tokens 64] [--json OUT.json]

``--shape gemma4-31b`` times the Gemma 4 31B text shape instead (gemma4_step.py: its step with
the Triton step ops and, beside them, the torch ones; the matmul chain and HBM read floors, peak
memory).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import timing
from benchmarks.gpu_shapes import SHAPES, random_target, run_arm
from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.layers.unfused import unfused_swiglu
from memra_cli.engine.spec.policy import Harvest, PolicySettings, VerifyWindow
from memra_cli.engine.spec.proposer import Program, Proposal
from memra_cli.engine.spec.session import Session
from memra_cli.tiny.draft import make_tiny_draft

W = 16
FAMILY_SHAPES = {"qwen3": "8b", "llama": "llama-8b"}  # --family -> gpu_shapes.SHAPES key


def replay_ms(replay, reps: int = 50) -> float:
    """Median ms of `replay()` (a CUDA graph's replay), timed with events."""
    return timing.median_ms(replay, reps, warmup=5, device="cuda")


def graph_ms(fn, reps: int = 50) -> float:
    """Median ms of replaying `fn` captured as a CUDA graph."""
    return timing.graph_ms(fn, reps)


def copy_gbps() -> dict:
    """GB/s of the memory floors (benchmarks/timing.py): a 1 GiB copy replayed as a CUDA graph
    and an eager 2 GiB copy (bytes read + written), and a sum over 2 GiB (bytes read). The
    floor takes the higher copy, the one a kernel can reach (docs/perf.md, "How to measure")."""
    graph = timing.copy_gbps(1 << 30, reps=20, graphed=True)
    eager = eager_copy_gbps()
    return {"graph_1gib": graph, "eager_2gib": eager, "read_sum_2gib": timing.read_gbps(),
            "used": max(graph, eager)}


def eager_copy_gbps(reps: int = 50) -> float:
    """GB/s (bytes read + written) of an eager 2 GiB device copy, median of `reps` event-timed."""
    return timing.copy_gbps(2 * timing.GIB, reps)


def matmul_chain_ms(target) -> float:
    """Every weight matmul of one 16-row step (qkv, o, gate-up, down per layer; lm_head)."""
    w0 = target.layers[0]
    h = torch.randn(W, target.hidden_size, dtype=target.dtype, device="cuda")
    attn = torch.randn(W, w0.wo.shape[1], dtype=target.dtype, device="cuda")
    act = torch.randn(W, w0.w_down.shape[1], dtype=target.dtype, device="cuda")

    def chain():
        for w in target.layers:
            F.linear(h, w.wqkv)
            F.linear(attn, w.wo)
            F.linear(h, w.w_gate_up)
            F.linear(act, w.w_down)
        return F.linear(h, target.lm_head_weight)

    return graph_ms(chain)


def kv_bytes(target, ctx: int) -> int:
    return 2 * target.n_layers * target.n_kv * ctx * target.head_dim * target.dtype.itemsize


def step_ms(engine, ctx: int, real_rows: int) -> tuple[float, float]:
    """Median ms of the graphed fixed-width step at live context `ctx`, and peak GiB."""
    runner = engine.runner
    torch.cuda.reset_peak_memory_stats()
    state = runner.new_state(ctx + 64)
    state.length = ctx  # the K/V of a ctx-token context (random bytes are as good as real ones here)
    ids = torch.randint(0, engine.target.vocab_size - 1, (W,), device="cuda")
    ids[real_rows:] = ids[real_rows - 1]
    runner.fixed_step(ids, ctx, state)  # capture
    graph = state.graphs[("step", ())]
    ms = replay_ms(graph.graph.replay)
    peak = torch.cuda.max_memory_allocated() / 2**30
    runner.release(state)
    return ms, peak


def greedy_step_ms(engine, ctx: int) -> float:
    """Median ms of a greedy round's step at live context `ctx` (round_bodies.greedy_step: the
    16-row step and its argmax picks, no float32 logits), captured as a CUDA graph."""
    from memra_cli.engine.runtime import cuda_graphs
    from memra_cli.engine.spec.round_bodies import greedy_step

    runner, target = engine.runner, engine.target
    state = runner.new_state(ctx + 64)
    state.length = ctx
    ids = torch.randint(0, target.vocab_size - 1, (W,), device="cuda")
    positions = torch.arange(ctx, ctx + W, device="cuda")
    graph, _ = cuda_graphs.capture(lambda: greedy_step(target, ids, positions, state, None), torch.device("cuda"))
    ms = replay_ms(graph.replay)
    del graph
    runner.release(state)
    return ms


def kernels_per_step(engine, greedy: bool = False) -> int:
    """CUDA kernels in one eager step (torch profiler); `greedy`: a greedy round's step and its picks."""
    from memra_cli.engine.spec.round_bodies import greedy_step

    runner = engine.runner
    state = runner.new_state(600)
    ids = torch.randint(0, 1000, (W,), device="cuda")
    pos = torch.arange(500, 500 + W, device="cuda")

    def step():
        if greedy:
            return greedy_step(engine.target, ids, pos, state, None)
        return engine.target.static_step(ids, pos, state)

    step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    runner.release(state)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


class StreamOracle:
    """Proposes the plain stream's continuation with one draft slot corrupted per round at a
    seeded random place (or none, one round in five): partial acceptance of every length."""

    def __init__(self, stream: list[int], prompt_len: int, n_drafts: int, vocab: int, seed: int, device):
        self.stream, self.p, self.nd, self.vocab, self.device = stream, prompt_len, n_drafts, vocab, device
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self, capacity: int) -> None:
        pass

    def ingest(self, taps, positions) -> None:
        pass

    def release(self) -> None:
        pass

    def propose(self, last, start: int, want_raws: bool) -> Proposal:
        i = start - self.p  # `last` is stream[i]
        drafts = [self.stream[j] if j < len(self.stream) else 0 for j in range(i + 1, i + 1 + self.nd)]
        slot = int(torch.randint(0, self.nd + self.nd // 4, (1,), generator=self.rng))
        if slot < self.nd:
            drafts[slot] = (drafts[slot] + 1) % self.vocab
        return Proposal(torch.tensor(drafts, dtype=torch.long, device=self.device))


def oracle_run(engine, ids: list[int], stream: list[int], seed: int) -> tuple[list[int], float]:
    """The stream again through speculative rounds fed by StreamOracle: (tokens, tau)."""
    program = Program(Harvest.DFLASH, VerifyWindow("ladder"), False, W, False, W)
    oracle = StreamOracle(stream, len(ids), program.n_drafts, engine.target.vocab_size, seed, engine.device)
    taps = (0,)  # one tapped layer: the round hands its rows to the (ignoring) oracle, as to a drafter
    s = Session(engine.runner, ids, len(stream), proposer=oracle, program=program, taps=taps, eos_ids=())
    out = s.run()
    return out, len(out) / max(1, s.stats.rounds)


def prefill_measure(engine, length: int) -> dict:
    """A `length`-token prompt through the chunked prefill (the plain arm's path, no taps)."""
    runner = engine.runner
    ids = torch.randint(0, engine.target.vocab_size - 1, (length,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = runner.new_state(length + 64)
    t0 = time.perf_counter()
    runner.prefill(ids, state)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    cache = getattr(state, "nbytes", None)
    runner.release(state)
    return {"length": length, "chunk": runner.prefill_chunk, "seconds": sec, "tokens_per_s": length / sec,
            "peak_gib": peak / 2**30, "before_gib": base / 2**30, "cache_gib": None if cache is None else cache / 2**30,
            "transient_gib": (peak - base - (cache or 0)) / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILY_SHAPES), default="qwen3",
                   help="the target's shape: Qwen3-8B, or LLaMA-3.1-8B (its json default: h200-target-step-llama.json)")
    p.add_argument("--contexts", default="512,4096,32768")
    p.add_argument("--sweep-lengths", default="512,4096")
    p.add_argument("--sweep-prompts", type=int, default=3)
    p.add_argument("--sweep-tokens", type=int, default=64)
    p.add_argument("--prefill-length", type=int, default=32768)
    p.add_argument("--json", type=Path, default=None, help="default $OUT/h200-target-step[-llama].json")
    p.add_argument("--attn-tile", default=None,
                   help="SPLIT,BLOCK_N,BLOCK_M,STAGES,WARPS[,LONG_SPLIT,LONG_FROM]: time the attention "
                        "with this head_dim-128 tile instead of the module's (memra_kernels.attention.TILES[128]); "
                        "if some variants name a 'tile' part, only those (and the exactness sweep) use it")
    p.add_argument("--variants", default="torch,triton,triton-nopdl,triton-cublas",
                   help="step-ops variants to time: torch, triton (the shipped ops), triton-nopdl (plain "
                        "launches), triton-cublas (every weight matmul on cuBLAS: dense_linear.TUNED emptied), "
                        "a 'noglu' part: the MLP's gate/up matmul and SiLU·mul as two launches (no swiglu fusion), "
                        "an 'unfused' part: the q/k/v projection + rope, the embedding + first norm, the lm_head + "
                        "argmax and the o / down projections + residual add + norm as separate launches "
                        "(TritonStepOps.unfused: triton-unfused is the step before those fusions)")
    p.add_argument("--dense-tuned", type=Path, default=None,
                   help="a dense_linear_sweep.py --tuned table to use as dense_linear.TUNED for this run")
    p.add_argument("--dense-all", type=Path, default=None,
                   help="a dense_linear_sweep.py --json report: variants with an 'all' part put every shape it "
                        "swept on the kernel at its best tiles; a 'pfN' part sets dense_linear.PDL_PREFETCH = N")
    p.add_argument("--shape", default="qwen3-8b", choices=("qwen3-8b", "gemma4-31b"),
                   help="gemma4-31b: the Gemma 4 31B text shape's step and floors only (gemma4_step.py)")
    p.add_argument("--gemma-ops", default="torch,triton", choices=("torch,triton", "triton"),
                   help="with --shape gemma4-31b: the step ops to time (triton alone skips the torch step and "
                        "the two ops' agreement)")
    p.add_argument("--attn-sweep", action="store_true",
                   help="with --shape gemma4-31b: also time the attention alone at its two layer shapes for the "
                        "module's tiles and gemma4_step.ATTN_CANDIDATES")
    a = p.parse_args()
    if a.shape == "gemma4-31b":
        from benchmarks.gpu import gemma4_step

        json_out = a.json or Path(os.environ.get("OUT", ".")) / "h200-gemma4-31b-step.json"
        gemma4_step.measure([int(c) for c in a.contexts.split(",")], json_out, sys.modules[__name__], a.attn_sweep,
                            tuple(a.gemma_ops.split(",")))
        return
    if a.json is None:
        suffix = "" if a.family == "qwen3" else f"-{a.family}"
        a.json = Path(os.environ.get("OUT", ".")) / f"h200-target-step{suffix}.json"
    from memra_kernels import dense_linear as _dense

    if a.dense_tuned:
        try:
            _dense.load_tuned(a.dense_tuned)  # before any launch
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--dense-tuned {a.dense_tuned}: {exc}")
    dense_table = dict(_dense.TUNED)
    default_prefetch = _dense.PDL_PREFETCH
    from memra_kernels import attention as _attn

    module_tile = _attn.TILES[128]
    try:
        cand_tile = _attn.Tile(*(int(x) for x in a.attn_tile.split(","))) if a.attn_tile else None
    except (TypeError, ValueError) as exc:
        p.error(f"--attn-tile {a.attn_tile!r}: {exc}")
    # with variants naming a "tile" part, only those run the candidate; else every launch does
    tile_variants = any("tile" in v.split("-") for v in a.variants.split(","))
    if cand_tile is not None and not tile_variants:
        _attn.TILES[128] = cand_tile  # before any launch
    shape = FAMILY_SHAPES[a.family]
    s = SHAPES[shape]
    contexts = [int(c) for c in a.contexts.split(",")]
    out: dict = {"shape": {"8b": "qwen3-8b", "llama-8b": "llama-3.1-8b"}[shape], "family": a.family,
                 "dtype": "bfloat16", "device": torch.cuda.get_device_name(), "step_width": W,
                 "command": "python -m benchmarks.gpu.target_step " + " ".join(sys.argv[1:])}
    from dataclasses import asdict

    from memra_kernels import _pdl

    out["attention_tile_hd128"] = asdict(_attn.TILES[128])
    if cand_tile is not None:
        out["attention_tile_candidate"] = asdict(cand_tile)
    with torch.inference_mode():
        target = random_target(s, torch.bfloat16, torch.device("cuda"))
        copies = copy_gbps()
        bw = copies["used"]
        chain = matmul_chain_ms(target)
        out["copy_gbps"] = bw
        out["copy_gbps_measured"] = copies
        out["matmul_chain_ms"] = chain
        out["floor_ms"] = {str(c): chain + kv_bytes(target, c) / bw / 1e6 for c in contexts}
        # a stricter yardstick beside the floor: every weight byte (and the live K/V) read
        # once at the copy bandwidth (which counts bytes read + written, so this is generous)
        wbytes = sum(t.numel() * t.element_size() for w in target.layers
                     for t in (w.wqkv, w.wo, w.w_gate_up, w.w_down)) + target.lm_head_weight.numel() * 2
        out["weight_bytes"] = wbytes
        out["byte_floor_ms"] = {str(c): (wbytes + kv_bytes(target, c)) / bw / 1e6 for c in contexts}
        # "triton-nopdl": the shipped Triton ops with their launches in plain stream order
        # (MEMRA_PDL=0 while its graphs capture), beside "triton" (PDL on, the default)
        out["dense_tuned"] = {f"{n}x{k}": asdict(c) for (n, k), c in dense_table.items()}
        variants = [v for v in a.variants.split(",") if v]
        wide_table = dict(dense_table)
        if a.dense_all:  # every shape of a sweep at its best tiles, for the "-all" variants
            for row in json.loads(a.dense_all.read_text())["shapes"]:
                if row.get("best_cfg"):
                    wide_table.setdefault((row["out"], row["in"]), _dense.KernelConfig(**row["best_cfg"]))
        for name in variants:
            parts = name.split("-")
            target.step_ops = TorchStepOps() if parts[0] == "torch" else TritonStepOps()
            if "unfused" in parts:  # the launch fusions undone (TritonStepOps.unfused): their A/B
                target.step_ops = target.step_ops.unfused()
            if "noglu" in parts:  # the MLP's gate/up matmul and SiLU·mul as two launches
                ops = target.step_ops
                ops.swiglu = functools.partial(unfused_swiglu, ops)
            if "nopdl" in parts:
                os.environ[_pdl.ENV] = "0"
            else:
                os.environ.pop(_pdl.ENV, None)
            # graphs capture which matmuls run where: set the table before the engine
            _dense.TUNED.clear()
            if "cublas" not in parts:
                _dense.TUNED.update(wide_table if "all" in parts else dense_table)
            _dense.PDL_PREFETCH = next((int(x[2:]) for x in parts if x.startswith("pf")), default_prefetch)
            if tile_variants:
                _attn.TILES[128] = cand_tile if "tile" in parts and cand_tile is not None else module_tile
            engine = Engine.from_model(target, step_width=W, cuda_graphs=True)
            plain, verify, greedy, peak = {}, {}, {}, {}
            for c in contexts:
                plain[str(c)], peak[str(c)] = step_ms(engine, c, 1)
                verify[str(c)], _ = step_ms(engine, c, W)
                greedy[str(c)] = greedy_step_ms(engine, c)
                print(f"{name} ctx {c}: plain {plain[str(c)]:.3f} ms, verify16 {verify[str(c)]:.3f} ms, "
                      f"greedy step {greedy[str(c)]:.3f} ms, floor {out['floor_ms'][str(c)]:.3f} ms, "
                      f"peak {peak[str(c)]:.1f} GiB", flush=True)
            out[name] = {"plain_ms": plain, "verify16_ms": verify, "greedy_step_ms": greedy, "peak_gib": peak,
                         "kernels_per_step": kernels_per_step(Engine.from_model(target, step_width=W)),
                         "kernels_per_greedy_step": kernels_per_step(Engine.from_model(target, step_width=W), greedy=True)}
            del engine
            torch.cuda.empty_cache()
        os.environ.pop(_pdl.ENV, None)
        _dense.TUNED.clear()
        _dense.TUNED.update(dense_table)
        _dense.PDL_PREFETCH = default_prefetch
        if tile_variants:  # the sweep below runs the candidate when one was given
            _attn.TILES[128] = cand_tile or module_tile
        out["pdl"] = _pdl.enabled(torch.device("cuda"))
        if "triton-nopdl" in out:
            out["pdl_plain_speedup"] = {c: out["triton-nopdl"]["plain_ms"][c] / out["triton"]["plain_ms"][c]
                                        for c in out["triton"]["plain_ms"]}
        if "triton-noglu" in out:
            out["glu_plain_speedup"] = {c: out["triton-noglu"]["plain_ms"][c] / out["triton"]["plain_ms"][c]
                                        for c in out["triton"]["plain_ms"]}
        if "triton-unfused" in out:  # the fusions' A/B: the step as runner.fixed_step runs it, and a greedy round's
            for key in ("plain_ms", "greedy_step_ms"):
                out[f"fused_speedup_{key[:-3]}"] = {c: out["triton-unfused"][key][c] / out["triton"][key][c]
                                                    for c in out["triton"][key]}
        if "triton-cublas" in out:
            out["dense_plain_speedup"] = {c: out["triton-cublas"]["plain_ms"][c] / out["triton"]["plain_ms"][c]
                                          for c in out["triton"]["plain_ms"]}
        # the headline keys: the shipped path (Triton ops)
        for k in ("plain_ms", "verify16_ms", "peak_gib", "kernels_per_step"):
            out[k] = out["triton"][k]
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))
        # exactness sweep: Triton ops, graphs on, verify window pinned at 16
        target.step_ops = TritonStepOps()
        draft = make_tiny_draft(Path(os.environ.get("TMPDIR", "/tmp")) / "ts_draft", "zlab", hidden=s["hidden"],
                                layers=s["d_layers"], heads=s["heads"], kv_heads=s["kv"], head_dim=s["hd"],
                                intermediate=s["ffn"], vocab=s["vocab"], mask_token_id=s["vocab"] - 1, block_size=16,
                                target_layer_ids=s["taps"], num_target_layers=s["layers"], dtype=torch.bfloat16, std=0.02)
        engine = Engine.from_model(target, step_width=W, cuda_graphs=True, draft_graphs=True)
        if a.prefill_length:
            out["prefill"] = prefill_measure(engine, a.prefill_length)
            print("prefill", json.dumps(out["prefill"]), flush=True)
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(out, indent=2))
        arm = engine.arm(ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(adapt="0"), verify_cap=16))
        sweep, t0 = [], time.perf_counter()
        lengths = [int(x) for x in a.sweep_lengths.split(",")]
        for length in lengths:
            for k in range(a.sweep_prompts):
                ids = torch.randint(0, s["vocab"] - 1, (length,), generator=torch.Generator().manual_seed(100 + k)).tolist()
                plain, _ = run_arm(engine, None, ids, a.sweep_tokens)
                oracle, tau = oracle_run(engine, ids, plain.tokens, seed=k)
                run = {"length": length, "prompt": k, "oracle_exact": oracle == plain.tokens, "oracle_tau": tau}
                if length == lengths[0] and k < 3:
                    spec, _ = run_arm(engine, arm, ids, a.sweep_tokens)
                    run["drafter_exact"] = spec.tokens == plain.tokens
                run["exact"] = run["oracle_exact"] and run.get("drafter_exact", True)
                sweep.append(run)
            print(f"sweep length {length}: {sum(r['exact'] for r in sweep if r['length'] == length)}/{a.sweep_prompts} exact, "
                  f"oracle tau {sum(r['oracle_tau'] for r in sweep if r['length'] == length) / a.sweep_prompts:.2f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            out["sweep"] = {"prompts": a.sweep_prompts, "tokens": a.sweep_tokens, "lengths": a.sweep_lengths,
                            "runs": sweep, "seconds": time.perf_counter() - t0, "partial": True}
            a.json.write_text(json.dumps(out, indent=2))  # a run cut short keeps the lengths done
        out["sweep"] = {"prompts": a.sweep_prompts, "tokens": a.sweep_tokens, "lengths": a.sweep_lengths,
                        "runs": sweep, "seconds": time.perf_counter() - t0}
        out["exact"] = all(r["exact"] for r in sweep)
    print(json.dumps({k: v for k, v in out.items() if k not in ("torch", "triton", "sweep")}, indent=1))
    print("sweep exact:", sum(r["exact"] for r in sweep), "/", len(sweep))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
