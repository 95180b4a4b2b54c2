"""ggml q8_0 / q4_0 block quantization, byte-identical to llama.cpp's `quantize_row_q{8,4}_0_ref`,
and `QuantLinearRef`, the quantized linear's torch reference.

The encoders' one body is `memra_kernels.ggml_blocks_ref` (triton-free; `quant_pack` packs
what it writes); the names here raise the engine's `QuantError` (a `MemraError`) where it
refuses: NaN/Inf in a weight, rows that are not whole blocks, an unknown qtype. The decoders
and the layout come through formats/ggml_blocks.py, which the GGUF reader uses.
"""

from __future__ import annotations

import numpy as np
import torch

from memra_kernels import ggml_blocks_ref as _codec

# The block layout and the decoders, with the engine's refusals (formats/ggml_blocks.py): the
# codec's public names stay importable here beside the encoders.
from memra_cli.engine.formats.ggml_blocks import (  # noqa: F401
    BLOCK_BYTES, QK, QuantError, decode_q4_0, decode_q8_0, dequantize, dequantize_torch, quantizable,
    refusing)

f32_to_f16_bits = _codec.f32_to_f16_bits
quantize = refusing(_codec.quantize)
encode_q8_0 = refusing(_codec.encode_q8_0)
encode_q4_0 = refusing(_codec.encode_q4_0)


class QuantLinearRef(torch.nn.Module):
    """Reference quantized linear: y = x @ dequant(W).T, dequantized on the fly.

    raw: uint8 [out_features, in_features // 32 * block_bytes]; shape: (out_features, in_features).
    forward: x [..., in_features] -> [..., out_features] in x's dtype.
    `concat` stacks weights along out_features and `rows` slices them (views), for fused
    projections.
    """

    def __init__(self, raw, qtype: str, shape):
        super().__init__()
        if qtype not in BLOCK_BYTES:
            raise QuantError(f"unknown quant type {qtype!r} (expected q8_0 or q4_0)")
        self.qtype, self.shape = qtype, tuple(int(s) for s in shape)
        if not isinstance(raw, torch.Tensor):
            raw = torch.from_numpy(np.array(raw, dtype=np.uint8))  # own, writable copy
        self.register_buffer("raw", raw)

    @classmethod
    def from_float(cls, weight, qtype: str, name: str = "tensor") -> "QuantLinearRef":
        """Quantize a float weight [out, in] and wrap it."""
        return cls(quantize(weight, qtype, name), qtype, tuple(weight.shape))

    @classmethod
    def concat(cls, parts: "list[QuantLinearRef]") -> "QuantLinearRef":
        """Weights [out_i, in] of one qtype stacked along out -> [sum(out_i), in].

        ggml stores a 2-D tensor row by row (each output feature's blocks contiguous), so this
        is concatenating the raw block rows: row n of the result holds exactly the bytes of the
        part's row it came from, and the stacked linear computes the parts' outputs side by side
        (a fused q/k/v or gate/up projection). Parts must share qtype and in-features.
        """
        parts = list(parts)
        if not parts:
            raise QuantError("concat needs at least one weight")
        qtype, k = parts[0].qtype, parts[0].shape[-1]
        for p in parts:
            if len(p.shape) != 2 or p.qtype != qtype or p.shape[1] != k:
                raise QuantError(f"cannot stack a {p.qtype} weight {p.shape} under a {qtype} weight "
                                 f"with {k} in-features: parts must be 2-D and share qtype and in-features")
        raw = torch.cat([p.raw.reshape(p.shape[0], -1) for p in parts])
        return cls(raw, qtype, (raw.shape[0], k))

    def rows(self, lo: int, hi: int) -> "QuantLinearRef":
        """Output features [lo, hi) as a linear [hi - lo, in] of their own, whose raw is a view
        of this one's block rows (no bytes copied)."""
        n = self.shape[0]
        if len(self.shape) != 2 or not 0 <= lo < hi <= n:
            raise QuantError(f"rows [{lo}, {hi}) are not a non-empty range of a weight of shape {self.shape}")
        return QuantLinearRef(self.raw.reshape(n, -1)[lo:hi], self.qtype, (hi - lo, self.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_torch(self.raw, self.qtype, self.shape, dtype=x.dtype, device=x.device)
        return x @ w.T
