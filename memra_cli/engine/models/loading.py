"""Reading a target's weights: every expected tensor checked (name and shape) before anything
loads, then read in the model dtype on the device. Families subclass `WeightLoader` with their
layer layout (`layer(i)`) and, where a missing tensor has a family-specific cause, a hint."""

from __future__ import annotations

import torch

from memra_cli.engine.errors import CheckpointError
from memra_cli.engine.formats.checkpoint import Checkpoint


class WeightLoader:
    """Named tensors of `ckpt`, each checked against `shapes` (name -> expected shape from `cfg`)."""

    def __init__(self, ckpt: Checkpoint, cfg, dtype: torch.dtype, device: torch.device,
                 shapes: dict[str, tuple[int, ...]]):
        self.ckpt, self.cfg, self.dtype, self.device = ckpt, cfg, dtype, device
        self.shapes = shapes

    def missing_hint(self, name: str) -> str:
        """Why tensor `name` is expected, when the config decides it (appended to the refusal)."""
        if name == "lm_head.weight":
            return " — lm_head.weight is needed because tie_word_embeddings is false"
        return ""

    def check_all(self) -> None:
        """Refuse before loading anything: a missing tensor or a wrong shape, named."""
        self.check(self.shapes)

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Each tensor of `shapes` present at its shape, else a refusal naming it."""
        for name, shape in shapes.items():
            info = self.ckpt.tensors.get(name)
            tail = f"(expected shape {list(shape)} from {self.cfg.source})"
            if info is None:
                raise CheckpointError(f"{self.ckpt.root}: tensor '{name}' is missing {tail}{self.missing_hint(name)}")
            if tuple(info.shape) != shape:
                raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, {tail[1:-1]}")

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.load(name, self.dtype, self.device)

    def cat(self, *names: str) -> torch.Tensor:
        """The tensors `names` stacked along their first (out) dimension."""
        return torch.cat([self.get(n) for n in names], dim=0)
