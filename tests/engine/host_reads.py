"""`NoHostReads`: the CPU stand-ins of graph capture (test_step_width.py, test_qwen3_5.py) run a
captured body under it, so a body that reads a device value on the host fails on the CPU too."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class NoHostReads(TorchFunctionMode):
    """Refuses what reads a tensor's value on the host (`item`, `int()`, `bool()`, indexing by a
    0-d tensor...): on CUDA each is a sync, which a graph capture refuses (the H200 found
    `sel[m]` with a device m in a round body)."""

    READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or (name == "__getitem__" and any(
                isinstance(i, torch.Tensor) and i.dim() == 0 for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))):
            raise AssertionError(f"a captured body reads a device value on the host ({name})")
        return func(*args, **(kwargs or {}))
