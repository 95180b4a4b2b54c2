"""Quantized weights to floats in registers, for quant_linear's tiles (Triton jit helpers, no launches).

Each helper turns q8_0 bytes (int8 q) or q4_0 nibbles (0..15, the weight q - 8) into exact floats
without the int-to-float instruction (it runs at a quarter of the FMA rate):
  magic numbers: the integer added into the bits of 1.5 * 2^23 (`int8_magic`, `nibble_magic`) and
    the block scale applied with the constant folded in, one FMA a weight (`scaled_magic`): the
    dequantize-first default;
  mantissas: the integer's byte placed under the exponent of 1.0 (`int8_mantissa`,
    `nibble_mantissa`; on the GPU 4 bytes a step in 32-bit registers with PTX byte permutes,
    `int8_mantissa_ptx`, `nibble_mantissas_ptx`), then one FMA (`scaled_mantissa`): the same
    weights in about half the integer instructions (KernelConfig.mantissa);
  dot operands: exact integers in the dot's dtype for scale-after-dot (`int8_to_f32`,
    `nibble_to_dot`; bf16 nibble pairs by PTX, `nibbles_bf16`).
Why each is exact is in its docstring; which path a launch takes, in kernels/quant_linear.py.
The PTX helpers are GPU-only: under the interpreter (WIDEN) the kernel takes the plain ones.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_to_f32(q):
    """int8 tensor -> exact float32 without an int-to-float instruction (those run at a
    quarter of the FMA rate): the bits 0x4B400000 + q are the float 1.5 * 2^23 + q."""
    return (q.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

@triton.jit
def nibble_to_f32(nib):
    """uint8 tensor of nibbles 0..15 -> exact float32 nib - 8 (2^23 + nib, minus 2^23 + 8)."""
    return (nib.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0

@triton.jit
def scaled_magic(m, d, FUSED: tl.constexpr):
    """m * d - 1.5 * 2^23 * d for m = 1.5 * 2^23 + q (the magic floats below): q * d exactly.

    FUSED is one FMA per weight: the exact product m * d plus the exact constant (3 * 2^22
    times an 11-bit d fits in 13 bits) is q * d (<= 19 bits), rounded once: exact. The
    interpreter's fma rounds the product first, so it takes the two-step form instead.
    """
    if FUSED:
        return tl.fma(m, d, d * -12582912.0)
    else:
        return (m - 12582912.0) * d

@triton.jit
def int8_magic(q):
    """int8 q -> the float 1.5 * 2^23 + q (its bits are 0x4B400000 + q)."""
    return (q.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)

@triton.jit
def nibble_magic(nib):
    """nibble 0..15 -> the float 1.5 * 2^23 + nib - 8."""
    return (nib.to(tl.int32) + (0x4B400000 - 8)).to(tl.float32, bitcast=True)

@triton.jit
def int8_mantissa(q):
    """int8 q -> the float 1 + (q + 128) * 2^-15: the byte q ^ 0x80 (q + 128, 0..255) as
    mantissa bits 8..15 of 1.0 (bits 0x3F80uu00), one byte placement a weight."""
    u = (q ^ -128).to(tl.uint8, bitcast=True).to(tl.int32)
    return ((u << 8) | 0x3F800000).to(tl.float32, bitcast=True)

@triton.jit
def nibble_mantissa(nib):
    """nibble 0..15 (uint8) -> the float 1 + nib * 2^-7 (bits 0x3F8n0000)."""
    return ((nib.to(tl.int32) << 16) | 0x3F800000).to(tl.float32, bitcast=True)

@triton.jit
def int8_mantissa_ptx(q):
    """`int8_mantissa` 4 bytes at a time in 32-bit registers (PTX; the GPU only): flip the
    4 sign bits with one xor, then one byte permute a weight puts its byte under 1.0's
    exponent (0x3F80uu00): 1.25 instructions a weight."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, one;
        xor.b32 t, $4, 0x80808080;
        mov.b32 one, 0x3F800000;
        prmt.b32 $0, t, one, 0x7604;
        prmt.b32 $1, t, one, 0x7614;
        prmt.b32 $2, t, one, 0x7624;
        prmt.b32 $3, t, one, 0x7634;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[q],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )

@triton.jit
def nibble_mantissas_ptx(b):
    """uint8 bytes -> (`nibble_mantissa` of the low nibbles, of the high nibbles), 4 bytes a
    step in 32-bit registers (PTX; the GPU only): mask the 4 low (then high) nibbles at once
    and set each byte's top bit (1.0's exponent bit), then one byte permute a weight puts it
    under the exponent (0x3F8n0000): ~1.4 instructions a weight."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, top;
        mov.b32 top, 0x3F000000;
        and.b32 t, $8, 0x0F0F0F0F;
        or.b32 t, t, 0x80808080;
        prmt.b32 $0, t, top, 0x7044;
        prmt.b32 $1, t, top, 0x7144;
        prmt.b32 $2, t, top, 0x7244;
        prmt.b32 $3, t, top, 0x7344;
        shr.u32 t, $8, 4;
        and.b32 t, t, 0x0F0F0F0F;
        or.b32 t, t, 0x80808080;
        prmt.b32 $4, t, top, 0x7044;
        prmt.b32 $5, t, top, 0x7144;
        prmt.b32 $6, t, top, 0x7244;
        prmt.b32 $7, t, top, 0x7344;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
        args=[b],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )

@triton.jit
def scaled_mantissa(m, d, BASE: tl.constexpr, UNIT: tl.constexpr, FUSED: tl.constexpr):
    """(m - BASE) * UNIT * d for m = BASE + w / UNIT (the mantissa floats above, w the
    integer weight): w * d exactly.

    FUSED is one FMA a weight: m * (UNIT d) + (-BASE UNIT d), whose constant is exact
    (BASE * UNIT is 32896 = 2^15 + 2^7 for q8_0, 136 = 2^7 + 2^3 for q4_0: at most 9
    significant bits, times d's 11) and whose exact sum w * d (<= 19 bits) is representable,
    so the one rounding is exact. The interpreter takes the two-step form (m - BASE is exact).
    """
    if FUSED:
        return tl.fma(m, d * UNIT, d * (-BASE * UNIT))
    else:
        return (m - BASE) * (d * UNIT)

@triton.jit
def nibble_to_dot(nib, DOT: tl.constexpr, WIDEN: tl.constexpr):
    """Nibbles 0..15 -> exact nib - 8 in the dot's dtype. For bfloat16 the bits 0x4300 | nib
    are 128 + nib, so one bf16 subtraction gives the value without any conversion (not
    under the interpreter, which does arithmetic on bf16's raw bits)."""
    if DOT == tl.bfloat16 and not WIDEN:
        return (nib.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
    else:
        return nibble_to_f32(nib).to(DOT)

@triton.jit
def nibbles_bf16(b):
    """uint8 bytes -> (low nibble - 8, high nibble - 8) as exact bfloat16, 4 bytes per step
    in 32-bit registers (PTX; the GPU only): mask the nibbles of 4 bytes at once, place each
    under the bf16 exponent of 128 with one byte permute per pair (bits 0x43nn = 128 + nn),
    and subtract 136 from a pair with one bf16x2 FMA: ~1.4 instructions a weight."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, e, one, off;
        mov.b32 e, 0x43434343;
        mov.b32 one, 0x3F803F80;
        mov.b32 off, 0xC308C308;
        and.b32 t, $4, 0x0F0F0F0F;
        prmt.b32 $0, t, e, 0x5140;
        prmt.b32 $1, t, e, 0x7362;
        fma.rn.bf16x2 $0, $0, one, off;
        fma.rn.bf16x2 $1, $1, one, off;
        shr.u32 t, $4, 4;
        and.b32 t, t, 0x0F0F0F0F;
        prmt.b32 $2, t, e, 0x5140;
        prmt.b32 $3, t, e, 0x7362;
        fma.rn.bf16x2 $2, $2, one, off;
        fma.rn.bf16x2 $3, $3, one, off;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[b],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
