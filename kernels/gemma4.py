"""Gemma 4's fused step ops (its twins: `gemma4_ref.py`).

`gemma_qk_norm_rope_kv_write`: everything between the fused projection and attention, in one
launch, per (row, head): q and k RMSNormed with Gemma 4's norm (float32 statistics, the weight
multiplied in float32, one rounding to the model dtype), rotated by rotate-half RoPE at the row's
position (cos/sin rows gathered from the layer type's tables: default rope on sliding layers,
the proportional partial rope of full layers is just its tables), k written into the cache; v
(with `attention_k_eq_v` the raw key projection) RMSNormed without a weight and written. A
KV-shared layer (no caches) only gets its q.

`gemma_add_norm`: a sandwich norm's residual add and the norm after it, one program a row:
`x = x + norm(branch, w_branch)` [then `x * layer_scalar`], and `norm(x, w_out)` (the
pre-feed-forward norm, the next layer's input norm or the final norm): what the layer does
between its attention and its MLP, and between its MLP and the next layer's projections.
`gemma_add_two_norms`: the same program writing a second norm of the new residual (the MoE
block's experts' input norm beside the MLP's).

`gelu_tanh_mul`: the MLP's `gelu_tanh(gate) * up` from the fused gate/up projection.

`softcap`: the logits' `cap * tanh(z / cap)` (`final_logit_softcapping`) in one launch, with the
widening to float32 the step's logits take folded in.

Numerics. The norm rounds where the twin does (the normalized value and the weight product in
float32, one rounding): the two differ only in the float32 sum of squares' order (and `1/sqrt`
against torch's `pow(-0.5)`, which torch computes as a reciprocal square root). RoPE rounds as the
twin's `x*cos + rotate_half(x)*sin` does in the model dtype: each product, then their sum, so it
is the twin bit for bit on the same normed values. tanh is `(1 - e) / (1 + e)` with
e = exp(-2|a|), and a Taylor polynomial below |a| < 1/16 where `1 - e` would cancel: a few float32
ulps from torch's tanh (which differs between CPU and CUDA too), in the softcap and in the GELU;
every other step rounds where torch rounds.

Row invariance: one program per (row, head) or per (row, block of columns); its work depends on
that row's values and position only. Positions are read on the device (CUDA-graph capturable)
and must lie in [0, min(S, S_tab)) (not checked there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (check_dtype, check_kv_caches, check_last_contiguous, check_positions, check_tensors, gate_up_out,
                      next_pow2)
from ._pdl import pdl_args, pdl_wait
from .rope import rope_head_program, rope_table_halves
from .gemma4_ref import (gelu_tanh_mul_ref, gemma_add_norm_ref, gemma_add_two_norms_ref,  # noqa: F401
                         gemma_qk_norm_rope_kv_write_ref, gemma_rms_norm_ref, softcap_ref)  # (the twins)

SOFTCAP_BLOCK = 1024  # logits per program


@triton.jit
def _gemma_norm(src, w_ptr, eps, offs, mask, HD: tl.constexpr, WEIGHT: tl.constexpr):
    """One head at `src` (hd contiguous values) as two halves (`offs` indexes a half): Gemma 4's
    RMSNorm `x * (mean(x^2) + eps)^-0.5 [* w]` in float32, rounded once to the model dtype.
    Returns the halves as float32 (holding model-dtype values)."""
    HALF: tl.constexpr = HD // 2
    dt = src.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD
    rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
    n1 = x1 * rstd
    n2 = x2 * rstd
    if WEIGHT:
        n1 = n1 * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n2 = n2 * tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return n1.to(dt).to(tl.float32), n2.to(dt).to(tl.float32)


@triton.jit
def _rope_store(n1, n2, cos_row, sin_row, dst, offs, mask, HD: tl.constexpr):
    """Rotate-half RoPE of the normed halves, rounded as the twin's model-dtype
    `x*cos + rotate_half(x)*sin` (each product, then the sum), stored at `dst`."""
    HALF: tl.constexpr = HD // 2
    dt = dst.dtype.element_ty
    c1, c2, s1, s2 = rope_table_halves(cos_row, sin_row, offs, mask, HD)
    o1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
    o2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
    tl.store(dst + offs, o1.to(dt), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dt), mask=mask)


@triton.jit
def _gemma_qkv_kernel(proj_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                      stride_proj, stride_cos, stride_sin, stride_q_out_t, stride_q_out_h, stride_kc_h, stride_kc_s,
                      stride_vc_h, stride_vc_s, n_heads, n_kv, eps, kv_rows, HD: tl.constexpr,
                      HALF_BLOCK: tl.constexpr, K_EQ_V: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, head): heads [0, nh) are q heads, [nh, nh + nkv) the k/v heads. K/V go to
    storage row pos % kv_rows (a ring storage's; a plain one's is pos itself)."""
    pdl_wait(PDL)
    row, head, offs, mask, pos, cos_row, sin_row = rope_head_program(pos_ptr, cos_ptr, sin_ptr, stride_cos,
                                                                     stride_sin, HD, HALF_BLOCK)
    HALF: tl.constexpr = HD // 2
    src = proj_ptr + row * stride_proj + head * HD  # q heads then k heads, adjacent
    if head < n_heads:
        n1, n2 = _gemma_norm(src, q_w_ptr, eps, offs, mask, HD, True)
        _rope_store(n1, n2, cos_row, sin_row, q_out_ptr + row * stride_q_out_t + head * stride_q_out_h,
                    offs, mask, HD)
    else:
        kv_head = (head - n_heads).to(tl.int64)
        slot = pos % kv_rows
        n1, n2 = _gemma_norm(src, k_w_ptr, eps, offs, mask, HD, True)
        _rope_store(n1, n2, cos_row, sin_row, k_cache_ptr + kv_head * stride_kc_h + slot * stride_kc_s,
                    offs, mask, HD)
        v_src = src if K_EQ_V else src + n_kv * HD  # k_eq_v: v is the raw key projection
        v1, v2 = _gemma_norm(v_src, k_w_ptr, eps, offs, mask, HD, False)
        v_dst = v_cache_ptr + kv_head * stride_vc_h + slot * stride_vc_s
        tl.store(v_dst + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_qkv(proj, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, k_eq_v):
    """Shapes, devices and dtypes of `gemma_qk_norm_rope_kv_write`'s arguments."""
    t, hd = proj.shape[0], cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or hd % 2:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must both be [S_tab, head_dim], "
                         "head_dim even")
    owns_kv = k_cache is not None
    width = (n_heads + (n_kv * (1 if k_eq_v else 2) if owns_kv else 0)) * hd
    if proj.dim() != 2 or proj.shape[1] != width:
        raise ValueError(f"proj {tuple(proj.shape)} is not [t, {width}] (n_heads={n_heads}, n_kv={n_kv}, "
                         f"head_dim={hd}, k_eq_v={k_eq_v}, caches {'given' if owns_kv else 'none'})")
    norms = (q_norm_w, k_norm_w) if owns_kv else (q_norm_w,)
    if any(w is None or w.shape != (hd,) for w in norms):
        raise ValueError(f"q_norm_w / k_norm_w must be [head_dim={hd}] (cos/sin's width)")
    check_positions(positions, t)
    caches = (("k_cache", k_cache), ("v_cache", v_cache)) if owns_kv else ()
    if owns_kv:
        check_kv_caches(k_cache, v_cache, n_kv, hd)
    check_tensors(proj, *norms, cos, sin, positions, *(c for _, c in caches))
    check_dtype(proj, "proj")
    for name, a in [("q_norm_w", q_norm_w), ("cos", cos), ("sin", sin), *caches] + \
            ([("k_norm_w", k_norm_w)] if owns_kv else []):
        if a.dtype != proj.dtype:
            raise TypeError(f"{name} is {a.dtype}; everything must be in the model dtype {proj.dtype}")
        check_last_contiguous(a, name)
    check_last_contiguous(proj, "proj")


def gemma_qk_norm_rope_kv_write(proj: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor | None,
                                cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, n_heads: int,
                                n_kv: int, eps: float, k_eq_v: bool) -> torch.Tensor:
    """Gemma 4's q/k norm + rope + v norm + K/V write (the twin `gemma_qk_norm_rope_kv_write_ref`
    says what each argument is); returns q `[t, nh, hd]`. k_cache / v_cache None: a KV-shared
    layer's q only."""
    _check_qkv(proj, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, k_eq_v)
    t, hd = proj.shape[0], cos.shape[1]
    q = torch.empty((t, n_heads, hd), dtype=proj.dtype, device=proj.device)
    if t == 0:
        return q
    owns_kv = k_cache is not None
    kc, vc = (k_cache, v_cache) if owns_kv else (q[:, :1], q[:, :1])  # never written without k/v heads
    _gemma_qkv_kernel[(t, n_heads + (n_kv if owns_kv else 0))](
        proj, q_norm_w, k_norm_w if owns_kv else q_norm_w, cos, sin, positions, q, kc, vc,
        proj.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), n_heads, n_kv if owns_kv else 0, float(eps),
        kc.shape[1] if owns_kv else 1, HD=hd, HALF_BLOCK=next_pow2(hd // 2), K_EQ_V=bool(k_eq_v), num_warps=1 if hd <= 256 else 2,
        **pdl_args(proj),
    )
    return q


# --------------------------------------------------------------------------- sandwich norms


@triton.jit
def _row_norm(x, w_ptr, eps, offs, mask, d, dt):
    """Gemma 4's RMSNorm of one float32 row `x` (holding model-dtype values) by the weight at
    `w_ptr`: float32 throughout, the weight before the one rounding to `dt`; returned as float32."""
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / d + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (x * rstd * w).to(dt).to(tl.float32)


@triton.jit
def _add_norm_kernel(x_ptr, b_ptr, wb_ptr, wo_ptr, s_ptr, x_out_ptr, out_ptr, d, stride_x, stride_b, stride_xo,
                     stride_o, eps, SCALAR: tl.constexpr, BLOCK_D: tl.constexpr, wo2_ptr=None, out2_ptr=None,
                     OUT2: tl.constexpr = False, PDL: tl.constexpr = False):
    """One row: x' = (x + norm(b, wb)) [* s], each op rounded to x's dtype; out = norm(x', wo);
    OUT2: also out2 = norm(x', wo2) (stride_o's rows)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < d
    dt = x_out_ptr.dtype.element_ty
    b = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    x = (x + _row_norm(b, wb_ptr, eps, offs, mask, d, dt)).to(dt).to(tl.float32)
    if SCALAR:  # the layer's layer_scalar, read on the device
        x = (x * tl.load(s_ptr).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(x_out_ptr + row * stride_xo + offs, x.to(dt), mask=mask)
    tl.store(out_ptr + row * stride_o + offs, _row_norm(x, wo_ptr, eps, offs, mask, d, dt).to(dt), mask=mask)
    if OUT2:
        tl.store(out2_ptr + row * stride_o + offs, _row_norm(x, wo2_ptr, eps, offs, mask, d, dt).to(dt), mask=mask)


def gemma_add_norm(x: torch.Tensor, branch: torch.Tensor, w_branch: torch.Tensor, w_out: torch.Tensor, eps: float,
                   scalar: torch.Tensor | None = None, _out2=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin `gemma_add_norm_ref` in one launch: `x, branch [t, hidden]`, weights `[hidden]`,
    `scalar` `[1]` or None, all in x's dtype -> (new residual, normed) `[t, hidden]`. `_out2`
    (`gemma_add_two_norms`'s): (second norm weight, its output) written in the same program."""
    t, d = x.shape if x.dim() == 2 else (0, 0)
    if x.dim() != 2 or branch.shape != x.shape or w_branch.shape != (d,) or w_out.shape != (d,) \
            or (scalar is not None and scalar.numel() != 1):
        raise ValueError(f"expected x, branch [t, d], weights [d], scalar [1]; got {tuple(x.shape)}, "
                         f"{tuple(branch.shape)}, {tuple(w_branch.shape)}, {tuple(w_out.shape)}, "
                         f"{None if scalar is None else tuple(scalar.shape)}")
    named = [("x", x), ("branch", branch), ("w_branch", w_branch), ("w_out", w_out)] + \
        ([("scalar", scalar)] if scalar is not None else [])
    check_tensors(*(a for _, a in named))
    for name, a in named:
        check_dtype(a, name)
        if a.dtype != x.dtype:
            raise TypeError(f"{name} is {a.dtype}; everything must be in x's dtype {x.dtype}")
        check_last_contiguous(a, name)
    x_out, out = torch.empty_like(x), torch.empty_like(x)
    if t:
        block_d = next_pow2(d)
        _add_norm_kernel[(t,)](
            x, branch, w_branch, w_out, x if scalar is None else scalar, x_out, out, d, x.stride(0), branch.stride(0),
            x_out.stride(0), out.stride(0), float(eps), SCALAR=scalar is not None, BLOCK_D=block_d,
            wo2_ptr=None if _out2 is None else _out2[0], out2_ptr=None if _out2 is None else _out2[1],
            OUT2=_out2 is not None, num_warps=4 if block_d <= 1024 else (8 if block_d <= 8192 else 16), **pdl_args(x))
    return x_out, out


def gemma_add_two_norms(x: torch.Tensor, branch: torch.Tensor, w_branch: torch.Tensor, w_out: torch.Tensor,
                        w_out2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin `gemma_add_two_norms_ref` in one launch (`gemma_add_norm`'s program, writing a
    second norm of the new residual by `w_out2 [hidden]`) -> (new residual, normed, normed by w_out2)."""
    if w_out2.shape != w_out.shape or w_out2.dtype != x.dtype or w_out2.stride(-1) != 1:
        raise ValueError(f"w_out2 {tuple(w_out2.shape)} {w_out2.dtype}: expected {tuple(w_out.shape)} {x.dtype}, "
                         "contiguous")
    check_tensors(w_out2)
    out2 = torch.empty_like(x)
    x_out, out = gemma_add_norm(x, branch, w_branch, w_out, eps, _out2=(w_out2, out2))
    return x_out, out, out2


# --------------------------------------------------------------------------- GELU-tanh · up

GELU_BLOCK = 1024  # columns of the output per program


@triton.jit
def _gelu_mul_kernel(gu_ptr, out_ptr, ffn, stride_gu, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block of columns): out = gelu_tanh(gate) * up, gate the row's first ffn
    columns, up the next; the GELU in float32 rounded to the model dtype, then the product."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ffn
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + ffn + offs, mask=ok, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))  # torch's order: sqrt(2/pi) (g + 0.044715 g^3)
    act = (0.5 * g * (1.0 + _tanh(inner))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * u).to(dt), mask=ok)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` of the fused gate/up projection `[t, 2*ffn]` -> `[t, ffn]` (the
    twin `gelu_tanh_mul_ref`) in one launch."""
    out = gate_up_out(gate_up)
    t, ffn = out.shape
    if t:
        _gelu_mul_kernel[(t, triton.cdiv(ffn, GELU_BLOCK))](
            gate_up, out, ffn, gate_up.stride(0), out.stride(0), BLOCK=GELU_BLOCK, num_warps=4, **pdl_args(gate_up))
    return out


# --------------------------------------------------------------------------- softcap


@triton.jit
def _tanh(a):
    """tanh of float32 `a`: (1 - e) / (1 + e), e = exp(-2|a|), with the sign of a; for |a| < 1/16
    (where 1 - e would cancel) its Taylor polynomial to a^7 (the next term is < 2^-37 of tanh there)."""
    ax = tl.abs(a)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    a2 = ax * ax
    small = ax + ax * a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0)))
    th = tl.where(ax < 0.0625, small, big)
    return tl.where(a < 0.0, -th, th)


@triton.jit
def _softcap_kernel(z_ptr, out_ptr, n_cols, stride_z, stride_out, cap, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Program (row, block of columns): out = cap * tanh(z / cap), each op rounded to z's dtype."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    dt = z_ptr.dtype.element_ty
    z = tl.load(z_ptr + row * stride_z + offs, mask=ok, other=0.0).to(tl.float32)
    a = tl.math.div_rn(z, cap).to(dt).to(tl.float32)
    th = _tanh(a).to(dt).to(tl.float32)
    out = (th * cap).to(dt)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def softcap(z: torch.Tensor, cap: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`cap * tanh(z / cap)` of logits `z [t, V]` in z's dtype, returned in `out_dtype` (default
    z's; float32 folds the logits' widening into the launch)."""
    if z.dim() != 2 or not cap > 0:
        raise ValueError(f"softcap takes z [t, V] and cap > 0, got {tuple(z.shape)} and {cap}")
    check_tensors(z)
    check_dtype(z, "z")
    check_last_contiguous(z, "z")
    out = torch.empty(z.shape, dtype=out_dtype or z.dtype, device=z.device)
    if z.numel():
        _softcap_kernel[(z.shape[0], triton.cdiv(z.shape[1], SOFTCAP_BLOCK))](
            z, out, z.shape[1], z.stride(0), out.stride(0), float(cap), BLOCK=SOFTCAP_BLOCK, num_warps=4,
            **pdl_args(z))
    return out
