"""Data parallelism for a TrainJob: the ranks of one torch.distributed group each draw their own
batches and average their gradients before every optimizer step, so every rank holds the same
drafter (the embedded build trains each drafter over two GPUs this way: docs/train.md
"Retraining the embedded pair").

Gradients are averaged by hand (one flattened all-reduce after backward) rather than through
DistributedDataParallel, so the compiled loss (job.py) stays the same function on one rank or many.
Decisions that end the loop (the budget, a stop request) are agreed by all ranks, or one rank would
wait forever in the next all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    """This process's place in the data-parallel group (rank 0 of 1: no group)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Ranks":
        """The initialised default process group's, else a single rank."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def lead(self) -> bool:
        """The rank that writes checkpoints and exports."""
        return self.rank == 0

    def average_grads(self, params) -> None:
        """Every parameter's gradient replaced by its mean over the ranks (one all-reduce)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def agree(self, value: int, device: torch.device, op: str = "min") -> int:
        """`value` made the same on every rank: the min (or max) over the ranks."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return int(t.item())
