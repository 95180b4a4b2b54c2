"""Where a speculative round's time goes on the CPU, piece by piece, inside whole sessions (not a test).

Runs the embedded pair's DSpark arm (or `--arm dflash`) over the first N HumanEval prompts,
eager rounds as `memra bench` runs them on the CPU, with a wall clock around each of the
drafter's pieces: the proposal and, inside it, the block forward, the target's lm_head (the
verify's call and the draft's, together), the markov chain, the confidence head; and the ingest.
One untimed warm-up pass first (it builds the chain's bias table, ~0.5 s, which a timed pass
would charge to the chain). Timing inside sessions matters here: every round's matmuls evict the
caches, so a piece costs 2-4x what it costs timed alone in a loop.

The target's step is timed too (`verify step`: the runner's fixed-width step of the round's
candidates). `--arm plain` runs the bench's plain baseline instead (`Engine.fastest_plain`: one-row
variable-width steps), so the two steps can be set side by side.

`--chain torch` makes the eager rounds take the torch loop of the markov chain instead of the
numpy one (the A/B of docs/perf.md, "The DSpark round on the CPU"; the numpy loop's own line is
printed only when it ran); `--passes` repeats
the timed pass (each pass is printed, then the median ms/token of all).

`--profile` adds one pass under `torch.profiler`, each timed piece a region of it: per region,
the ms a round of weight matmuls (oneDNN's and MKL's GEMMs), of attention's batched matmuls and of
every other op, with the count of ops a round; then the ops that cost the most a round. The
profiler adds a little to every op, so compare its columns with each other, not with the clock.
`--threads N` sets the thread count of every step, `--wide N` gives steps of 8+ rows N threads
instead (the thread policy's wide count, as `memra bench` applies it; engine/threads.py).
`--cprofile N` prints the N functions of most own time over one more pass (Python's cProfile).
`--steps N` first times the two target steps alone, N times each after the first prompt's
prefill (median): the fixed-width step the speculative arms verify with and the plain arm's
one-row step, each also with its weight matmuls stood in by a kept zero output of their shape,
which leaves what the step spends outside them (the values that follow are zeros, so this is
an estimate of the ops' cost, not of their arithmetic on real values).

    python -m benchmarks.cpu_round_parts [--n 12] [--max-new 128] [--arm dspark|dflash|plain] [--chain numpy|torch]
        [--passes 2] [--profile] [--cprofile 25] [--steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import collections
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch


GEMMS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")  # the weight matmuls (oneDNN's, MKL's)
ATTENTION_MATMULS = ("aten::bmm",)  # attention's scores and weighted values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--arm", choices=("dspark", "dflash", "plain"), default="dspark")
    p.add_argument("--chain", choices=("numpy", "torch"), default="numpy")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wide", type=int, default=None, help="threads for steps of 8+ rows (default: --threads)")
    p.add_argument("--profile", action="store_true", help="one more pass under torch.profiler, by region and op")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="one more pass under cProfile: its top N")
    p.add_argument("--steps", type=int, default=0, metavar="N", help="first time the fixed and one-row steps alone")
    a = p.parse_args(argv)
    for name in ("n", "max_new", "passes", "threads", "wide"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: expected an integer >= 1")
    for name in ("cprofile", "steps"):
        if getattr(a, name) < 0:
            p.error(f"--{name} {getattr(a, name)}: expected an integer >= 0")
    from memra_cli.engine.threads import ThreadChoice, applied

    with applied(ThreadChoice(a.threads, None, a.wide)):
        run(a)


def run(a: argparse.Namespace) -> None:
    """The passes (and profiles) main's arguments ask for, under the applied thread choice."""

    import memra_cli.assets as assets
    import memra_cli.engine.spec.proposer as proposer
    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.text import TextCodec

    root = Path(assets.__file__).parent
    engine = Engine.load(EngineConfig(target=root / "target", device="cpu", dtype="float32"))
    codec = TextCodec(root / "target")
    prompts = [codec.encode(t, chat=False) for t in load_prompts("humaneval", a.n).texts]
    if a.steps:
        time_steps(engine, prompts[0], a.steps)
    if a.arm == "plain":
        engine, arm = engine.fastest_plain(), None
    else:
        arm = engine.arm(ArmConfig(draft=root / a.arm, mode=a.arm))

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    regions: list[str] = []  # the labels, in the order they were clocked

    def clock(owner, name: str, label: str, **force) -> None:
        inner = getattr(owner, name)
        regions.append(label)

        def timed(*args, **kwargs):
            kwargs.update(force)
            t0 = time.perf_counter()
            try:
                with torch.profiler.record_function(label.strip()):
                    return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, timed)

    import memra_cli.engine.layers.torch_step_ops as torch_step_ops

    clock(engine.runner, "step", "verify step" if arm is not None else "step")
    if arm is not None:
        drafter = arm.drafter
        clock(torch_step_ops, "markov_chain_host", "  (of which the numpy loop)")  # counts that --chain took effect
        clock(proposer.DrafterProposer, "propose", "propose")
        clock(proposer.DrafterProposer, "ingest", "ingest")
        clock(drafter, "forward_round", "  block forward")
        clock(engine.target, "lm_head", "  lm_head (verify + draft)")
        # at the drafter's step ops: a round that sizes its window from the raws runs both through
        # their one op (`markov_chain_confidence`), which calls these two
        clock(drafter.step_ops, "markov_chain", "  markov chain", **({"host_loop": False} if a.chain == "torch" else {}))
        clock(drafter.step_ops, "confidence_raw", "  confidence head")

    def one_pass() -> tuple[float, int]:
        t0, tokens = time.perf_counter(), 0
        for ids in prompts:
            with engine.session(ids, a.max_new, arm) as s:
                s.prime()
                tokens += len(s.run())
        return time.perf_counter() - t0, tokens

    def rounds_of() -> int:
        return calls["propose"] if arm is not None else calls["step"]

    one_pass()  # warm-up: the bias table, first-touch allocations
    per_token = []
    for i in range(a.passes):
        spent.clear()
        calls.clear()
        wall, tokens = one_pass()
        rounds = rounds_of()
        per_token.append(1e3 * wall / tokens)
        print(f"pass {i + 1}: {per_token[-1]:.3f} ms/token, {rounds} rounds, {tokens / max(rounds, 1):.2f} tokens/round, "
              f"{1e3 * wall / max(rounds, 1):.3f} ms/round (arm {a.arm}, threads {a.threads}, wide {a.wide or a.threads}, chain {a.chain})")
        for label in spent:
            print(f"  {label:28s} {1e3 * spent[label] / rounds:7.3f} ms/round  ({calls[label] / rounds:.2f} calls/round)")
    print(f"median {statistics.median(per_token):.3f} ms/token")
    if a.profile:
        calls.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            one_pass()
        print_profile(prof, [r.strip() for r in regions], rounds_of())
    if a.cprofile:
        calls.clear()
        profiler = cProfile.Profile()
        profiler.runcall(one_pass)
        print(f"cProfile, one pass ({rounds_of()} rounds), the {a.cprofile} functions of most own time:")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(a.cprofile)


def time_steps(engine, prompt: list[int], reps: int) -> None:
    """The engine's fixed-width step and its plain baseline's one-row step, timed alone over the
    state after `prompt`'s prefill (each step rolled back), with and without weight matmuls."""
    width = engine.step_width
    rows = [(f"{width}-row fixed step (the verify's)", engine.runner, width),
            ("one-row plain step (the plain arm's)", engine.fastest_plain().runner, 1)]
    for label, runner, n in rows:
        state = runner.new_state(len(prompt) + 2 * max(n, 16))
        runner.prefill(torch.tensor(prompt), state)
        start, ids = state.length, torch.tensor(prompt[:n])

        def median_ms() -> float:
            times = []
            for _ in range(reps + 10):  # the first 10 warm up
                t0 = time.perf_counter()
                runner.step(ids, start, state)
                times.append(time.perf_counter() - t0)
                state.rollback(start)
            return 1e3 * statistics.median(times[10:])

        whole = median_ms()
        with no_weight_matmuls():
            outside = median_ms()
        print(f"{label}: {whole:.3f} ms, {outside:.3f} ms of it outside the weight matmuls "
              f"({len(prompt)}-token prompt, median of {reps})")


@contextlib.contextmanager
def no_weight_matmuls():
    """F.linear and the CPU step ops' oneDNN matmul return a kept zero tensor of their output's
    shape instead of computing it (what a step spends outside its weight matmuls)."""
    import torch.nn.functional as F

    import memra_cli.engine.layers.torch_step_ops as torch_step_ops

    kept: dict[tuple, torch.Tensor] = {}

    def stand_in(x, w, bias=None):
        shape = (*x.shape[:-1], w.shape[0])
        out = kept.get((shape, x.dtype))
        if out is None:
            out = kept[(shape, x.dtype)] = torch.zeros(shape, dtype=x.dtype)
        return out

    saved = F.linear, torch_step_ops.onednn_linear
    F.linear, torch_step_ops.onednn_linear = stand_in, stand_in
    try:
        yield
    finally:
        F.linear, torch_step_ops.onednn_linear = saved


def region_ops(prof, regions: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per region (a `record_function` label), per op name, [self CPU µs, calls] of the ops run
    inside it and not inside a region nested in it; ops outside every region go to `(rest)`."""
    out: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))

    def walk(evt, region: str) -> None:
        if evt.name in regions:
            region = evt.name
        else:
            entry = out[region][evt.name]
            entry[0] += evt.self_cpu_time_total
            entry[1] += 1
        for child in evt.cpu_children:
            walk(child, region)

    for evt in prof.events():
        if evt.cpu_parent is None:
            walk(evt, "(rest)")
    return out


def print_profile(prof, regions: list[str], rounds: int, top: int = 15) -> None:
    """The profiled pass by region (GEMMs / attention matmuls / other ops, ms a round, and ops
    a round), then its costliest ops a round."""
    per_region = region_ops(prof, regions)
    print(f"torch.profiler, one pass ({rounds} rounds; ms/round of self CPU time, ops/round):")
    print(f"  {'region':26s} {'GEMMs':>7s} {'attn mm':>8s} {'other':>7s} {'ops':>7s}")
    everything: collections.Counter = collections.Counter()
    for region in [*regions, "(rest)"]:
        ops = per_region.get(region)
        if not ops:
            continue
        gemm = sum(v[0] for k, v in ops.items() if k in GEMMS)
        attn = sum(v[0] for k, v in ops.items() if k in ATTENTION_MATMULS)
        other = sum(v[0] for k, v in ops.items() if k not in GEMMS and k not in ATTENTION_MATMULS)
        count = sum(v[1] for k, v in ops.items() if k.startswith(("aten::", "mkldnn::")))
        print(f"  {region:26s} {gemm / 1e3 / rounds:7.3f} {attn / 1e3 / rounds:8.3f} {other / 1e3 / rounds:7.3f} "
              f"{count / rounds:7.1f}")
        for k, v in ops.items():
            everything[k] += v[0]
    print(f"  the {top} costliest ops (µs/round of self CPU time): " + ", ".join(
        f"{name} {us / rounds:.0f}" for name, us in everything.most_common(top)))


if __name__ == "__main__":
    main()
