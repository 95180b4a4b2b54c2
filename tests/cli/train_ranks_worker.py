"""A rank of a data-parallel TrainJob on the CPU (gloo), for test_train_cli.py:

    python -m torch.distributed.run --standalone --nproc-per-node N tests/cli/train_ranks_worker.py TARGET OUT

Each rank trains 3 steps on its own random sequences (seeded by its rank) over the tiny target and
writes its drafter's state_dict to OUT/rank{R}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from memra_cli.engine.api import Engine, EngineConfig
from memra_cli.train.geometry import resolve_geometry
from memra_cli.train.job import Hyper, TrainJob
from memra_cli.train.online import FixedSequences
from memra_cli.train.ranks import Ranks
from memra_cli.train.taps import EngineTaps


def main(target: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = Ranks.current()
    engine = Engine.load(EngineConfig(target=target, device="cpu"))
    geo, _ = resolve_geometry(target, "dspark", block=4, markov_rank=16)
    gen = torch.Generator().manual_seed(100 + ranks.rank)
    data = FixedSequences(torch.randint(0, 500, (6, 24), generator=gen), torch.full((6,), 8))
    job = TrainJob(geo, Hyper(steps=3, batch=2, anchors=4), data, EngineTaps(engine.target), torch.device("cpu"),
                   list(range(6)), ranks=ranks)
    job.run(None)
    torch.save({"drafter": job.drafter.state_dict(), "tokens": job.tokens}, out / f"rank{ranks.rank}.pt")
    dist.barrier()  # torn down together, as memra_cli.assets.build does: a rank leaving early can abort in gloo's threads
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # Leave without C++ static destructors: even after destroy_process_group a gloo thread can still be
    # joinable at interpreter teardown and abort the rank ("terminate called without an active
    # exception", pytorch/pytorch#179291). Everything this rank owes is on disk and the group is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
