"""Where a speculative round of the embedded pair goes on the GPU, part by part, in one process.

A graphed greedy round (spec/round_bodies.py) is one replay: the drafter's block forward and
heads (propose), the 16-row target step (verify) and the drafter's ingest of the verified rows.
On the embedded pair every part is a chain of tiny kernels, so a part costs about its kernel
count times a few microseconds. This script measures, for each arm (bf16, the engine's
defaults):

- ``round_replay_gpu_ms``: the round's graph replayed back to back from the same inputs (CUDA events: GPU time);
- ``parts``: the round's body (spec/round_bodies.py `_round_core`) split into propose (the
  round's positions, the block forward and heads with the candidates), verify (the greedy step
  with its picks) and ingest, the same calls the body makes, each run eagerly under the torch
  profiler: kernel count, summed GPU microseconds and the heaviest kernels (eager kernel times
  are what the graph replays, without the launch gaps). The settlement is not in a part.

Whole sessions (prefill included, graphs captured first) are embedded_session.py's.

JSON to ``--json`` (default ``$OUT/h200-embedded-round.json``).

    python -m benchmarks.gpu.embedded_round [--arm dspark --arm dflash:adapt=0]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.gpu.embedded_plain import events_ms, kernel_profile, wall_ms

from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
from memra_cli.engine.prompts import load_prompts
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.spec.proposer import static_proposal
from memra_cli.engine.spec.round_bodies import greedy_step
from memra_cli.engine.text import TextCodec

ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


def round_parts(engine: Engine, arm, prompt: list[int], reps: int) -> dict:
    """Prime a session, run a few graphed rounds, then time its round graph and profile the
    body's parts eagerly at the session's current position."""
    s = engine.session(prompt, 96, arm, eos_ids=())
    s.prime()
    for _ in range(4):
        s.burst(1)
    out: dict = {"graphed_rounds": bool(getattr(s, "graphed_rounds", False))}
    cache, kv = s.cache, s.proposer.kv
    start = cache.length
    last = int(s.last_id) if s.last_id is not None else int(s.last.item())
    chain = next((g for key, g in cache.graphs.items() if key[0] == "spec-chain"), None)
    graph = None if chain is None else chain.graphs.get(cache.graph_variant)
    if graph is not None and torch.cuda.is_available():
        s.chained.drain()  # the round queued ahead, read before its graph is replayed again
        # a chained round writes the next round's inputs: each timed replay starts from this round's
        seed = torch.tensor([start, start, last, s.vt, 96], dtype=torch.long, device=engine.target.device)

        def replay():
            chain.inputs.copy_(seed)
            graph.graph.replay()

        out["round_replay_gpu_ms"] = round(events_ms(replay, reps), 4)
    target, drafter, program = engine.target, s.proposer.drafter, s.program
    width = engine.runner.width
    dev = target.device
    b = drafter.cfg.block_size
    mask_ids = torch.full((b,), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
    inputs = torch.tensor([start, start, last], dtype=torch.long, device=dev)  # a round's [t_start, d_start, last]
    want_raws = program.window.is_confidence
    taps = tuple(s.taps)
    holder: dict = {}

    def propose():  # as the round's body: its positions in one add, then the proposal with the candidates
        holder["verify_at"], holder["at"] = drafter.round_positions(inputs[0:2], b, width)
        holder["cand"] = static_proposal(drafter, target, program, kv, inputs[2:3], mask_ids, inputs[1], want_raws,
                                         at=holder["at"], want_chain=True).chain

    def verify():
        cand = holder["cand"]
        cand = cand[:width] if cand.shape[0] >= width else torch.cat([cand, cand[-1:].expand(width - cand.shape[0])])
        _, holder["taps"] = greedy_step(target, cand, holder["verify_at"], cache, taps)

    def ingest():
        drafter.static_ingest(kv, holder["taps"], inputs[1], holder["at"].span[: holder["taps"].shape[0]])

    with torch.inference_mode():
        propose()  # each part once (a warm-up, and on the CPU the smoke run of all three)
        verify()
        ingest()
        out["parts"] = {name: kernel_profile(fn) for name, fn in
                        (("propose", propose), ("verify", verify), ("ingest", ingest))}
    for name, prof in out["parts"].items():
        print(f"  {name}: {prof['kernels']} kernels, {prof['gpu_us']} us", flush=True)
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--arm", action="append", default=None, help="dspark | dflash, with :key=value settings as the bench's arms (repeatable)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "h200-embedded-round.json"))
    args = ap.parse_args()
    codec = TextCodec(ASSETS / "target")
    prompts = [codec.encode(t) for t in load_prompts("humaneval", 1).texts]  # one session's round
    engine = Engine.load(EngineConfig(target=ASSETS / "target", device=args.device, dtype="bfloat16"))
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "notes": engine.notes, "arms": {}}
    for spec in args.arm or ["dspark", "dflash"]:
        mode, _, setting = spec.partition(":")
        settings = PolicySettings(**dict(kv.split("=", 1) for kv in setting.split(",") if kv))
        arm = engine.arm(ArmConfig(draft=ASSETS / mode, mode=mode, settings=settings))
        print(spec, flush=True)
        rec = round_parts(engine, arm, prompts[0], args.reps)

        print(" ", json.dumps({k: v for k, v in rec.items() if k != "parts"}), flush=True)
        report["arms"][spec] = rec
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
