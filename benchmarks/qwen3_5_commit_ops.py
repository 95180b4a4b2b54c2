"""Ops a Qwen3.5 state's commit runs on the host, counted with the torch profiler (CPU).

A commit (and a rollback) runs eagerly after every graphed target step, so each op in it is a
launch on the GPU. This builds a tiny random hybrid with the 4B shape's layer pattern (24
DeltaNet and 8 attention layers), runs one 16-row step and counts the aten ops of committing
it, for each rollback mode. An op count, not a time: time it on a GPU with
benchmarks/gpu/hybrid_step.py.

    python benchmarks/qwen3_5_commit_ops.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memra_cli.engine.models.qwen3_5 import Qwen35Target  # noqa: E402
from memra_cli.engine.runtime.steps import StepRunner  # noqa: E402
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35  # noqa: E402

MOVES = ("aten::copy_", "aten::cat", "aten::zero_", "aten::fill_", "aten::index_copy_")


def main() -> None:
    types = tuple(["linear_attention"] * 3 + ["full_attention"]) * 8
    path = make_tiny_qwen35(Path(tempfile.mkdtemp()) / "t", layer_types=types)
    for mode in ("stash", "replay"):
        runner = StepRunner(Qwen35Target.from_dir(path, rollback=mode), 16)
        state = runner.new_state(200)
        runner.prefill(torch.arange(3, 40), state)
        for keep in (16, 5):
            start = state.length
            runner.fixed_step(torch.arange(7, 23), start, state)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                state.commit(start + keep)
            ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
            moves = sum(e.count for e in ops if e.key in MOVES)
            print(f"{mode:6s} commit keeping {keep:2d} of 16 rows: {moves} data-moving ops, "
                  f"{sum(e.count for e in ops)} aten ops")


if __name__ == "__main__":
    main()
