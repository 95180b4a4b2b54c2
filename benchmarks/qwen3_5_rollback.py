"""Stash vs replay rollback of the Qwen3.5 DeltaNet state, on the CPU (f32, one thread).

    python -m benchmarks.qwen3_5_rollback [--out DIR] [--reps N] [--step-width N|variable]

Writes a random mid-size hybrid target (hidden 1024, 8 layers = 6 Gated DeltaNet + 2 attention,
16 value heads x 128 x 128 f32 state = 1 MiB per DeltaNet layer), prefills 256 tokens, then times
rounds of `runner.step(16 rows)` (the verify) + `state.rollback(start + k)` for k in 1, 4, 8, 16
under both modes, plus the record each mode keeps. A step's time includes its commit (in replay
mode the commit re-runs the kept rows from the step's start state); the rollback restores the
state at once. Variable-width steps by default (with a fixed width of 16: one fixed step, no
padding for 16 rows). The record is allocated once per state (`rollback_rows` ring rows), so
"record MiB" is its full size, not what one step used.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

DIMS = dict(vocab=2048, hidden=1024, intermediate=2048, heads=8, kv_heads=2, head_dim=128,
            layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",),
            linear_key_heads=8, linear_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            mrope_section=(8, 4, 4))
PROMPT, BLOCK = 256, 16


def record_bytes(state) -> int:
    """Bytes the rollback record holds beyond the committed state (the step-start state, the ring
    of conv inputs, and stash rows or replay inputs)."""
    committed = [state.kv, *state.conv, *state.rec]
    return state.nbytes - sum(t.numel() * t.element_size() for t in committed)


def back_to_the_prompt(state, snapshot) -> None:
    """The state right after the prefill again (written in place, as every state tensor is)."""
    for dst, src in zip((*state.conv, *state.rec), (*snapshot[0], *snapshot[1])):
        dst.copy_(src)
    state._length = PROMPT
    state._forget()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--step-width", default="variable")
    args = ap.parse_args()
    width = None if args.step_width == "variable" else int(args.step_width)
    torch.set_num_threads(1)
    out = args.out or Path(tempfile.mkdtemp()) / "q35-mid"
    if not (out / "config.json").exists():
        make_tiny_qwen35(out, **DIMS)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, DIMS["vocab"], (PROMPT,), generator=gen)
    block = torch.randint(0, DIMS["vocab"], (BLOCK,), generator=gen)
    runners, snaps, states = {}, {}, {}
    for mode in ("stash", "replay"):
        runner = runners[mode] = StepRunner(Qwen35Target.from_dir(out, rollback=mode), width)
        state = states[mode] = runner.new_state(PROMPT + BLOCK + 1)
        runner.prefill(prompt, state)
        snaps[mode] = ([c.clone() for c in state.conv], [r.clone() for r in state.rec])
    print(f"step width {args.step_width}; {torch.get_num_threads()} thread")
    print(f"{'mode':7} {'k':>3} {'verify16 ms (min/med)':>22} {'rollback ms (min/med)':>22} {'record MiB':>11}")
    for k in (1, 4, 8, 16):
        times = {mode: ([], []) for mode in runners}
        mib = {}
        for _ in range(args.reps):
            for mode, runner in runners.items():  # interleaved: both modes see the same machine load
                state = states[mode]
                back_to_the_prompt(state, snaps[mode])
                t0 = time.perf_counter()
                runner.step(block, PROMPT, state)
                t1 = time.perf_counter()
                mib[mode] = record_bytes(state) / 2**20
                state.rollback(PROMPT + k)
                t2 = time.perf_counter()
                times[mode][0].append(1e3 * (t1 - t0))
                times[mode][1].append(1e3 * (t2 - t1))
        for mode, (v_ms, r_ms) in times.items():
            print(f"{mode:7} {k:>3} {min(v_ms):10.2f} / {statistics.median(v_ms):9.2f} "
                  f"{min(r_ms):10.3f} / {statistics.median(r_ms):9.3f} {mib[mode]:11.2f}")


if __name__ == "__main__":
    main()
