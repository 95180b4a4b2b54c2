"""safetensors checkpoints (single file or sharded index), read headers first.

Census reads only the headers (8-byte length + JSON), so a 16 GB checkpoint is inventoried in
milliseconds; every declared byte range is checked against the file size, so a truncated or
corrupt file is named before anything loads. Pickle formats (`.bin`, `.pt`, ...) are refused:
unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from memra_cli.engine.errors import CheckpointError

if TYPE_CHECKING:  # torch only when tensors are loaded: census reads headers alone
    import torch

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared by its file's header (nothing loaded)."""

    name: str
    dtype: str  # safetensors code: "BF16", "F32", ... (GGUF: "Q8_0", "Q4_0", ...)
    shape: tuple[int, ...]
    file: Path
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header; refuse a truncated or corrupt file by name."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (declares {n} header bytes, "
                    f"file has {size})"
                )
            text = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_bytes = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_entry(path, name, entry, data_bytes)
    return out


def _tensor_entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]  # type: ignore[index]
        shape = tuple(int(d) for d in shape)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from None
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * DTYPE_BYTES[dtype] or begin < 0:
        raise CheckpointError(
            f"{path}: tensor '{name}' declares {end - begin} bytes for shape {list(shape)} {dtype}"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: truncated: tensor '{name}' ends at byte {end} of the data section, "
            f"which holds only {data_bytes} bytes"
        )
    return TensorInfo(name, dtype, shape, path, end - begin)


@dataclass
class Checkpoint:
    """A model directory's tensors, inventoried from headers; `load` reads one on demand."""

    root: Path
    tensors: dict[str, TensorInfo]
    files: tuple[Path, ...]
    format: str  # "safetensors" | "safetensors-sharded" | "gguf"
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterator[str]:
        return iter(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def load(self, name: str, dtype: "torch.dtype | None" = None, device: "str | torch.device" = "cpu") -> "torch.Tensor":
        """Read tensor `name` (as stored, then cast to `dtype` if given) onto `device`."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor '{name}' is missing")
        handle = self._handles.get(info.file)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(info.file), framework="pt")
            self._handles[info.file] = handle
        tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
        if dtype is not None:
            tensor = tensor.to(dtype)
        return tensor.to(device)


def refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(pickles)}); memra never unpickles "
            "(loading a pickle runs arbitrary code) — convert to safetensors first"
        )
    raise CheckpointError(
        f"{directory}: no weights file (expected {SINGLE_NAME}, {INDEX_NAME} or *.safetensors)"
    )


def open_sharded(directory: Path) -> Checkpoint:
    index_path = directory / INDEX_NAME
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{index_path}: not a valid safetensors index (needs a 'weight_map' object)") from None
    shards = sorted({str(v) for v in weight_map.values()})
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in shards:
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{index_path}: shard '{shard}' is listed but missing")
        headers[shard] = read_safetensors_header(path)
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        info = headers[str(shard)].get(name)
        if info is None:
            raise CheckpointError(f"{directory / str(shard)}: tensor '{name}' is in the index but not in the shard")
        tensors[name] = info
    return Checkpoint(directory, tensors, tuple(directory / s for s in shards), "safetensors-sharded")
