"""The embedded pair with its weight matmuls on the dense kernel, against cuBLAS: whole bench runs.

The embedded target and drafters (hidden 256) have no weight shape in `dense_linear.TUNED`, so
every weight matmul of theirs is cuBLAS's `F.linear`, and none of the step ops' launch fusions
that ride the dense kernel's epilogues applies to them: the q/k/v projection with its norm, rope
and K/V write, the o / down projection with the residual add and the next norm folded into the
following matmul, the gate/up matmul with SiLU·mul, the lm_head with its argmax. A step of that
target is a chain of tiny launches (docs/bench.md#the-embedded-pair-on-the-dense-kernel), so
fewer launches is the time there is to win, for plain decoding and for the speculative arms alike.

`--table cublas` runs `memra bench` in this process with the table as shipped; `--table dense`
first adds the embedded shapes at `CANDIDATES`' tiles (each one valid and row-count invariant:
tests/kernels/test_dense_linear.py). One process per table, so one device call holds the A/B
(the suite's `embedded_dense` part): every arm's tok/s, and each run's own exactness gate (every
speculative stream equal to `off`'s, `off` and the speculative arms on fixed 16-row steps).
`--out FILE` sends the bench's stdout (its `--json` report) there; every other argument goes
to `memra bench`.

    python -m benchmarks.gpu.embedded_dense --table cublas|dense [--out FILE] [memra bench options ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The embedded models' weight shapes (out, in) -> (block_n, block_k): q/k/v (target and drafters),
# o (and the drafters' fused k/v), fused gate/up, down (and the drafters' fc over 3 taps), lm_head.
# block_n 32 lies inside a 64-wide head (the q/k/v epilogue's rule) and spreads the 256-wide
# outputs over 8 programs; the lm_head's 64 gives 64 programs and an unsplit K (its argmax epilogue).
CANDIDATES = {(512, 256): (32, 128), (256, 256): (32, 128), (1536, 256): (32, 128), (256, 768): (32, 128),
              (4096, 256): (64, 128)}


def add_candidates(tuned: dict) -> list[tuple[int, int]]:
    """Put `CANDIDATES` into a `dense_linear.TUNED`-like table (shapes already there are kept);
    returns the shapes added."""
    from memra_kernels.dense_linear import KernelConfig

    added = []
    for shape, (block_n, block_k) in CANDIDATES.items():
        if shape not in tuned:
            tuned[shape] = KernelConfig(block_n=block_n, block_k=block_k, split_k=1, num_warps=4, num_stages=2).check()
            added.append(shape)
    return added


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--table", choices=("cublas", "dense"), required=True,
                   help="cublas: dense_linear.TUNED as shipped; dense: with the embedded shapes added (CANDIDATES)")
    p.add_argument("--out", type=Path, help="write the bench's stdout here (default: stdout)")
    a, bench_args = p.parse_known_args(argv)
    from memra_kernels import dense_linear

    if a.table == "dense":
        added = add_candidates(dense_linear.TUNED)
        print(f"embedded_dense: {len(added)} shapes on the dense kernel: {added}", file=sys.stderr, flush=True)
    from memra_cli.cli.app import app

    if a.out is not None:  # at the descriptor, so whatever the bench's printing goes through lands there
        sys.stdout.flush()
        fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
    app(["bench", *bench_args], prog_name="memra")


if __name__ == "__main__":
    main()
