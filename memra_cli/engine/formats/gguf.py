"""memra GGUF files as checkpoints: `open_gguf` reads the headers (a memory map) and refuses a
GGUF without memra's config metadata, or a truncated / corrupt file, in one line.

The layout is written by `memra_cli.engine.quant.gguf_write` (docs/quantize.md): tensors keep
their checkpoint names, dimensions are stored fastest-first (the reverse of torch), quantized
tensors are raw q8_0 / q4_0 blocks, and `memra.config_json` carries the source config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memra_cli.engine.errors import CheckpointError
from memra_cli.engine.formats.safetensors import Checkpoint, TensorInfo

if TYPE_CHECKING:
    import torch

ARCH = "memra-drafter"
FORMAT = "memra-gguf/1"
KEY_FORMAT = "memra.format"
KEY_VERSION = "memra.version"
KEY_POLICY = "memra.policy"
KEY_CONFIG = "memra.config_json"
FILE_TYPE_Q8_0, FILE_TYPE_Q4_0 = 7, 2  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_0 (general.file_type)

# GGUF type name -> (numpy dtype of one stored element, element bytes) for the float/int types
_PLAIN = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2), "F64": (np.float64, 8),
          "I8": (np.int8, 1), "I16": (np.int16, 2), "I32": (np.int32, 4), "I64": (np.int64, 8)}
_QUANT = {"Q8_0": "q8_0", "Q4_0": "q4_0"}  # GGUF type name -> quant.py name
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}




@dataclass
class GGUFCheckpoint(Checkpoint):
    """A memra GGUF as a Checkpoint: TensorInfo dtype is the GGUF type name ("Q8_0", "BF16", ...),
    shape is in torch order. `embedded_config` is the source config.json (parsed), `policy` the
    precision policy it was written under. `load` returns floats (quantized tensors dequantized);
    `raw` returns the stored blocks of a quantized tensor."""

    embedded_config: dict | None = None
    config_text: str = ""
    policy: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    _reader: Any = field(default=None, repr=False)
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(f"{self.root}: tensor '{name}' is missing")
        return self._reader.tensors[self._index[name]]

    def is_quantized(self, name: str) -> bool:
        return name in self.tensors and self.tensors[name].dtype in _QUANT

    def raw(self, name: str) -> tuple[str, np.ndarray, tuple[int, ...]]:
        """(qtype "q8_0"|"q4_0", uint8 blocks [rows, row_bytes] (a copy), torch-order shape)."""
        info = self.tensors.get(name)
        if info is None or info.dtype not in _QUANT:
            raise CheckpointError(f"{self.root}: tensor '{name}' is not a quantized tensor "
                                  f"({info.dtype if info else 'missing'})")
        data = np.array(self._tensor(name).data, dtype=np.uint8, copy=True)
        rows = info.numel // info.shape[-1]
        return _QUANT[info.dtype], data.reshape(rows, -1), info.shape

    def load(self, name: str, dtype: "torch.dtype | None" = None, device: "str | torch.device" = "cpu") -> "torch.Tensor":
        """Tensor `name` as stored (BF16 as bfloat16; Q8_0/Q4_0 dequantized to float32), then cast
        to `dtype` if given, on `device`."""
        import torch

        from memra_cli.engine.formats.ggml_blocks import dequantize_torch

        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.root}: tensor '{name}' is missing")
        data = self._tensor(name).data
        if info.dtype in _QUANT:
            t = dequantize_torch(torch.from_numpy(np.array(data, dtype=np.uint8)), _QUANT[info.dtype], info.shape)
        elif info.dtype == "BF16":
            bits = np.array(data, copy=True).view(np.int16).reshape(info.shape)
            t = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(data, copy=True).reshape(info.shape))
        if dtype is not None:
            t = t.to(dtype)
        return t.to(device)


def _string_field(reader: Any, key: str) -> str | None:
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return None
    if not f.types or f.types[0] != gguf.GGUFValueType.STRING:
        raise ValueError(f"metadata '{key}' is not a string")
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata (arrays summarized by length), for reports."""
    import gguf

    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or not f.types:
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.STRING:
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        elif kind == gguf.GGUFValueType.ARRAY:
            out[key] = f"[{len(f.data)} values]"
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Inventory a memra GGUF (headers only); refuse foreign, corrupt or truncated files."""
    import gguf

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    if size < 24:
        raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, no header)")
    try:
        reader = gguf.GGUFReader(path, "r")
        tensors_in = list(reader.tensors)
        config_text = _string_field(reader, KEY_CONFIG)
        policy = _string_field(reader, KEY_POLICY)
        metadata = _metadata(reader)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError/... on bad bytes
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({detail})") from None
    if config_text is None:
        raise CheckpointError(f"{path}: GGUF without memra metadata '{KEY_CONFIG}' (not written by "
                              "`memra quantize`); memra needs the drafter's config.json inside the file")
    try:
        config = json.loads(config_text)
        assert isinstance(config, dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{path}: metadata '{KEY_CONFIG}' is not a JSON object") from None
    tensors: dict[str, TensorInfo] = {}
    index: dict[str, int] = {}
    for i, t in enumerate(tensors_in):
        kind = t.tensor_type.name
        if kind not in _PLAIN and kind not in _QUANT:
            raise CheckpointError(f"{path}: tensor '{t.name}' has GGUF type {kind}; memra reads "
                                  f"{', '.join([*_PLAIN, *_QUANT])}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CheckpointError(f"{path}: truncated: tensor '{t.name}' ends at byte "
                                  f"{int(t.data_offset) + int(t.n_bytes)} of a {size}-byte file")
        tensors[t.name] = TensorInfo(t.name, kind, shape, path, int(t.n_bytes))
        index[t.name] = i
    return GGUFCheckpoint(root=path, tensors=tensors, files=(path,), format="gguf", embedded_config=config,
                          config_text=config_text, policy=policy, metadata=metadata, _reader=reader, _index=index)
