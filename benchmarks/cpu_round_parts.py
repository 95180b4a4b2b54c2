"""Where a speculative round's time goes on the CPU, piece by piece, inside whole sessions (not a test).

Runs the embedded pair's DSpark arm (or `--arm dflash`) over the first N HumanEval prompts,
eager rounds as `memra bench` runs them on the CPU, with a wall clock around each of the
drafter's pieces: the proposal and, inside it, the block forward, the target's lm_head (the
verify's call and the draft's, together), the markov chain, the confidence head; and the ingest.
One untimed warm-up pass first (it builds the chain's bias table, ~0.5 s, which a timed pass
would charge to the chain). Timing inside sessions matters here: every round's matmuls evict the
caches, so a piece costs 2-4x what it costs timed alone in a loop.

`--chain torch` makes the eager rounds take the torch loop of the markov chain instead of the
numpy one (the A/B of docs/perf.md, "The DSpark round on the CPU"; the numpy loop's own line is
printed only when it ran); `--passes` repeats
the timed pass (each pass is printed, then the median ms/token of all).

    python -m benchmarks.cpu_round_parts [--n 12] [--max-new 128] [--arm dspark] [--chain numpy|torch] [--passes 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--arm", choices=("dspark", "dflash"), default="dspark")
    p.add_argument("--chain", choices=("numpy", "torch"), default="numpy")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    for name in ("n", "max_new", "passes", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: expected an integer >= 1")
    torch.set_num_threads(a.threads)

    import memra_cli.assets as assets
    import memra_cli.engine.spec.proposer as proposer
    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.text import TextCodec

    root = Path(assets.__file__).parent
    engine = Engine.load(EngineConfig(target=root / "target", device="cpu", dtype="float32"))
    codec = TextCodec(root / "target")
    prompts = [codec.encode(t, chat=False) for t in load_prompts("humaneval", a.n).texts]
    arm = engine.arm(ArmConfig(draft=root / a.arm, mode=a.arm))

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def clock(owner, name: str, label: str, **force) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            kwargs.update(force)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(owner, name, timed)

    import memra_cli.engine.layers.torch_step_ops as torch_step_ops

    drafter = arm.drafter
    clock(torch_step_ops, "markov_chain_host", "  (of which the numpy loop)")  # counts that --chain took effect
    clock(proposer.DrafterProposer, "propose", "propose")
    clock(proposer.DrafterProposer, "ingest", "ingest")
    clock(drafter, "forward_round", "  block forward")
    clock(engine.target, "lm_head", "  lm_head (verify + draft)")
    clock(drafter, "markov_chain", "  markov chain", **({"host_loop": False} if a.chain == "torch" else {}))
    clock(drafter, "confidence_raw", "  confidence head")

    def one_pass() -> tuple[float, int]:
        t0, tokens = time.perf_counter(), 0
        for ids in prompts:
            with engine.session(ids, a.max_new, arm) as s:
                s.prime()
                tokens += len(s.run())
        return time.perf_counter() - t0, tokens

    one_pass()  # warm-up: the bias table, first-touch allocations
    per_token = []
    for i in range(a.passes):
        spent.clear()
        calls.clear()
        wall, tokens = one_pass()
        rounds = calls["propose"]
        per_token.append(1e3 * wall / tokens)
        print(f"pass {i + 1}: {per_token[-1]:.3f} ms/token, {rounds} rounds, {tokens / max(rounds, 1):.2f} tokens/round "
              f"(threads {a.threads}, chain {a.chain})")
        for label in spent:
            print(f"  {label:28s} {1e3 * spent[label] / rounds:7.3f} ms/round  ({calls[label] / rounds:.2f} calls/round)")
    print(f"median {statistics.median(per_token):.3f} ms/token")


if __name__ == "__main__":
    main()
