"""`memra serve` under load, and one client against `memra generate` (not a test).

Both parts start the server in this process on a loopback port (nothing else is reached) over
the embedded pair by default, and talk to it with the official `openai` client.

- `load`: REQUESTS streamed completions from CLIENTS concurrent clients over a prompt set, half
  greedy, half sampled with a seed. Every stream is compared with memra's plain decoding of the
  same target (same prompt, same sampling and seed; computed on the same engine before the
  server starts): the report counts errors and inexact streams (exit 1 on any), and gives p50 /
  p99 latency, p50 time to first token, and the total tok/s (completion tokens / wall time).
  Bounded: at most `--timeout-s` of wall time, each request at most that long.

      python benchmarks/serve_load.py load [--requests 200] [--clients 16] [--max-tokens 64]

- `single`: one client, one request at a time, interleaved per prompt with `memra generate
  --json` (the CLI in this process, the same flags) and with a warm in-process session of the
  same program (the engine's own loop, no HTTP): median per-request tok/s of each (server: the
  completion tokens over the request's wall time seen by the client, streamed; generate: its
  own tok_per_s) and the ratios server/generate and server/session. (A client in a process of
  its own measured the same ratio on the CPU: the client's parsing is not what it costs.)

      python benchmarks/serve_load.py single [--requests 16] [--max-tokens 256] [--device cuda]

`--target DIR --draft CKPT` serve another pair; `--json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("load", "single"))
    p.add_argument("--requests", type=int, default=None, help="load: 200; single: 16")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=None, help="load: 64; single: 256")
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--n-prompts", type=int, default=20, help="distinct prompts the requests cycle over")
    p.add_argument("--target", type=Path)
    p.add_argument("--draft", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    a.requests = a.requests if a.requests is not None else (200 if a.part == "load" else 16)
    a.max_tokens = a.max_tokens if a.max_tokens is not None else (64 if a.part == "load" else 256)
    for name in ("requests", "clients", "max_tokens", "n_prompts"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: expected an integer >= 1")
    if a.timeout_s <= 0:
        p.error(f"--timeout-s {a.timeout_s}: expected a positive number of seconds")
    return a


def _load(a: argparse.Namespace):
    """(engine, arm, target dir, served name) for the pair asked (the embedded one by default)."""
    import torch

    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.engine.defaults import default_models

    target, draft, _ = default_models(a.target, a.draft, "auto")
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=Path(target), device=a.device))
        arm = engine.arm(ArmConfig(draft=draft))
    return engine, arm, Path(target), "memra-embedded" if a.target is None else Path(target).resolve().name


def _requests(a: argparse.Namespace) -> list[dict]:
    """Request i: prompt i mod n, greedy when i is even, else sampled with seed i // 2 mod 3."""
    from memra_cli.engine.prompts import load_prompts

    texts = load_prompts(a.prompts, a.n_prompts).texts
    return [{"prompt": texts[i % len(texts)], "max_tokens": a.max_tokens,
             **({"temperature": 0.0} if i % 2 == 0 else {**SAMPLED, "seed": (i // 2) % 3})} for i in range(a.requests)]


def _plain_text(engine, codec, req: dict) -> str:
    """memra's plain decoding of `req` (no drafter): the text every stream must equal."""
    import torch

    from memra_cli.engine.spec.keyed import SamplingParams, make_sampler

    params = SamplingParams(**{k: v for k, v in req.items() if k in ("temperature", "top_p", "seed")})
    eos = set(engine.target.cfg.eos_token_ids)
    with torch.inference_mode(), engine.session(codec.encode(req["prompt"]), req["max_tokens"],
                                                sampler=make_sampler(params)) as s:
        tokens = s.run()
    return codec.decode([t for t in tokens if t not in eos])


def _stream(client, name: str, req: dict) -> dict:
    """One streamed request: its text, completion tokens, latency and time to first token."""
    t0 = time.perf_counter()
    first, parts, tokens = None, [], None
    for c in client.completions.create(model=name, stream=True, stream_options={"include_usage": True}, **req):
        if c.choices and c.choices[0].text:
            first = first if first is not None else time.perf_counter() - t0
            parts.append(c.choices[0].text)
        if c.usage is not None:
            tokens = c.usage.completion_tokens
    return {"text": "".join(parts), "tokens": tokens, "latency_s": time.perf_counter() - t0, "ttft_s": first}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_load(a: argparse.Namespace) -> dict:
    import openai

    from memra_cli.serve.app import ServerThread, Served, build_app

    from memra_cli.engine.threads import applied

    engine, arm, target, name = _load(a)
    served = Served.load(engine, arm, target, name=name, max_tokens=a.max_tokens, max_live=a.clients,
                         max_waiting=a.requests)
    reqs = _requests(a)
    keys = [json.dumps(r, sort_keys=True) for r in reqs]
    with applied(engine.threads):  # the engine's CPU thread choice, as the server's worker applies it
        want = {k: _plain_text(engine, served.codec, r) for k, r in zip(keys, reqs)}  # before the worker owns the engine
    results: list[dict | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))
    lock = threading.Lock()
    with ServerThread(build_app(served)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=a.timeout_s)

        def worker() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None or time.perf_counter() > deadline:
                    return
                try:
                    results[i] = _stream(client, name, reqs[i])
                except Exception as exc:  # counted, not raised: the run reports every request
                    results[i] = {"error": f"{type(exc).__name__}: {exc}"}

        t0 = time.perf_counter()
        deadline = t0 + a.timeout_s
        with ThreadPoolExecutor(a.clients) as pool:
            wait([pool.submit(worker) for _ in range(a.clients)], timeout=a.timeout_s + 5)
        wall = time.perf_counter() - t0
    done = [r for r in results if r is not None and "error" not in r]
    inexact = [i for i, r in enumerate(results) if r is not None and "error" not in r and r["text"] != want[keys[i]]]
    errors = [r["error"] if r else "not run (time out)" for r in results if r is None or "error" in r]
    tokens = sum(r["tokens"] or 0 for r in done)
    lat = [r["latency_s"] for r in done]
    return {"part": "load", "requests": len(reqs), "clients": a.clients, "max_tokens": a.max_tokens,
            "device": str(engine.device), "mode": arm.mode, "completed": len(done), "errors": len(errors),
            "first_errors": errors[:3], "inexact": len(inexact), "inexact_requests": inexact[:10],
            "latency_p50_s": _percentile(lat, 0.5), "latency_p99_s": _percentile(lat, 0.99),
            "ttft_p50_s": _percentile([r["ttft_s"] for r in done if r["ttft_s"] is not None], 0.5),
            "completion_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall if wall > 0 else None}


def _generate_tok_s(a: argparse.Namespace, req: dict) -> float:
    """`memra generate --json` in this process, greedy: its own tok_per_s."""
    from typer.testing import CliRunner

    from memra_cli.cli.app import app

    args = ["generate", "--prompt", req["prompt"], "--max-new", str(req["max_tokens"]), "--device", a.device, "--json"]
    args += ["--target", str(a.target)] if a.target else []
    args += ["--draft", str(a.draft)] if a.draft else []
    r = CliRunner().invoke(app, args)
    if r.exit_code != 0:
        raise SystemExit(f"memra generate failed: {r.output}")
    return json.loads(r.stdout)["stats"]["tok_per_s"]


def _session_tok_s(engine, arm, codec, req: dict) -> float:
    """A warm in-process session of the served program, rounds read one by one as the server reads them."""
    import torch

    with torch.inference_mode(), engine.session(codec.encode(req["prompt"]), req["max_tokens"], arm) as s:
        while not s.finished:
            s.burst(1)
    return s.stats.as_json()["tok_per_s"]


def run_single(a: argparse.Namespace) -> dict:
    import openai

    from memra_cli.engine.threads import applied
    from memra_cli.serve.app import ServerThread, Served, build_app

    engine, arm, target, name = _load(a)
    served = Served.load(engine, arm, target, name=name, max_tokens=a.max_tokens)
    own, own_arm, _, _ = _load(a)  # the session arm's engine: the server's belongs to its worker thread
    reqs = [{"prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0.0} for r in _requests(a)]  # greedy
    arms: dict[str, list[float]] = {"server": [], "generate": [], "session": []}
    with ServerThread(build_app(served)) as url, applied(own.threads):  # the session arm's thread count, as served
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=a.timeout_s)
        _stream(client, name, reqs[0]), _session_tok_s(own, own_arm, served.codec, reqs[0])  # warm-up, not counted
        for i, req in enumerate(reqs):
            order = ["server", "generate", "session"]
            for which in order[i % 3:] + order[:i % 3]:  # the order rotates per prompt
                if which == "server":
                    r = _stream(client, name, req)
                    arms["server"].append(r["tokens"] / r["latency_s"])
                elif which == "generate":
                    arms["generate"].append(_generate_tok_s(a, req))
                else:
                    arms["session"].append(_session_tok_s(own, own_arm, served.codec, req))
    med = {k: statistics.median(v) for k, v in arms.items()}
    return {"part": "single", "requests": len(reqs), "max_tokens": a.max_tokens, "device": str(engine.device),
            "mode": arm.mode, "median_tok_per_s": med, "server_over_generate": med["server"] / med["generate"],
            "server_over_session": med["server"] / med["session"]}


def _print(report: dict) -> None:
    if report["part"] == "load":
        r = report
        print(f"serve load ({r['device']}, {r['mode']}): {r['requests']} requests x {r['max_tokens']} tokens from "
              f"{r['clients']} clients: {r['completed']} completed, {r['errors']} errors, {r['inexact']} inexact")
        print(f"latency p50 {r['latency_p50_s']:.3f} s, p99 {r['latency_p99_s']:.3f} s; time to first token p50 "
              f"{r['ttft_p50_s']:.3f} s; {r['completion_tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_per_s']:.1f} tok/s")
        for e in r["first_errors"]:
            print(f"error: {e}")
    else:
        m = report["median_tok_per_s"]
        print(f"one client ({report['device']}, {report['mode']}), {report['requests']} requests x {report['max_tokens']} "
              f"tokens, median tok/s: server {m['server']:.1f}, generate {m['generate']:.1f}, session {m['session']:.1f}")
        print(f"server / generate = {report['server_over_generate']:.3f}; server / session = "
              f"{report['server_over_session']:.3f}")


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    report = run_load(a) if a.part == "load" else run_single(a)
    print(json.dumps(report)) if a.json else _print(report)
    return 1 if report["part"] == "load" and (report["errors"] or report["inexact"]) else 0


if __name__ == "__main__":
    sys.exit(main())
