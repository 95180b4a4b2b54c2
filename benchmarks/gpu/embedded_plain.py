"""Where a plain decode token of the embedded target goes on the GPU, in one process.

The embedded target (5.8M parameters, 6 layers, hidden 256) is far too small to be bound by
memory: a one-row step is a chain of tiny kernels, and the Python round around it. This script
separates the two (CUDA events; bf16; the engine's defaults):

- ``replay_gpu_ms``: one step's graph replayed back to back (GPU time per step, host hidden);
- ``step_call_ms``: `runner.step` called in a loop with a host read per step (the runner's
  Python + one replay + the sync);
- ``round_replay_gpu_ms`` / ``round_run_ms``: the step + argmax as one graph (what a graphed
  session replays per plain token, runtime/round_graphs.py): replayed back to back, and run with
  its input copy and its read;
- ``session_ms_per_token``: the bench's `plain` arm (`Engine.fastest_plain`, one-row graphed
  steps) over whole 128-token sessions, prefill included, and the same sessions' rounds after
  the prefill alone, with the next round queued before the host reads a token (the default)
  and without (MEMRA_PIPELINE=0);
- ``kernels``: CUDA kernels of one eager step (torch profiler), with the heaviest listed,

for the one-row steps (the fastest plain decoding) and the 16-row steps (the fixed-width plain
reference and the verify step). JSON to ``--json`` (default ``$OUT/h200-embedded-plain.json``).

    python -m benchmarks.gpu.embedded_plain [--prompts 8] [--max-new 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks import timing
from memra_cli.engine.api import Engine, EngineConfig
from memra_cli.engine.prompts import load_prompts
from memra_cli.engine.text import TextCodec

ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


events_ms = timing.mean_ms  # GPU ms per call of `reps` back-to-back calls (no syncs between)
wall_ms = timing.wall_ms
sync = timing.sync


def kernel_profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {"kernels": None, "gpu_us": None, "top": []}
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"kernels": sum(e.count for e in rows),
            "gpu_us": round(sum(e.self_device_time_total for e in rows), 1),
            "top": [[e.key[:80], e.count, round(e.self_device_time_total, 1)] for e in rows[:12]]}


def measure(engine: Engine, prompt: list[int], label: str, reps: int) -> dict:
    runner, dev = engine.runner, engine.device
    width = runner.width
    state = runner.new_state(len(prompt) + 512)
    try:
        ids = torch.tensor(prompt, dtype=torch.long, device=dev)
        logits, _ = runner.prefill(ids, state)
        tok = logits.argmax(-1)
        start = state.length
        row = torch.full((width or 1,), int(tok), dtype=torch.long, device=dev)

        def step_and_read():
            runner.step(row[:1], start, state)  # rolls back to `start` each time: same work
            return int(tok)

        def step_read_host():
            lg, _ = runner.step(row[:1], start, state)
            return int(lg.argmax(-1))

        out = {"width": width, "graphs": runner.cuda_graphs}
        out["step_call_ms"] = round(wall_ms(step_read_host, reps), 4)
        graph = state.graphs.get(("step", ())) if runner.cuda_graphs else None
        if graph is not None:
            out["replay_gpu_ms"] = round(events_ms(graph.graph.replay, reps), 4)
            out["replay_wall_ms"] = round(wall_ms(graph.graph.replay, reps), 4)
        if runner.cuda_graphs:  # the step + argmax as one graph, as a graphed session decodes
            from memra_cli.engine.runtime.round_graphs import RoundGraph
            from memra_cli.engine.spec.round_bodies import plain_step

            try:  # (not yet run on a GPU when written: a failure is reported, not fatal)
                rg = RoundGraph(plain_step(engine.target, state, width), (state.max_len - width, 0), dev)
                out["round_replay_gpu_ms"] = round(events_ms(rg.graph.replay, reps), 4)
                out["round_run_ms"] = round(wall_ms(lambda: rg.run((start, int(tok))), reps), 4)
            except Exception as e:  # noqa: BLE001
                out["round_error"] = f"{type(e).__name__}: {e}"
        positions = torch.arange(start, start + (width or 1), device=dev)
        out["eager_step_gpu"] = kernel_profile(lambda: engine.target.static_step(row, positions, state, None))
        print(label, json.dumps({k: v for k, v in out.items() if k != "eager_step_gpu"}),
              "kernels", out["eager_step_gpu"]["kernels"], "gpu_us", out["eager_step_gpu"]["gpu_us"], flush=True)
        return out
    finally:
        runner.release(state)


def session_ms_per_token(engine: Engine, prompts: list[list[int]], max_new: int, decode_only: bool = False) -> float:
    """Whole sessions (prefill included, as the bench times them), or with `decode_only` the
    rounds after the prefill alone."""
    for p in prompts[:2]:
        engine.session(p, max_new).run()
    sync()
    elapsed, n = 0.0, 0
    for p in prompts:
        s = engine.session(p, max_new, eos_ids=())
        t = time.perf_counter()
        if decode_only:
            s.prime()
            sync()
            t = time.perf_counter()
        n += len(s.run())
        sync()
        elapsed += time.perf_counter() - t
    return elapsed * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no graphs, no events)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "h200-embedded-plain.json"))
    args = ap.parse_args()
    codec = TextCodec(ASSETS / "target")
    prompts = [codec.encode(t) for t in load_prompts("humaneval", args.prompts).texts]
    engine = Engine.load(EngineConfig(target=ASSETS / "target", device=args.device, dtype="bfloat16"))
    plain = engine.fastest_plain()
    report: dict = {"device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
                    "notes": engine.notes}
    report["one_row"] = measure(plain, prompts[0], "one-row", args.reps)
    report["fixed16"] = measure(engine, prompts[0], "fixed-16", args.reps)
    default = plain.pipelined
    for pipelined in (True, False) if default else (False,):  # every graph captured before timing
        plain.pipelined = pipelined
        session_ms_per_token(plain, prompts, args.max_new)
    plain.pipelined = default
    session_ms_per_token(engine, prompts, args.max_new)
    report["session_ms_per_token"] = {
        "plain (Engine.fastest_plain)": round(session_ms_per_token(plain, prompts, args.max_new), 4),
        "off (fixed 16-row steps)": round(session_ms_per_token(engine, prompts, args.max_new), 4),
        "plain, rounds after the prefill": round(session_ms_per_token(plain, prompts, args.max_new, True), 4),
    }
    if plain.pipelined:  # the same sessions with each token read before the next round is queued
        plain.pipelined = False
        report["session_ms_per_token"]["plain, unpipelined (MEMRA_PIPELINE=0)"] = round(
            session_ms_per_token(plain, prompts, args.max_new), 4)
        report["session_ms_per_token"]["plain, unpipelined, rounds after the prefill"] = round(
            session_ms_per_token(plain, prompts, args.max_new, True), 4)
        plain.pipelined = True
    print("session ms/token", report["session_ms_per_token"], flush=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
