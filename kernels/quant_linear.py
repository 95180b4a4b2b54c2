"""Quantized-weight linear for small batches: y = x @ W.T with W stored as ggml q8_0 / q4_0.

The engine's decode, verify and drafter rounds multiply a handful of rows (M = 1..32) by large
weights, so the cost is reading the weight once. The Triton kernel here reads each weight byte
once per call (every program handles all M rows of x for its tile of output features),
dequantizes in registers and accumulates in float32.

The weight is read in the packed layout of kernels/quant_pack.py (`Packed`, made once at load
from the raw ggml blocks): rows of q8_0 bytes or of q4_0 nibble pairs, 16-byte aligned, with the
f16 scales split off. For q4_0 the kernel never interleaves nibbles: the low nibbles of a tile's
bytes multiply the first 16 columns of x of each block and the high nibbles the last 16, so x
(small, cached) is gathered in that order instead of the weight being shuffled.

Dequantization, two variants (KernelConfig.scale_after_dot, kernels/quant_tuning.py, per shape):
  dequantize-first: W = q * d in float32 (one FMA a weight through a magic-number float, no
    int-to-float instruction), rounded to x's dtype, then one dot per BLOCK_K tile; the weights
    the dot sees equal `Packed.dequantize(x.dtype)` exactly (what `quant_linear_ref` uses).
  scale-after-dot: the integers q (exact in bf16) go into one dot per 32-block and the float32
    partial is multiplied by d; on CUDA with bf16 x the q4_0 nibbles become bf16 pairs with a
    few 32-bit PTX instructions per 4 bytes. No weight is rounded, so the result is at least
    as accurate as the reference but not bit-equal to it. Fewer instructions per weight, but
    slower on the H200 in the 4-warp tiles measured (with swap_ab, warpgroup MMAs: a dot and a
    wait per 32 columns), so no TUNED shape uses it; swap_ab with 1-2 warps takes the per-warp
    MMAs, which wait on no dot, and the sweep (benchmarks/gpu/quant_linear_sweep.py) times those.
  mantissa (KernelConfig.mantissa, dequantize-first only): the integer weight is put under the
    exponent of 1.0 by byte permutes, 4 bytes a step in 32-bit registers (q8_0: 0x3F80uu00 for
    u = q + 128, one xor for 4 weights then one permute a weight; q4_0: 0x3F8n0000, one mask a 4
    nibbles then one permute a weight), and one FMA with constants folded into the block's
    scale gives q * d exactly: the same weights as the default, in about half the integer
    instructions (docs/tuning.md#quantized-linear). The integer-to-float helpers of all three
    (magic numbers, mantissas, PTX) are kernels/_quant_dequant.py.

The kernel is bound by instruction issue, not memory (so q4_0, with two weights a byte, is
slower per byte than q8_0), and eager calls cost host time, so they are meant to run under CUDA
graphs; where it stands against the copy speed: docs/tuning.md#quantized-linear.

Determinism: the tile sizes and split-K count are a function of (qtype, out, in) alone, never of
M (`quant_tuning.config_for`), the block of rows is always BLOCK_M (padded, masked), and split-K
partials are summed in a fixed order by the last program of each tile (no float atomics). So a
row's output is bit-identical whether it is multiplied alone or with up to any number of other rows.

Fused projections: weights sharing an input stack along out (`QuantLinear.concat`, over
`Packed.concat`: one launch for a drafter's q/k/v or gate/up), and any run of output features is a
view of those rows (`QuantLinear.rows`). The fused call's tiles are those of its own (qtype, out,
in), so its outputs match the parts' calls within the kernel's tolerance, not bit for bit.

Public API: `quant_linear`, `quant_linear_ref`, `QuantLinear`, `set_force_triton`,
`triton_available`.
"""

from __future__ import annotations

import os

import torch

from .ggml_blocks_ref import quantize
from .quant_pack import Packed, pack
from .quant_tuning import KernelConfig, config_for

try:  # the package also works without Triton: QuantLinear then runs the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

__all__ = ["quant_linear", "quant_linear_ref", "QuantLinear", "set_force_triton", "triton_available"]

# Triton's interpreter runs kernels on CPU tensors, but only when the variable is set before the
# kernels below are defined (that is, before this module is imported).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """True when the Triton kernel can be launched at all (on CUDA, or on CPU when interpreted)."""
    return triton is not None


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

if triton is not None:
    from ._quant_dequant import (int8_magic, int8_mantissa, int8_mantissa_ptx, int8_to_f32, nibble_magic,
                                 nibble_mantissa, nibble_mantissas_ptx, nibble_to_dot, nibbles_bf16,
                                 scaled_magic, scaled_mantissa)
    from ._splitk import counters, store_or_reduce, tile_rows

    @triton.jit
    def _dot(a, b, acc, PREC: tl.constexpr, WIDEN: tl.constexpr):
        """acc + a @ b. WIDEN (the interpreter only: its tl.dot multiplies bf16/f16 raw bits)
        widens both operands to float32 first, which leaves every product unchanged."""
        if WIDEN:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def _mma(xt, w, acc, SWAP: tl.constexpr, PREC: tl.constexpr, WIDEN: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += xt @ w.T, or with SWAP acc [BLOCK_N, BLOCK_M] += w @ xt.T:
        the weight tile as the left operand, the one the matrix units take from registers and
        whose large side (BLOCK_N) fills their 64-row instruction shape."""
        if SWAP:
            return _dot(w, tl.trans(xt), acc, PREC, WIDEN)
        else:
            return _dot(xt, tl.trans(w), acc, PREC, WIDEN)

    @triton.jit
    def _load_x(x_rows, m_mask, cols, K, EVEN_K: tl.constexpr):
        """x[rows, cols] -> [BLOCK_M, len(cols)], zero outside M (and outside K)."""
        if EVEN_K:
            return tl.load(x_rows + cols[None, :], mask=m_mask[:, None], other=0.0)
        else:
            return tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & (cols[None, :] < K),
                           other=0.0)

    @triton.jit
    def _load_w(w_rows, n_mask, cols, limit, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        """Weight bytes w[rows, cols] -> [BLOCK_N, len(cols)], zero outside N (and `limit`)."""
        if EVEN_N and EVEN_K:
            return tl.load(w_rows + cols[None, :])
        elif EVEN_K:
            return tl.load(w_rows + cols[None, :], mask=n_mask[:, None], other=0)
        else:
            return tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & (cols[None, :] < limit),
                           other=0)

    @triton.jit
    def _tile_dequant_first(acc, x_rows, w_rows, s_rows, m_mask, n_mask, k0, K,
                            Q4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                            PREC: tl.constexpr, WIDEN: tl.constexpr, MANT: tl.constexpr):
        """acc += x[:, k0:k0+BLOCK_K] @ W[tile, k0:k0+BLOCK_K].T (see _mma for SWAP), with W
        dequantized to x's dtype first (q * d rounded once: the same values as `dequantize`)."""
        DOT: tl.constexpr = x_rows.dtype.element_ty
        FUSED: tl.constexpr = not WIDEN
        NB: tl.constexpr = BLOCK_K // 32
        sb = k0 // 32 + tl.arange(0, NB)
        s = _load_w(s_rows, n_mask, sb, K // 32, EVEN_N, EVEN_K).to(tl.float32)[:, :, None]
        if Q4:
            # byte column c of the tile: low nibble is column 32 (c // 16) + c % 16, high + 16
            c = tl.arange(0, BLOCK_K // 2)
            b = _load_w(w_rows, n_mask, k0 // 2 + c, K // 2, EVEN_N, EVEN_K)
            if MANT:
                if WIDEN:
                    m_lo, m_hi = nibble_mantissa(b & 15), nibble_mantissa(b >> 4)
                else:
                    m_lo, m_hi = nibble_mantissas_ptx(b)
                lo = scaled_mantissa(tl.reshape(m_lo, (BLOCK_N, NB, 16)), s, 1.0625, 128.0, FUSED)
                hi = scaled_mantissa(tl.reshape(m_hi, (BLOCK_N, NB, 16)), s, 1.0625, 128.0, FUSED)
            else:
                lo = scaled_magic(tl.reshape(nibble_magic(b & 15), (BLOCK_N, NB, 16)), s, FUSED)
                hi = scaled_magic(tl.reshape(nibble_magic(b >> 4), (BLOCK_N, NB, 16)), s, FUSED)
            lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)).to(DOT)
            hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)).to(DOT)
            k_lo = k0 + (c // 16) * 32 + c % 16
            acc = _mma(_load_x(x_rows, m_mask, k_lo, K, EVEN_K), lo, acc, SWAP, PREC, WIDEN)
            acc = _mma(_load_x(x_rows, m_mask, k_lo + 16, K, EVEN_K), hi, acc, SWAP, PREC, WIDEN)
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            q = _load_w(w_rows, n_mask, cols, K, EVEN_N, EVEN_K)
            if MANT:
                m = int8_mantissa(q) if WIDEN else int8_mantissa_ptx(q)
                w = scaled_mantissa(tl.reshape(m, (BLOCK_N, NB, 32)), s, 1.00390625, 32768.0, FUSED)
            else:
                w = scaled_magic(tl.reshape(int8_magic(q), (BLOCK_N, NB, 32)), s, FUSED)
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DOT)
            acc = _mma(_load_x(x_rows, m_mask, cols, K, EVEN_K), w, acc, SWAP, PREC, WIDEN)
        return acc

    @triton.jit
    def _tile_scale_after(acc, x_rows, w_rows, s_rows, m_mask, n_mask, k0, K,
                          Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          SWAP: tl.constexpr, PREC: tl.constexpr, WIDEN: tl.constexpr):
        """The same product block by block: the integer weights (exact in x's dtype) go into
        the dot and each 32-column partial is scaled by d in float32."""
        DOT: tl.constexpr = x_rows.dtype.element_ty
        for j in tl.static_range(BLOCK_K // 32):
            kb = k0 // 32 + j
            if EVEN_N and EVEN_K:
                d = tl.load(s_rows + kb)
            else:
                d = tl.load(s_rows + kb, mask=n_mask & (kb < K // 32), other=0.0)
            if SWAP:
                part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            else:
                part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            if Q4:
                c = tl.arange(0, 16)
                b = _load_w(w_rows, n_mask, kb * 16 + c, K // 2, EVEN_N, EVEN_K)
                if DOT == tl.bfloat16 and not WIDEN:
                    lo, hi = nibbles_bf16(b)
                else:
                    lo = nibble_to_dot(b & 15, DOT, WIDEN)
                    hi = nibble_to_dot(b >> 4, DOT, WIDEN)
                part = _mma(_load_x(x_rows, m_mask, kb * 32 + c, K, EVEN_K), lo, part, SWAP,
                            PREC, WIDEN)
                part = _mma(_load_x(x_rows, m_mask, kb * 32 + 16 + c, K, EVEN_K), hi, part,
                            SWAP, PREC, WIDEN)
            else:
                cols = kb * 32 + tl.arange(0, 32)
                q = _load_w(w_rows, n_mask, cols, K, EVEN_N, EVEN_K)
                part = _mma(_load_x(x_rows, m_mask, cols, K, EVEN_K), int8_to_f32(q).to(DOT),
                            part, SWAP, PREC, WIDEN)
            if SWAP:
                acc += part * d.to(tl.float32)[:, None]
            else:
                acc += part * d.to(tl.float32)[None, :]
        return acc

    # one binary for every M (rows never change the code) and every split count
    @triton.jit(do_not_specialize=["M", "SPLIT_K"])
    def _quant_linear_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_om, SPLIT_K,
        Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr, SCALE_AFTER: tl.constexpr, SWAP: tl.constexpr,
        EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, WIDEN: tl.constexpr,
        GLU: tl.constexpr = False, MANT: tl.constexpr = False,
    ):
        """out [M, N] = x [M, K] @ W.T for one (n tile, k split, m tile) per program; with GLU,
        out [M, N / 2] = silu(x @ gate.T) * (x @ up.T) for W = [gate; up] (`_splitk.tile_rows`).

        W is the packed weight (w_ptr: int8 [N, K] or uint8 [N, K/2]; s_ptr: f16 [N, K/32]).
        With SPLIT (SPLIT_K > 1, a run-time count) the tile's partials meet in ws [SPLIT_K, M, N]
        and the last program to arrive sums them in split order (kernels/_splitk.py).
        """
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if GLU:  # gate rows and the up rows of the same outputs, clamped into the weight
            offs_n, n_mask = tile_rows(pid_n, N, BLOCK_N, True)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
        m_mask = offs_m < M
        rows_n = offs_n.to(tl.int64)[:, None]
        if Q4:
            w_rows = w_ptr + rows_n * (K // 2)
        else:
            w_rows = w_ptr + rows_n * K
        s_rows = s_ptr + offs_n.to(tl.int64) * (K // 32)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

        k_tiles = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        t_begin = pid_k * per_split
        t_end = tl.minimum(t_begin + per_split, k_tiles)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for t in range(t_begin, t_end):
            if SCALE_AFTER:
                acc = _tile_scale_after(acc, x_rows, w_rows, s_rows, m_mask, n_mask, t * BLOCK_K,
                                        K, Q4, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, SWAP,
                                        PREC, WIDEN)
            else:
                acc = _tile_dequant_first(acc, x_rows, w_rows, s_rows[:, None], m_mask, n_mask,
                                          t * BLOCK_K, K, Q4, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K,
                                          SWAP, PREC, WIDEN, MANT)
        if SWAP:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N], once per program

        store_or_reduce(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_om, SPLIT_K,
                        SPLIT, BLOCK_M, BLOCK_N, GLU)


_DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quant_linear(x: torch.Tensor, packed: Packed, *, config: KernelConfig | None = None,
                 out: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W.T on the Triton kernel, in x's dtype (bf16, f16 or f32).

    Float32 accumulation; W dequantized in registers. `config` overrides the per-shape tiles
    (benchmarks); `out` (contiguous [M, out] of x's dtype) receives the result if given. Runs
    on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.

    glu: W is a fused [gate; up] weight [2 I, in] and y [M, I] = silu(x @ gate.T) * (x @ up.T),
    in the same launch and bit for bit `activation.silu_mul(quant_linear(x, packed))` (the
    tiles of W's shape; the SwiGLU epilogue of dense_linear, kernels/_splitk.py).
    """
    if triton is None:
        raise RuntimeError("quant_linear needs Triton, which is not installed")
    n, k = packed.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a {packed.qtype} weight {packed.shape}, "
                         f"got {tuple(x.shape)}")
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.device != packed.device:
        raise ValueError(f"x is on {x.device} but the weight is on {packed.device}")
    if x.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError("the Triton kernel runs on CUDA tensors (or on CPU with "
                           "TRITON_INTERPRET=1 set before importing memra_kernels)")
    if glu and n % 2:
        raise ValueError(f"glu needs a fused [gate; up] weight with an even row count, got {packed.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    n_out = n // 2 if glu else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n_out}] {x.dtype} tensor")
    if m == 0:
        return out
    _launch(x, packed, config.check() if config is not None else config_for(packed.qtype, n, k),
            out, glu=glu)
    return out


def _launch(x: torch.Tensor, packed: Packed, cfg: KernelConfig, out: torch.Tensor, glu: bool = False):
    """Launch the kernel for validated arguments; returns Triton's compiled-kernel handle."""
    m, (n, k) = x.shape[0], packed.shape
    # a GLU tile holds block_n / 2 output columns (their gate and up rows)
    cols = cfg.block_n // 2 if glu else cfg.block_n
    grid = (triton.cdiv(out.shape[1], cols), cfg.split_k, triton.cdiv(m, cfg.block_m))
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        cnt = counters("quant_linear", x.device, grid[0] * grid[2])
    else:
        ws, cnt = out, out  # never touched: the kernel's split-K branch is compiled out
    return _quant_linear_kernel[grid](
        x, packed.qweight, packed.scales, out, ws, cnt,
        m, n, k, x.stride(0), out.stride(0), cfg.split_k,
        Q4=packed.qtype == "q4_0", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT=cfg.split_k > 1, SCALE_AFTER=cfg.scale_after_dot,
        SWAP=cfg.swap_ab,
        EVEN_N=out.shape[1] % cols == 0, EVEN_K=k % cfg.block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",  # f32 x: a true f32 product
        WIDEN=_INTERPRET and x.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, GLU=glu, MANT=cfg.mantissa,
        # Launched in plain stream order, not with PDL (kernels/_pdl.py): a weight stream over
        # many blocks measured slower with it (docs/tuning.md#quantized-linear).
    )


def quant_linear_ref(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The obviously-right version: x [M, in] @ dequantize(x.dtype).T in float32, cast to x's
    dtype (the weight is rounded to x's dtype exactly as the kernel rounds it)."""
    w = packed.dequantize(x.dtype).to(x.device)
    return (x.float() @ w.float().T).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Drop-in linear
# --------------------------------------------------------------------------------------------

_FORCE_TRITON = False


def set_force_triton(flag: bool) -> bool:
    """Make QuantLinear use the Triton kernel on CPU tensors too (interpreter tests); returns
    the previous setting."""
    global _FORCE_TRITON
    prev, _FORCE_TRITON = _FORCE_TRITON, bool(flag)
    return prev


class QuantLinear:
    """Drop-in for `QuantLinearRef`: `QuantLinear(raw, qtype, shape)(x [..., in]) -> [..., out]`.

    Holds the weight packed once (`packed`); calls the Triton kernel for CUDA inputs and the
    torch reference on CPU (unless `force_triton`, or `set_force_triton(True)`). Keeps
    QuantLinearRef's `qtype`, `shape`, `raw` (ggml bytes, rebuilt on request), `to(device)`
    (in place, returns self; dtype arguments are ignored: the weight stays quantized) and
    `from_float`.
    """

    def __init__(self, raw, qtype: str, shape, *, force_triton: bool | None = None):
        self.packed = pack(raw, qtype, shape)
        self.force_triton = force_triton

    @classmethod
    def from_packed(cls, packed: Packed, *, force_triton: bool | None = None) -> "QuantLinear":
        self = cls.__new__(cls)
        self.packed, self.force_triton = packed, force_triton
        return self

    @classmethod
    def from_ref(cls, ref, **kw) -> "QuantLinear":
        """From a `QuantLinearRef` (its raw bytes, on its device)."""
        return cls(ref.raw, ref.qtype, ref.shape, **kw)

    @classmethod
    def from_float(cls, weight, qtype: str, name: str = "tensor", **kw) -> "QuantLinear":
        """Quantize a float weight [out, in] with the ggml-identical encoder (`ggml_blocks_ref`) and pack it."""
        return cls(quantize(weight, qtype, name), qtype, tuple(weight.shape), **kw)

    @classmethod
    def concat(cls, parts: "list[QuantLinear]") -> "QuantLinear":
        """One linear computing `parts`' outputs side by side: their packed weights stacked
        along out (`Packed.concat`; qtype and in-features must agree). Bytes are copied once
        into the new weight; slice it with `rows` to share them."""
        parts = list(parts)
        return cls.from_packed(Packed.concat([p.packed for p in parts]),
                               force_triton=parts[0].force_triton if parts else None)

    def rows(self, lo: int, hi: int) -> "QuantLinear":
        """The linear of output features [lo, hi): a view of this weight's rows (`Packed.rows`)."""
        return QuantLinear.from_packed(self.packed.rows(lo, hi), force_triton=self.force_triton)

    @property
    def qtype(self) -> str:
        return self.packed.qtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def raw(self) -> torch.Tensor:
        """The ggml blocks, uint8 [out, in // 32 * block_bytes] (rebuilt: a copy)."""
        return self.packed.to_ggml()

    def to(self, *args, **kwargs) -> "QuantLinear":
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self.packed = self.packed.to(device)
        return self

    def _use_kernel(self, x: torch.Tensor) -> bool:
        if triton is None or x.dtype not in _DOT_DTYPES:
            return False
        if x.device.type == "cuda":
            return True
        force = _FORCE_TRITON if self.force_triton is None else self.force_triton
        return force

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self._use_kernel(x):
            y = quant_linear(x2, self.packed)
        else:
            y = quant_linear_ref(x2, self.packed)
        return y.reshape(*lead, self.shape[0])

    forward = __call__

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for this fused [gate; up] weight: `[..., out / 2]`, in one
        kernel launch (`quant_linear(glu=True)`) wherever a call would take the kernel, else the
        reference then torch's SiLU·mul."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self._use_kernel(x):
            y = quant_linear(x2, self.packed, glu=True)
        else:
            gate, up = quant_linear_ref(x2, self.packed).chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        return y.reshape(*lead, self.shape[0] // 2)

    def __repr__(self) -> str:
        return f"QuantLinear({self.qtype}, out={self.shape[0]}, in={self.shape[1]}, {self.device})"
