"""SwiGLU's elementwise middle: `silu(gate) * up` from the fused gate/up projection.

`silu_mul(gate_up)` reads `gate_up [t, 2*I]` (gate = first half, up = second half, as the engine's
`chunk(2, dim=-1)`) once and writes `[t, I]`: the torch path launches silu and mul separately
and materializes silu(gate).

Numerics: silu is computed in float32 as `g / (1 + exp(-g))` (torch's formula) and, like the
torch reference `F.silu(g) * u`, rounded to the model dtype BEFORE the multiply by `up`; that
multiply is done in float32 and rounded once, bit-identical to torch's bf16/f16 multiply (the
product is exact in float32). The only difference left is Triton's exp/divide (fast-math on the
GPU) against torch's, a float32 ulp or so that rarely survives the rounding to bf16.

Row invariance: purely elementwise; each output element depends only on its own gate/up pair.

`gelu_tanh_mul_rounded` is the same epilogue with GELU-tanh (Gemma 4's MoE experts, in the MoE
kernels' gate/up epilogue: moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import gate_up_out
from ._pdl import pdl_args, pdl_wait
from .activation_ref import silu_mul_ref  # noqa: F401  (the twin: the op's one torch body)

BLOCK_I = 1024  # columns per program


@triton.jit
def silu_mul_rounded(g, u, dt: tl.constexpr):
    """silu(g) * u in `dt` for g, u already in `dt`: silu in float32, rounded to `dt` before the
    float32 multiply by u, and the product rounded once (the numerics above). Shared with
    dense_linear's gate/up epilogue, which therefore gives this kernel's bits."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # rounded like torch's F.silu output
    return (act * u.to(tl.float32)).to(dt)


@triton.jit
def gelu_tanh_mul_rounded(g, u, dt: tl.constexpr):
    """gelu_tanh(g) * u in `dt`, rounded as `silu_mul_rounded` is (the activation in float32,
    rounded to `dt` before the multiply). 0.5·g·(1 + tanh(z)) is written g / (1 + exp(-2z)),
    z = sqrt(2/pi)·(g + 0.044715·g³): the same value without a tanh (the interpreter has none),
    saturating through exp's overflow to g / inf = -0, as torch's 1 + tanh(z) reaches 0. Near
    that tail torch's tanh loses the last ~1e-7 of 1 + tanh; this form keeps it, an absolute
    difference below 1e-7·|g|."""
    g = g.to(tl.float32)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (...)
    act = (g / (1.0 + tl.exp(-2.0 * z))).to(dt).to(tl.float32)  # rounded like torch's F.gelu output
    return (act * u.to(tl.float32)).to(dt)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    src = gu_ptr + row * stride_gu
    g = tl.load(src + offs, mask=mask, other=0.0)
    u = tl.load(src + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul_rounded(g, u, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[:, :I]) * gate_up[:, I:]` for `gate_up [t, 2*I]` -> `[t, I]` (same dtype).

    Rows may be strided; the last axis must be contiguous.
    """
    out = gate_up_out(gate_up)
    t, inter = out.shape
    if t == 0 or inter == 0:
        return out
    _silu_mul_kernel[(t, triton.cdiv(inter, BLOCK_I))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK_I, num_warps=4, **pdl_args(gate_up),
    )
    return out
