"""The packed ggml weight layout the quantized linear kernel reads (kernels/quant_linear.py).

Made once at load by `pack_q8_0` / `pack_q4_0` from the raw ggml blocks (the codec of
`ggml_blocks_ref`); triton-free, like that codec, so the torch reference runs on it anywhere.

  q8_0  qweight int8  [out, in]       q[n, k], the ggml block payloads side by side
        scales  f16   [out, in // 32] d of block (n, k // 32);       W[n, k] = q[n, k] * d
  q4_0  qweight uint8 [out, in // 2]  ggml's nibble order kept, block payloads side by side:
                                      byte 16 b + j of row n holds q[n, 32 b + j] in its low
                                      nibble and q[n, 32 b + 16 + j] in its high nibble (j < 16)
        scales  f16   [out, in // 32]                              W[n, k] = (q[n, k] - 8) * d

Why these layouts: every row of qweight is contiguous and 16-byte aligned wherever `in` is a
multiple of 32 (in bytes: `in` for q8_0, `in / 2` for q4_0), so a tile of rows loads with
16-byte vector loads and full 32-byte sectors. q4_0 keeps ggml's nibble order because the kernel
gathers x in that order instead of shuffling the weight (kernels/quant_linear.py). Scales are
split off the 34/18-byte blocks, whose odd sizes defeat aligned loads.

Fused projections: both layouts are row-major per output feature, so weights sharing an input
stack along out by concatenating rows (`Packed.concat`: one launch for a drafter's q/k/v or
gate/up), and any run of output features is a view of those rows (`Packed.rows`).

Public API: `QTYPES`, `Packed`, `pack_q8_0`, `pack_q4_0`, `pack`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .ggml_blocks_ref import BLOCK_BYTES, QK, QuantError

__all__ = ["QTYPES", "Packed", "pack_q8_0", "pack_q4_0", "pack"]

QTYPES = ("q8_0", "q4_0")


@dataclass
class Packed:
    """A q8_0 / q4_0 weight [out, in] repacked for the kernel (layouts in the module docstring).

    qweight: int8 [out, in] (q8_0) or uint8 [out, in // 2] (q4_0); scales: float16 [out, in // 32].
    Both contiguous, on the same device.
    """

    qtype: str
    shape: tuple[int, int]
    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call for the weight (qweight + scales)."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2

    def to(self, device) -> "Packed":
        """A copy on `device` (self when already there)."""
        device = torch.device(device)
        if self.qweight.device == device:
            return self
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] in `dtype`: ggml's decode (one f32 multiply), then a cast."""
        n, k = self.shape
        d = self.scales.float().reshape(n, k // QK, 1)
        if self.qtype == "q8_0":
            q = self.qweight.reshape(n, k // QK, QK).float()
        else:
            b = self.qweight.reshape(n, k // QK, QK // 2)
            q = torch.cat([b & 15, b >> 4], dim=2).float() - 8.0  # lows are j, highs j + 16
        return (q * d).reshape(n, k).to(dtype)

    def to_ggml(self) -> torch.Tensor:
        """The raw ggml blocks back: uint8 [out, in // 32 * block_bytes] (exact inverse of pack)."""
        n, k = self.shape
        payload = self.qweight.view(torch.uint8).reshape(n, k // QK, -1)
        d = self.scales.contiguous().view(torch.uint8).reshape(n, k // QK, 2)
        return torch.cat([d, payload], dim=2).reshape(n, -1)

    @classmethod
    def concat(cls, parts: "list[Packed]") -> "Packed":
        """Weights [out_i, in] of one qtype stacked along out -> [sum(out_i), in].

        Both layouts are row-major per output feature, so this is concatenating qweight rows
        and scales rows: the result's row n is exactly the part's row it came from, and one
        call computes the parts' outputs side by side (a fused q/k/v or gate/up projection).
        """
        parts = list(parts)
        if not parts:
            raise QuantError("concat needs at least one weight")
        qtype, k = parts[0].qtype, parts[0].shape[1]
        for p in parts:
            if p.qtype != qtype or p.shape[1] != k:
                raise QuantError(f"cannot stack a {p.qtype} weight {p.shape} under a {qtype} weight "
                                 f"with {k} in-features: parts must share qtype and in-features")
        n = sum(p.shape[0] for p in parts)
        return cls(qtype, (n, k), torch.cat([p.qweight for p in parts]),
                   torch.cat([p.scales for p in parts]))

    def rows(self, lo: int, hi: int) -> "Packed":
        """Output features [lo, hi) as a weight [hi - lo, in] of their own: views of this one's
        qweight and scales rows (no bytes copied). A row slice of a contiguous [out, x] tensor
        is contiguous and its rows keep their stride, which is all the kernel asks. qweight
        rows are multiples of 16 bytes, so a slice starts as aligned as the whole; a scales
        slice may not (rows of in/16 bytes), which Triton sees at launch (it specializes on
        pointer alignment) and compiles for."""
        n, k = self.shape
        if not 0 <= lo < hi <= n:
            raise QuantError(f"rows [{lo}, {hi}) are not a non-empty range of a weight with {n} rows")
        return replace(self, shape=(hi - lo, k), qweight=self.qweight[lo:hi], scales=self.scales[lo:hi])


def _raw_blocks(raw, qtype: str, shape) -> tuple[torch.Tensor, int, int]:
    """Validate raw ggml bytes for a 2-D `shape` and view them as [n_blocks, block_bytes] uint8."""
    if qtype not in QTYPES:
        raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0 or shape[1] % QK:
        raise QuantError(f"{qtype} linear weight must be 2-D [out, in] with in a multiple of {QK}, "
                         f"got {shape}")
    if not isinstance(raw, torch.Tensor):
        raw = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
    if raw.dtype != torch.uint8:
        raise QuantError(f"raw {qtype} blocks must be uint8, got {raw.dtype}")
    n, k = shape
    nbytes = BLOCK_BYTES[qtype]
    if raw.numel() != n * (k // QK) * nbytes:
        raise QuantError(f"{raw.numel()} bytes of {qtype} do not hold a tensor of shape {shape}")
    return raw.contiguous().reshape(n * (k // QK), nbytes), n, k


def pack_q8_0(raw, shape) -> Packed:
    """Raw q8_0 blocks (uint8 numpy array or tensor, any shape, out * in/32 * 34 bytes, on any
    device) for a weight of logical `shape` (out, in) -> Packed on the same device."""
    b, n, k = _raw_blocks(raw, "q8_0", shape)
    scales = b[:, :2].contiguous().view(torch.float16).reshape(n, k // QK)
    qweight = b[:, 2:].contiguous().view(torch.int8).reshape(n, k)
    return Packed("q8_0", (n, k), qweight, scales)


def pack_q4_0(raw, shape) -> Packed:
    """Raw q4_0 blocks (uint8, out * in/32 * 18 bytes) for logical `shape` (out, in) -> Packed.

    The 16 nibble bytes of each block are kept in ggml's order (see the module docstring).
    """
    b, n, k = _raw_blocks(raw, "q4_0", shape)
    scales = b[:, :2].contiguous().view(torch.float16).reshape(n, k // QK)
    qweight = b[:, 2:].contiguous().reshape(n, k // 2)
    return Packed("q4_0", (n, k), qweight, scales)


def pack(raw, qtype: str, shape) -> Packed:
    """`pack_q8_0` or `pack_q4_0` by name."""
    if qtype not in QTYPES:
        raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    return (pack_q8_0 if qtype == "q8_0" else pack_q4_0)(raw, shape)
