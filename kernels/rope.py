"""Everything between the fused q/k/v projection and attention, in one kernel.

`rope_kv_write` is the same kernel without the q/k norm (LLaMA), a compile-time switch.

`qk_norm_rope_kv_write` takes the projection `qkv [t, (nh + 2*nkv)*hd]` and, per row and head:
splits it into q, k, v heads; RMSNorms q and k per head (Qwen3's q_norm / k_norm); rotates them
by RoPE at the row's position (NeoX rotate-half layout, cos/sin rows gathered from the tables by
position, so default rope and YaRN, whose mscale is baked into the tables, are the same code);
writes rotated k and raw v into the KV cache at that position; and returns rotated q. The torch
path does this in about ten kernels with intermediates in memory.

Numerics: the per-head RMSNorm is HF's (float32 statistics, rounded to the model dtype before
the weight multiply, which is done in float32 and rounded once, bit-identical to torch's
model-dtype multiply for bf16/f16). RoPE is `x*cos + rotate_half(x)*sin` computed in float32
from the model-dtype normed values and tables and rounded ONCE to the model dtype; the torch
reference rounds `x*cos`, `rotate_half(x)*sin` and their sum separately (three roundings), so
kernel and reference can differ by about one model-dtype ulp (compared with a tolerance).

Row invariance: one program per (row, head); its work and its arithmetic depend only on that
row's slice of qkv and its position, never on the other rows, their count, or the cache size.
Positions are read on the device (CUDA-graph capturable); they must lie in [0, min(S, S_tab)):
nothing checks that on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_kv_caches, check_last_contiguous, check_positions, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from .norm_ref import rms_norm_ref as _rms_norm_ref  # noqa: F401  (the twins)
from .rope_ref import qk_norm_rope_kv_write_ref, rope_kv_write_ref, rope_ref as _rope_ref  # noqa: F401


@triton.jit
def rope_head_program(pos_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin, HD: tl.constexpr,
                      HALF_BLOCK: tl.constexpr):
    """A (row, head) program's indices for a rotate-half head: its row (int64), head, the offsets
    and mask of one half, the row's position and its cos/sin table rows (gathered on the device)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < HD // 2
    pos = tl.load(pos_ptr + row).to(tl.int64)
    return row, head, offs, mask, pos, cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin


@triton.jit
def rope_table_halves(cos_row, sin_row, offs, mask, HD: tl.constexpr):
    """The cos/sin rows' two halves `(c1, c2, s1, s2)` in float32 (`offs` indexes a half)."""
    HALF: tl.constexpr = HD // 2
    c1 = tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _norm_rope(src, w_ptr, cos_row, sin_row, eps, offs, mask,
               HD: tl.constexpr, NORM: tl.constexpr = True):
    """One head at `src` (hd contiguous values): RMSNorm by `w_ptr` (NORM; else none: LLaMA's
    q/k go to rope as projected), then rotate-half RoPE.

    Works on the two halves separately (`offs` indexes a half), which is what rotate-half pairs:
    element i < hd/2 with i + hd/2. Returns the rotated halves in float32 (not yet rounded).
    """
    HALF: tl.constexpr = HD // 2
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        mean_sq = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD
        rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
        dt = src.dtype.element_ty
        # HF rounds the normalized value to the model dtype, then multiplies by the weight there.
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        n1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        n1, n2 = x1, x2
    c1, c2, s1, s2 = rope_table_halves(cos_row, sin_row, offs, mask, HD)
    # rotate_half(x) = cat(-x2, x1): out1 = x1*c1 - x2*s1, out2 = x2*c2 + x1*s2.
    return n1 * c1 - n2 * s1, n2 * c2 + n1 * s2


@triton.jit
def _qk_norm_rope_kv_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr,
                            k_cache_ptr, v_cache_ptr, stride_qkv, stride_cos, stride_sin,
                            stride_q_out_t, stride_q_out_h, stride_kc_h, stride_kc_s,
                            stride_vc_h, stride_vc_s, n_heads, n_kv, eps,
                            HD: tl.constexpr, HALF_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                            NORM: tl.constexpr = True):
    """Program (row, head): heads [0, nh) are q heads, [nh, nh + nkv) the k/v heads (NORM off:
    the norm weight pointers are never read)."""
    pdl_wait(PDL)
    row, head, offs, mask, pos, cos_row, sin_row = rope_head_program(pos_ptr, cos_ptr, sin_ptr, stride_cos,
                                                                     stride_sin, HD, HALF_BLOCK)
    HALF: tl.constexpr = HD // 2
    # q heads then k heads are adjacent in qkv: head h (q or k) starts at column h*hd.
    src = qkv_ptr + row * stride_qkv + head * HD
    if head < n_heads:
        o1, o2 = _norm_rope(src, q_w_ptr, cos_row, sin_row, eps, offs, mask, HD, NORM)
        dst = q_out_ptr + row * stride_q_out_t + head * stride_q_out_h
        tl.store(dst + offs, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, o2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = (head - n_heads).to(tl.int64)
        o1, o2 = _norm_rope(src, k_w_ptr, cos_row, sin_row, eps, offs, mask, HD, NORM)
        k_dst = k_cache_ptr + kv_head * stride_kc_h + pos * stride_kc_s
        tl.store(k_dst + offs, o1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF + offs, o2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        # v is copied as projected (no norm, no rope).
        v_src = src + n_kv * HD
        v_dst = v_cache_ptr + kv_head * stride_vc_h + pos * stride_vc_s
        tl.store(v_dst + offs, tl.load(v_src + offs, mask=mask), mask=mask)
        tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs, mask=mask), mask=mask)


def _check(qkv, norms, cos, sin, positions, k_cache, v_cache, n_heads, n_kv):
    """Shapes, devices and dtypes; `norms` the q/k norm weights (empty for the no-norm kernel)."""
    t = qkv.shape[0]
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must both be [S_tab, head_dim]")
    hd = cos.shape[1]
    if hd % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {hd}")
    if qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * n_kv) * hd:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [t, (n_heads + 2*n_kv)*head_dim] "
                         f"with n_heads={n_heads}, n_kv={n_kv}, head_dim={hd}")
    if any(w.shape != (hd,) for w in norms):
        raise ValueError(f"q_norm_w / k_norm_w must be [head_dim={hd}] (cos/sin's width)")
    check_positions(positions, t)
    check_kv_caches(k_cache, v_cache, n_kv, hd)
    check_tensors(qkv, *norms, cos, sin, positions, k_cache, v_cache)
    check_dtype(qkv, "qkv")
    named = list(zip(("q_norm_w", "k_norm_w"), norms)) + [("cos", cos), ("sin", sin), ("k_cache", k_cache),
                                                         ("v_cache", v_cache)]
    for name, a in named:
        if a.dtype != qkv.dtype:
            raise TypeError(f"{name} is {a.dtype}; everything must be in the model dtype {qkv.dtype}")
        check_last_contiguous(a, name)
    check_last_contiguous(qkv, "qkv")


def qk_norm_rope_kv_write(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                          eps: float) -> torch.Tensor:
    """Split the fused projection, q/k RMSNorm, RoPE, KV-cache write; returns rotated q.

    qkv `[t, (nh + 2*nkv)*hd]`; q_norm_w, k_norm_w `[hd]`; cos, sin `[S_tab, hd]` (model dtype,
    YaRN mscale included); positions `[t]` int64 on the device, each in [0, min(S, S_tab));
    k_cache, v_cache `[nkv, S, hd]` (e.g. views `kv[0]`, `kv[1]` of the engine's cache), written
    in place at `[:, positions[i]]` (rotated k, raw v). Returns q `[t, nh, hd]` (rotated).
    head_dim: any even size (a non-power-of-two half is masked). Everything in one dtype.
    """
    _check(qkv, (q_norm_w, k_norm_w), cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    return _launch(qkv, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, eps, True)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """`qk_norm_rope_kv_write` without the q/k norm (LLaMA): split, RoPE, KV-cache write; returns
    rotated q `[t, nh, hd]`, hd = cos's width. The rotated values are the normed variant's
    arithmetic on the projected values (one rounding from float32)."""
    _check(qkv, (), cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    # the norm weight pointers are never read with NORM off: qkv stands in for them
    return _launch(qkv, qkv, qkv, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, 0.0, False)


def _launch(qkv, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, eps, norm):
    t, hd = qkv.shape[0], cos.shape[1]
    q = torch.empty((t, n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _qk_norm_rope_kv_kernel[(t, n_heads + n_kv)](
        qkv, q_norm_w, k_norm_w, cos, sin, positions, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        n_heads, n_kv, float(eps), HD=hd, HALF_BLOCK=next_pow2(hd // 2), num_warps=1, NORM=norm,
        **pdl_args(qkv),
    )
    return q


# --------------------------------------------------------------------------- the projection's epilogue


@triton.jit
def _heads_norm_rope(x1, x2, w_ptr, c1, c2, s1, s2, eps, offs, dt, HD: tl.constexpr, NORM: tl.constexpr):
    """`_norm_rope` for BLOCK_M rows of one head at once: halves `x1, x2 [BLOCK_M, HD/2]` float32
    (the projection's values, already rounded to the model dtype `dt`), cos/sin halves gathered
    by each row's position. Returns the rotated halves in float32 (not yet rounded)."""
    HALF: tl.constexpr = HD // 2
    if NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD
        rstd = (1.0 / tl.sqrt_rn(mean_sq + eps))[:, None]
        w1 = tl.load(w_ptr + offs).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)[None, :]
        n1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    else:
        n1, n2 = x1, x2
    return n1 * c1 - n2 * s1, n2 * c2 + n1 * s2


@triton.jit
def qkv_rope_epilogue(acc, ws_ptr, cnt_ptr, offs_m, m_mask, M, N, SPLIT_K, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                      pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_qo,
                      stride_kc_h, stride_kc_s, stride_vc_h, stride_vc_s, n_heads, n_kv, eps,
                      HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr):
    """The fused q/k/v projection's epilogue (dense_linear's ROPE): a program's float32 partial
    `acc [BLOCK_M, BLOCK_N]` of n tile `program_id(0)` goes to `ws [SPLIT_K, M, N]`; the last of a
    head's HD / BLOCK_N tiles x SPLIT_K programs to arrive sums them in split order (dense_linear's
    bits), rounds to the model dtype (the projection's output) and does what
    `qk_norm_rope_kv_write` does for that head and those rows: q/k norm (NORM) + RoPE, q to q_out,
    k and v into the caches at each row's position. The same roundings; the norm's float32 sum of
    squares runs over a [rows, hd/2] tile here, so on a GPU its order (not its inputs) may differ
    from the rope kernel's by a last ulp of the statistic, as the twin's does. A row's result
    depends on its own values and position only (one row of each tile reduction)."""
    HALF: tl.constexpr = HD // 2
    TILES: tl.constexpr = HD // BLOCK_N
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(ws_ptr + tl.program_id(1) * M * N + offs_m[:, None] * N + cols[None, :], acc, mask=m_mask[:, None])
    tl.debug_barrier()  # the partial is stored before one thread announces it
    head = tl.program_id(0) // TILES
    group = tl.program_id(2) * (N // HD) + head
    arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == TILES * SPLIT_K - 1:
        offs = tl.arange(0, HALF)
        dt = q_out_ptr.dtype.element_ty
        src = ws_ptr + offs_m[:, None] * N + head * HD + offs[None, :]
        x1 = tl.zeros((BLOCK_M, HALF), tl.float32)
        x2 = tl.zeros((BLOCK_M, HALF), tl.float32)
        for s in range(SPLIT_K):  # split order, as dense_linear's reduction: the projection's bits
            x1 += tl.load(src + s * M * N, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
            x2 += tl.load(src + s * M * N + HALF, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        x1 = x1.to(dt).to(tl.float32)
        x2 = x2.to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        cos_row = cos_ptr + pos[:, None] * stride_cos + offs[None, :]
        sin_row = sin_ptr + pos[:, None] * stride_sin + offs[None, :]
        c1 = tl.load(cos_row, mask=m_mask[:, None], other=0.0).to(tl.float32)
        c2 = tl.load(cos_row + HALF, mask=m_mask[:, None], other=0.0).to(tl.float32)
        s1 = tl.load(sin_row, mask=m_mask[:, None], other=0.0).to(tl.float32)
        s2 = tl.load(sin_row + HALF, mask=m_mask[:, None], other=0.0).to(tl.float32)
        rows = offs_m.to(tl.int64)[:, None]
        if head < n_heads:
            o1, o2 = _heads_norm_rope(x1, x2, q_w_ptr, c1, c2, s1, s2, eps, offs, dt, HD, NORM)
            dst = q_out_ptr + rows * stride_qo + head * HD + offs[None, :]
            tl.store(dst, o1.to(dt), mask=m_mask[:, None])
            tl.store(dst + HALF, o2.to(dt), mask=m_mask[:, None])
        elif head < n_heads + n_kv:
            o1, o2 = _heads_norm_rope(x1, x2, k_w_ptr, c1, c2, s1, s2, eps, offs, dt, HD, NORM)
            dst = k_cache_ptr + (head - n_heads).to(tl.int64) * stride_kc_h + pos[:, None] * stride_kc_s + offs[None, :]
            tl.store(dst, o1.to(dt), mask=m_mask[:, None])
            tl.store(dst + HALF, o2.to(dt), mask=m_mask[:, None])
        else:  # v as projected
            dst = v_cache_ptr + (head - n_heads - n_kv).to(tl.int64) * stride_vc_h + pos[:, None] * stride_vc_s \
                + offs[None, :]
            tl.store(dst, x1.to(dt), mask=m_mask[:, None])
            tl.store(dst + HALF, x2.to(dt), mask=m_mask[:, None])
        tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")
