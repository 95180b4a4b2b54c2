"""ggml q8_0 / q4_0 blocks as the engine sees them: the codec's one body is
`memra_kernels.ggml_blocks_ref` (layout, encoder, decoders; triton-free), which `quant_pack`
shares; here its refusals become the engine's `QuantError`, a `MemraError` the CLI renders as a
one-line `error:`. The GGUF reader needs the decoders; quant/blocks.py re-exports these names
beside the encoders.

Block layouts (32 values per block, little-endian):
  q8_0: [d: f16][q: 32 x int8]                    34 B, value = q * d
  q4_0: [d: f16][16 B: q[j] | q[j + 16] << 4]      18 B, value = (q - 8) * d
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from memra_kernels import ggml_blocks_ref as _codec

from memra_cli.engine.errors import MemraError

QK = _codec.QK
BLOCK_BYTES = _codec.BLOCK_BYTES
quantizable = _codec.quantizable

F = TypeVar("F", bound=Callable)


class QuantError(MemraError, _codec.QuantError):
    """A tensor cannot be quantized (NaN/Inf, row not a multiple of 32, unknown qtype), or bytes
    do not hold the shape they claim."""


def refusing(fn: F) -> F:
    """`fn` from the codec, raising the engine's `QuantError` (same message) where it refuses."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _codec.QuantError as exc:
            if isinstance(exc, QuantError):
                raise
            raise QuantError(str(exc)) from None

    return call  # type: ignore[return-value]


decode_q8_0 = refusing(_codec.decode_q8_0)
decode_q4_0 = refusing(_codec.decode_q4_0)
dequantize = refusing(_codec.dequantize)
dequantize_torch = refusing(_codec.dequantize_torch)
