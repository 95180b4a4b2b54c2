"""Where a whole session of the embedded pair goes: creation, prefill, rounds, close.

The bench times whole generations (prefill included), so a session's fixed costs count against
every arm: at 128 new tokens a millisecond of set-up is 8 us a token. This script runs each arm
over the prompts twice (the first pass captures every storage bucket's graphs, the second is
timed) and splits every session's wall time, synchronizing at each boundary:

- ``create_ms``: `Engine.session(...)` (arm resolution, storage from the pool);
- ``prime_ms``: the prefill (and the drafter's prompt ingest);
- ``rounds_ms`` / ``tokens``: the decode rounds after it;
- ``close_ms``: handing the storages back;

and profiles one session's creation + prime on the host (cProfile, top functions by cumulative
time). JSON to ``--json`` (default ``$OUT/h200-embedded-session.json``).

    python -m benchmarks.gpu.embedded_session [--prompts 32] [--arm plain --arm dspark]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

from benchmarks.timing import sync
from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
from memra_cli.engine.prompts import load_prompts
from memra_cli.engine.text import TextCodec

ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


def one(make, prompt: list[int], max_new: int) -> dict:
    sync()
    t0 = time.perf_counter()
    s = make(prompt, max_new)
    t1 = time.perf_counter()
    s.prime()
    sync()
    t2 = time.perf_counter()
    out = s.run()
    sync()
    t3 = time.perf_counter()
    s.close()
    t4 = time.perf_counter()
    return {"create_ms": 1e3 * (t1 - t0), "prime_ms": 1e3 * (t2 - t1), "rounds_ms": 1e3 * (t3 - t2),
            "close_ms": 1e3 * (t4 - t3), "tokens": len(out), "rounds": s.stats.rounds,
            "prompt": len(prompt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arm", action="append", default=None, help="plain | off | dspark | dflash")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "h200-embedded-session.json"))
    args = ap.parse_args()
    codec = TextCodec(ASSETS / "target")
    prompts = [codec.encode(t) for t in load_prompts("humaneval", args.prompts).texts]
    engine = Engine.load(EngineConfig(target=ASSETS / "target", device=args.device, dtype="bfloat16"))
    plain = engine.fastest_plain()
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "arms": {}}
    for name in args.arm or ["plain", "dspark", "dflash"]:
        if name == "plain":
            def make(p, n, e=plain):
                return e.session(p, n, eos_ids=())
        elif name == "off":
            def make(p, n, e=engine):
                return e.session(p, n, eos_ids=())
        else:
            arm = engine.arm(ArmConfig(draft=ASSETS / name, mode=name))

            def make(p, n, arm=arm):
                return engine.session(p, n, arm, eos_ids=())
        with torch.inference_mode():
            for p in prompts:  # first pass: captures
                one(make, p, args.max_new)
            runs = [one(make, p, args.max_new) for p in prompts]
            prof = cProfile.Profile()
            prof.enable()
            s = make(prompts[0], args.max_new)
            s.prime()
            sync()
            prof.disable()
            s.close()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        tot = {k: sum(r[k] for r in runs) for k in ("create_ms", "prime_ms", "rounds_ms", "close_ms", "tokens", "rounds")}
        rec = {"per_session_ms": {k: round(tot[k] / len(runs), 3) for k in ("create_ms", "prime_ms", "rounds_ms", "close_ms")},
               "ms_per_token": round(sum(tot[k] for k in ("create_ms", "prime_ms", "rounds_ms", "close_ms")) / tot["tokens"], 4),
               "decode_ms_per_token": round(tot["rounds_ms"] / tot["tokens"], 4),
               "tokens_per_round": round(tot["tokens"] / max(tot["rounds"], 1), 3),
               "mean_prompt": round(sum(r["prompt"] for r in runs) / len(runs), 1),
               "prime_profile": buf.getvalue()[:6000]}
        print(name, json.dumps({k: v for k, v in rec.items() if k != "prime_profile"}), flush=True)
        report["arms"][name] = rec
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
