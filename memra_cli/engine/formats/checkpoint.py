"""Open any checkpoint memra reads: a safetensors directory (single or sharded), one
`.safetensors` file, or a memra `.gguf` file. Headers only; tensors load on demand."""

from __future__ import annotations

from pathlib import Path

from memra_cli.engine.errors import CheckpointError
from memra_cli.engine.formats.gguf import open_gguf
from memra_cli.engine.formats.safetensors import (
    INDEX_NAME, PICKLE_SUFFIXES, SINGLE_NAME, Checkpoint, TensorInfo, open_sharded, read_safetensors_header,
    refuse_pickles,
)

__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint"]


def open_checkpoint(path: Path) -> Checkpoint:
    """Inventory a model directory (or a single .safetensors / .gguf file) from headers only."""
    if path.is_file():
        if path.suffix == ".gguf":
            return open_gguf(path)
        if path.suffix == ".safetensors":
            return Checkpoint(path.parent, read_safetensors_header(path), (path,), "safetensors")
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{path}: pickle checkpoint refused (loading a pickle runs arbitrary code)")
        raise CheckpointError(f"{path}: not a checkpoint (expected a directory, .safetensors or .gguf)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    if (path / INDEX_NAME).is_file():
        return open_sharded(path)
    if (path / SINGLE_NAME).is_file():
        single = path / SINGLE_NAME
        return Checkpoint(path, read_safetensors_header(single), (single,), "safetensors")
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return Checkpoint(path, read_safetensors_header(files[0]), (files[0],), "safetensors")
    if len(files) > 1:
        raise CheckpointError(
            f"{path}: {len(files)} .safetensors files but no {INDEX_NAME} to say which tensor is where"
        )
    refuse_pickles(path)
    raise AssertionError("unreachable")
