"""The embedded pair with its weight matmuls on the dense kernel, against cuBLAS: whole bench runs.

The embedded target and drafters (hidden 256) have their weight shapes in `dense_linear.TUNED`,
so their weight matmuls run on the dense kernel and every launch fusion of the step ops that
rides its epilogues applies to them: the q/k/v projection with its norm, rope and K/V write, the
o / down projection with the residual add and the next norm folded into the following matmul,
the gate/up matmul with SiLU·mul, the lm_head with its argmax. A step of that target is a chain
of tiny launches (docs/bench.md#the-embedded-pair-on-the-dense-kernel), so fewer launches is the
time there is to win, for plain decoding and for the speculative arms alike.

`--table dense` runs `memra bench` in this process with the table as shipped; `--table cublas`
first takes `EMBEDDED_SHAPES` out of it, so cuBLAS's `F.linear` runs them with none of those
fusions; `--table dense-combine` is `dense` with `attention.DIRECT_ONE_SPLIT` off, so an
attention over a storage of one split (the drafter's block over its draft cache) runs its split
kernel and the combine, two launches, where the shipped code runs one (the same bits). One process per table, so one device call holds the A/B (the suite's `embedded_dense`
part): every arm's tok/s, and each run's own exactness gate (every speculative stream equal to
`off`'s, `off` and the speculative arms on fixed 16-row steps). `--out FILE` sends the bench's
stdout (its `--json` report) there; every other argument goes to `memra bench`.

    python -m benchmarks.gpu.embedded_dense --table cublas|dense|dense-combine [--out FILE] [memra bench options ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The embedded models' weight shapes (out, in) in dense_linear.TUNED: q/k/v (target and drafters),
# o (and the drafters' fused k/v), fused gate/up, down (and the drafters' fc over 3 taps), lm_head.
EMBEDDED_SHAPES = ((512, 256), (256, 256), (1536, 256), (256, 768), (4096, 256))


def without_embedded(tuned: dict) -> list[tuple[int, int]]:
    """Take `EMBEDDED_SHAPES` out of a `dense_linear.TUNED`-like table; returns the shapes taken."""
    return [shape for shape in EMBEDDED_SHAPES if tuned.pop(shape, None) is not None]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--table", choices=("cublas", "dense", "dense-combine"), required=True,
                   help="dense: dense_linear.TUNED as shipped; cublas: with the embedded shapes taken out "
                        "(EMBEDDED_SHAPES); dense-combine: as shipped, with every attention's combine launched "
                        "(attention.DIRECT_ONE_SPLIT off)")
    p.add_argument("--out", type=Path, help="write the bench's stdout here (default: stdout)")
    a, bench_args = p.parse_known_args(argv)
    from memra_kernels import attention, dense_linear

    if a.table == "dense-combine":
        attention.DIRECT_ONE_SPLIT = False
        print("embedded_dense: attention over one split in two launches (DIRECT_ONE_SPLIT off)", file=sys.stderr,
              flush=True)
    if a.table == "cublas":
        taken = without_embedded(dense_linear.TUNED)
        print(f"embedded_dense: {len(taken)} shapes back on cuBLAS: {taken}", file=sys.stderr, flush=True)
    from memra_cli.cli.app import app

    if a.out is not None:  # at the descriptor, so whatever the bench's printing goes through lands there
        sys.stdout.flush()
        fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
    app(["bench", *bench_args], prog_name="memra")


if __name__ == "__main__":
    main()
