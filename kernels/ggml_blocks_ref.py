"""ggml q8_0 / q4_0 blocks: the layout, the encoder (byte-identical to llama.cpp's
`quantize_row_q{8,4}_0_ref`) and the decoders (numpy, and the torch twin `dequantize_torch`).
Triton-free: the engine's quantizer, its GGUF reader and `quant_pack` all use this one body.

Block layouts (32 values per block, little-endian):
  q8_0: [d: f16][q: 32 x int8]                    34 B, value = q * d
  q4_0: [d: f16][16 B: q[j] | q[j + 16] << 4]      18 B, value = (q - 8) * d

Everything is float32 arithmetic in the reference's order, so the bytes match the C code and the
`gguf` package (the tests' oracle) bit for bit. Encoders are vectorized numpy over cache-sized
chunks of blocks; per-block reductions run on a transposed copy, because numpy reduces a short
last axis row by row (the main cost in gguf's encoder). A weight holding NaN/Inf, or whose rows
are not whole blocks, is refused by name (`QuantError`).
"""

from __future__ import annotations

import numpy as np
import torch

QK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


class QuantError(ValueError):
    """Values or bytes that do not make ggml blocks (NaN/Inf, a row not a multiple of 32, an
    unknown qtype, a byte count that does not hold the shape). The engine refuses with its own
    subclass (`memra_cli.engine.formats.ggml_blocks.QuantError`, a `MemraError`)."""


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


_CHUNK = 4096  # blocks per chunk (512 KiB of f32): a chunk's temporaries stay in L2 (docs/quantize.md#speed)
# The largest f32 below 0.5: trunc(p + copysign(_HALF_DOWN, p)) is round-half-away-from-zero
# (C roundf) for every f32 |p| < 2^22; plain +0.5 rounds 0.49999997 up to 1 (checked
# exhaustively over all f32 below 256).
_HALF_DOWN = np.nextafter(np.float32(0.5), np.float32(0.0))


def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> IEEE binary16 bits (uint16): round-to-nearest-even, subnormals kept, overflow -> inf.

    This is ggml's GGML_FP32_TO_FP16 (F16C `vcvtps2ph`, RNE). numpy's astype(float16) implements
    the same rounding, verified against an independent integer implementation on all 2^32 inputs.
    """
    with np.errstate(over="ignore"):  # |x| > 65504 becomes inf, as in ggml: not an error here
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def _as_f32(values, qtype: str, name: str) -> np.ndarray:
    """Validate the input and return it as contiguous float32 (torch tensors accepted)."""
    if qtype not in BLOCK_BYTES:
        raise QuantError(f"tensor '{name}': unknown quant type {qtype!r} (expected q8_0 or q4_0)")
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(values, dtype=np.float32)
    if not quantizable(x.shape):
        row = x.shape[-1] if x.ndim else 0
        raise QuantError(f"tensor '{name}' has rows of {row} values, not a multiple of {QK}; "
                         f"cannot quantize to {qtype}")
    return x


def _refuse_nonfinite(extreme: np.ndarray, name: str) -> None:
    # max/min reductions propagate NaN and keep Inf, so the per-block extremes see every bad value
    if not np.isfinite(extreme).all():
        raise QuantError(f"tensor '{name}' has NaN/Inf values; refusing to quantize")


def _inverse(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """id = 1/d, with 0 where d == 0 (the reference's `d ? 1/d : 0`) and where 1/d overflows.

    Returns (id, overflow). A subnormal d below ~2.9e-39 makes 1/d inf: C then casts inf/NaN to
    an integer (UB; x86 gives 0) and gguf's numpy does the same, so the callers write zeros there.
    Runs under the caller's errstate (divide/overflow ignored).
    """
    inv = np.float32(1.0) / d
    bad = np.isinf(inv)
    inv[bad] = 0.0
    return inv, bad & (d != 0)


class _Chunk:
    """Scratch for chunks of up to n blocks, reused across chunks (no per-chunk allocation).

    `cols(m)` is [32, m] f32, a chunk transposed: numpy reduces a short last axis one row at a
    time (far slower than a plain pass), so per-block max/min run down columns instead.
    Views are prefixes of flat buffers, so every one is contiguous whatever m is.
    """

    def __init__(self, n: int):
        self._f32 = np.empty((2, n * QK), dtype=np.float32)
        self._u32 = np.empty(n * QK, dtype=np.uint32)
        self._u8 = np.empty(n * QK, dtype=np.uint8)
        self._u64 = np.empty(n * QK // 8, dtype=np.uint64)

    def cols(self, m: int) -> np.ndarray:
        return self._f32[0, :m * QK].reshape(QK, m)

    def rows(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[m, 32] f32, u32 and u8 scratch."""
        return (self._f32[1, :m * QK].reshape(m, QK), self._u32[:m * QK].reshape(m, QK),
                self._u8[:m * QK].reshape(m, QK))

    def bytes_t(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[32, m] u8, the same bytes as [4 m] u64, and a separate [4 m] u64 scratch."""
        q = self._u8[:m * QK]
        return q.reshape(QK, m), q.view(np.uint64), self._u64[:m * QK // 8]


def _payload_words(out: np.ndarray, words: int) -> np.ndarray:
    """[n_blocks, words] u64 view of the bytes after each block's 2-byte scale (unaligned).

    Copying 8-byte words into the 34-byte strided rows is faster than copying bytes.
    """
    return np.ndarray((out.shape[0], words), np.uint64, buffer=out, offset=2,
                      strides=(out.shape[1], 8))


def _q8_chunk(x, out, scales, tmp: _Chunk, name: str) -> None:
    """x [n, 32] f32 -> out [n, 34] u8 rows (d f16 | 32 x int8); scales: out's [n] u16 view."""
    cols, (p, bits, q) = tmp.cols(len(x)), tmp.rows(len(x))
    np.abs(x.T, out=cols)  # |x| and the transpose in one pass; abs makes an all-zero amax +0.0
    amax = cols.max(axis=0)
    _refuse_nonfinite(amax, name)
    d = amax / np.float32(127.0)
    inv, _ = _inverse(d)  # overflow blocks get id 0 -> q 0, which is what ggml writes there
    np.multiply(x, inv[:, None], out=p)  # the f32 product v*id, as the reference (not v/d)
    # p += copysign(_HALF_DOWN, p), done on the bits: np.copysign is several times slower
    np.bitwise_and(p.view(np.uint32), np.uint32(0x80000000), out=bits)
    np.bitwise_or(bits, _HALF_DOWN.view(np.uint32), out=bits)
    p += bits.view(np.float32)
    np.copyto(q.view(np.int8), p, casting="unsafe")  # the cast truncates toward zero
    _payload_words(out, 4)[:] = q.view(np.uint64)
    scales[:] = d.astype(np.float16).view(np.uint16)  # = f32_to_f16_bits; errstate is ours


def _signed_max(x: np.ndarray, mx: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Per block, the first element of largest |v|, sign kept (llama.cpp's `max`)."""
    m = np.where(mx >= -mn, mx, mn)
    tie = mx == -mn  # +a and -a both present, or all zeros: the first one wins
    if tie.any():
        zero = tie & (mx == 0)
        m[zero] = x[zero, 0]  # gguf's argmax picks element 0, whose sign (+-0) decides d's sign
        tie &= ~zero
        sub = x[tie]
        m[tie] = sub[np.arange(len(sub)), np.abs(sub).argmax(axis=1)]
    return m


def _q4_chunk(x, out, scales, tmp: _Chunk, name: str) -> None:
    """x [n, 32] f32 -> out [n, 18] u8 rows (d f16 | q[j] | q[j + 16] << 4); scales: [n] u16.

    Works on the transposed chunk [32, n] throughout (every op a long contiguous pass) and
    transposes only the 16 packed bytes per block back at the end.
    """
    n = len(x)
    cols = tmp.cols(n)
    np.copyto(cols, x.T)
    mx, mn = cols.max(axis=0), cols.min(axis=0)
    _refuse_nonfinite(np.maximum(mx, -mn), name)
    d = _signed_max(x, mx, mn) / np.float32(-8.0)
    inv, overflow = _inverse(d)
    np.multiply(cols, inv, out=cols)  # rounded to f32 here: no fused multiply-add
    cols += np.float32(8.5)
    q, q64, w = tmp.bytes_t(n)
    np.copyto(q, cols, casting="unsafe")  # values lie in [0.49, 16.5]: the cast truncates, 0..16
    # min(q, 15) eight bytes at a time: only 16 has bit 4 set, so subtract that bit (no borrows);
    # np.minimum with a scalar operand is not vectorized and costs 4x more
    np.right_shift(q64, np.uint64(4), out=w)
    w &= np.uint64(0x0101010101010101)
    q64 -= w
    if overflow.any():
        q[:, overflow] = 0  # inf/NaN nibbles: x86 C and gguf both produce 0
    # rows 0..15 | rows 16..31 << 4; nibbles are < 16, so u64 shifts never carry between bytes
    packed = np.left_shift(q64[2 * n:], np.uint64(4), out=w[:2 * n])
    packed |= q64[:2 * n]
    np.copyto(out[:, 2:], packed.view(np.uint8).reshape(16, n).T)
    scales[:] = d.astype(np.float16).view(np.uint16)


_ENCODERS = {"q8_0": _q8_chunk, "q4_0": _q4_chunk}


def quantize(values, qtype: str, name: str = "tensor") -> np.ndarray:
    """Float array [..., K] (K % 32 == 0) -> uint8 [rows, K // 32 * block_bytes], rows = prod(...).

    A 1-D input is one row; torch tensors (any float dtype) are read as float32. `name` is the
    tensor name used in refusals (NaN/Inf anywhere, K not a multiple of 32, unknown qtype).
    """
    x = _as_f32(values, qtype, name)
    blocks, nbytes = x.reshape(-1, QK), BLOCK_BYTES[qtype]
    out = np.empty((blocks.shape[0], nbytes), dtype=np.uint8)
    if out.size == 0:
        return out.reshape(-1, x.shape[-1] // QK * nbytes)
    scales = out.view("<u2")[:, 0]  # rows are an even number of bytes: d is each row's first u16
    tmp, encode = _Chunk(min(_CHUNK, len(blocks))), _ENCODERS[qtype]
    with np.errstate(divide="ignore", over="ignore"):  # 1/0 and f16 overflow are handled above
        for s in range(0, len(blocks), _CHUNK):
            encode(blocks[s:s + _CHUNK], out[s:s + _CHUNK], scales[s:s + _CHUNK], tmp, name)
    return out.reshape(-1, x.shape[-1] // QK * nbytes)


def encode_q8_0(values, name: str = "tensor") -> np.ndarray:
    """[..., K] float -> [rows, K // 32 * 34] uint8 (see `quantize`)."""
    return quantize(values, "q8_0", name)


def encode_q4_0(values, name: str = "tensor") -> np.ndarray:
    """[..., K] float -> [rows, K // 32 * 18] uint8 (see `quantize`)."""
    return quantize(values, "q4_0", name)
