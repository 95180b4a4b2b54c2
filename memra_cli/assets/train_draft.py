"""The drafter losses and evaluations live in `memra_cli.train.losses` (shared with `memra
train`); this name stays for the build script's and the benchmarks' imports."""

from memra_cli.train.losses import (  # noqa: F401
    DraftSpec, block_batch, calibrate_confidence, draft_logits, evaluate, param_count, per_row, reliability,
    sample_anchors, walk_tau,
)
