"""ggml q8_0 / q4_0 blocks, the reading half: the block layout and the decoders (numpy, and the
torch twin `dequantize_torch`), which the GGUF reader needs. The encoders, byte-identical to
llama.cpp's, are in quant/blocks.py, which re-exports these names.

Block layouts (32 values per block, little-endian):
  q8_0: [d: f16][q: 32 x int8]                    34 B, value = q * d
  q4_0: [d: f16][16 B: q[j] | q[j + 16] << 4]      18 B, value = (q - 8) * d
"""

from __future__ import annotations

import numpy as np
import torch

from memra_cli.engine.errors import MemraError

QK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


class QuantError(MemraError, ValueError):
    """A tensor cannot be quantized (NaN/Inf, row not a multiple of 32, unknown qtype)."""


def quantizable(shape) -> bool:
    """True when the last dim holds whole 32-value blocks (and the tensor is not empty)."""
    return len(shape) >= 1 and shape[-1] > 0 and shape[-1] % QK == 0


def _blocks_of(raw, qtype: str, shape) -> np.ndarray:
    if qtype not in BLOCK_BYTES:
        raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    n = int(np.prod(shape))
    if not quantizable(tuple(shape)) or raw.size != n // QK * BLOCK_BYTES[qtype]:
        raise QuantError(f"{raw.size} bytes of {qtype} do not hold a tensor of shape {tuple(shape)}")
    return raw.reshape(-1, BLOCK_BYTES[qtype])


def decode_q8_0(raw, shape) -> np.ndarray:
    """uint8 q8_0 bytes -> float32 array of `shape` (value = q * d, one f32 multiply)."""
    b = _blocks_of(raw, "q8_0", shape)
    d = b[:, :2].copy().view("<f2").astype(np.float32)  # [n, 1]
    return (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(shape)


def decode_q4_0(raw, shape) -> np.ndarray:
    """uint8 q4_0 bytes -> float32 array of `shape` (value = (nibble - 8) * d)."""
    b = _blocks_of(raw, "q4_0", shape)
    d = b[:, :2].copy().view("<f2").astype(np.float32)
    packed = b[:, 2:]
    q = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.int8) - np.int8(8)
    return (q.astype(np.float32) * d).reshape(shape)


_DECODERS = {"q8_0": decode_q8_0, "q4_0": decode_q4_0}


def dequantize(raw, qtype: str, shape) -> np.ndarray:
    """uint8 bytes of `qtype` -> float32 array of the logical `shape`."""
    if qtype not in _DECODERS:
        raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    return _DECODERS[qtype](raw, shape)


def dequantize_torch(raw, qtype: str, shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """Torch twin of `dequantize`: uint8 bytes -> `shape` tensor of `dtype` on `device`.

    Computed in float32 (bit-equal to the numpy decoder) and cast to `dtype` at the end.
    """
    if qtype not in BLOCK_BYTES:
        raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    raw = torch.as_tensor(raw, device=device)
    n = 1
    for s in shape:
        n *= int(s)
    if raw.dtype != torch.uint8 or raw.numel() != n // QK * BLOCK_BYTES[qtype] or n % QK:
        raise QuantError(f"{raw.numel()} {raw.dtype} values do not hold {qtype} of shape {tuple(shape)}")
    b = raw.reshape(-1, BLOCK_BYTES[qtype])
    d = b[:, :2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    if qtype == "q8_0":
        q = b[:, 2:].view(torch.int8).float()
    else:
        q = torch.cat([b[:, 2:] & 15, b[:, 2:] >> 4], dim=1).float() - 8.0
    return (q * d).reshape(tuple(shape)).to(dtype)
