"""Qwen3.5's fused elementwise work around its mixers, each kernel beside its plain-torch twin
(`*_ref`, the engine's torch formulas, same signature).

Gated attention (`full_attention` layers):

- `gated_qk_norm_rope_kv_write(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache,
  n_heads, n_kv, eps) -> q`: from the fused projection `qgkv [t, (2*nh + 2*nkv)*hd]` (per query
  head its query and output gate side by side, `[q | gate]` of hd each, then k, then v): the
  zero-centred per-head RMSNorm of q and k, rope on the first `r = cos.shape[-1]` dims of each
  head (partial rotary, rotate-half over those r dims, cos/sin rows gathered by position), the
  K/V write into the cache at `positions`, and q returned `[t, nh, hd]`. The gate stays in
  `qgkv`: `output_gate` reads it there.
- `output_gate(out, qgkv, n_heads) -> out * sigmoid(gate)` `[t, nh*hd]`, the gate read in place.

Gated DeltaNet (`linear_attention` layers):

- `gdn_gates(ba, a_neg, dt_bias, ...) -> (g, beta)`: `beta = sigmoid(b)` (in the model dtype, then
  float32) and `g = a_neg * softplus(a + dt_bias)` (float32) from the projection's `b | a`
  columns; on request in the same launch the step's rollback record: the conv inputs into the
  state's ring at `ring_idx`, and in replay mode the conv outputs, g and beta too.
- `gdn_conv_gates(window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs_ring, replay_rings,
  final_window) -> (conv_out, g, beta)`: `deltanet.causal_conv_silu` and `gdn_gates` in one
  launch (the step's one-row decode is launch-bound), the same jit code so the same bits, and on
  request the conv window after the last row into `final_window`. Grid (row, conv block + 1):
  the extra program of a row computes its gates.
- `gated_rms_norm(core, z, w, eps) -> [t, Hv*dv]`: the recurrence output `core [t, Hv, dv]`
  (float32) rounded to the model dtype, RMSNorm over each value head, `* w` in the model dtype,
  `* silu(z)` in float32, one rounding (HF `Qwen3_5RMSNormGated`).

Numerics: every kernel rounds where its twin rounds (to the model dtype after the norm's weight
multiply, after each rope product and the rope sum, after sigmoid, ...), so in float32 and bf16
what differs is only the float32 arithmetic itself: a sum of squares in another order, Triton's
exp / log / divide (fast-math on the GPU) against torch's, FMA contraction on the GPU. A float32
ulp or so, which rarely survives a rounding to bf16; tests/kernels/test_qwen35.py states the
tolerances.

Row invariance (what keeps fixed-width steps bit-exact): one program per (row, head) or per (row,
column block); block sizes derive from head dims and head counts only, never from t; positions
and ring indices are read on the device (CUDA-graph capturable; they must be in range: nothing
checks that on the device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_dtype, check_kv_caches, check_last_contiguous, check_positions, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from .deltanet import BLOCK_C, _check_live, _conv_silu_cols, causal_conv_silu_ref
from .norm import rms_norm_1p_ref
from .norm_ref import gated_rms_norm_heads
from .qwen35_ref import gdn_gates_body, window_after
from .rope import _rope_ref

SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default: above it softplus(x) = x
BLOCK_COLS = 1024  # columns per program of the elementwise kernels


# --------------------------------------------------------------------------- gated attention


@triton.jit
def _gated_qk_kernel(qgkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr,
                     v_cache_ptr, stride_qgkv, stride_cos, stride_sin, stride_q_t, stride_q_h,
                     stride_kc_h, stride_kc_s, stride_vc_h, stride_vc_s, n_heads, n_kv, eps,
                     HD: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, head): heads [0, nh) are query heads, [nh, nh + nkv) the k/v heads."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    HALF: tl.constexpr = R // 2
    dt = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row).to(tl.int64)
    base = qgkv_ptr + row * stride_qgkv
    is_q = head < n_heads
    kv_head = tl.maximum(head - n_heads, 0).to(tl.int64)
    # query head h at column h*2hd ([q | gate]); key head j at 2*nh*hd + j*hd
    if is_q:
        src = base + head * 2 * HD
        w_ptr = qw_ptr
    else:
        src = base + 2 * n_heads * HD + kv_head * HD
        w_ptr = kw_ptr
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / HD + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    n = ((x * rstd) * w).to(dt).to(tl.float32)  # zero-centred norm: float32, one rounding
    # rotate-half over the first R dims: element i pairs with i + R/2 (i < R/2) or i - R/2
    rot = offs < R
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0)
    n_p = ((xp * rstd) * wp).to(dt).to(tl.float32)  # the partner's normed value, same bits as n there
    c = tl.load(cos_ptr + pos * stride_cos + offs, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + offs, mask=rot, other=0.0).to(tl.float32)
    # x*cos + rotate_half(x)*sin in the model dtype: each product rounded, then the sum
    a = (n * c).to(dt).to(tl.float32)
    b = (n_p * s).to(dt).to(tl.float32)
    y = tl.where(rot, tl.where(first, a - b, a + b), n).to(dt)
    if is_q:
        tl.store(q_out_ptr + row * stride_q_t + head * stride_q_h + offs, y, mask=mask)
    else:
        tl.store(k_cache_ptr + kv_head * stride_kc_h + pos * stride_kc_s + offs, y, mask=mask)
        v = tl.load(base + 2 * n_heads * HD + n_kv * HD + kv_head * HD + offs, mask=mask)
        tl.store(v_cache_ptr + kv_head * stride_vc_h + pos * stride_vc_s + offs, v, mask=mask)


def _check_gated_qk(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, n_heads, n_kv):
    t, hd = qgkv.shape[0], q_norm.shape[0]
    if qgkv.dim() != 2 or qgkv.shape[1] != (2 * n_heads + 2 * n_kv) * hd:
        raise ValueError(f"qgkv {tuple(qgkv.shape)} is not [t, (2*n_heads + 2*n_kv)*head_dim] "
                         f"with n_heads={n_heads}, n_kv={n_kv}, head_dim={hd}")
    if k_norm.shape != (hd,) or q_norm.dtype != torch.float32 or k_norm.dtype != torch.float32:
        raise ValueError("q_norm / k_norm must be float32 [head_dim] (1 + w)")
    r = cos.shape[-1]
    if cos.dim() != 2 or sin.shape != cos.shape or r % 2 or not 0 < r <= hd:
        raise ValueError(f"cos/sin must be [S_tab, r] with r even, 0 < r <= {hd}; got {tuple(cos.shape)}")
    check_positions(positions, t)
    check_kv_caches(k_cache, v_cache, n_kv, hd)
    check_tensors(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache)
    check_dtype(qgkv, "qgkv")
    for name, a in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.dtype != qgkv.dtype:
            raise TypeError(f"{name} is {a.dtype}; it must be in the model dtype {qgkv.dtype}")
    for name, a in (("qgkv", qgkv), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_contiguous(a, name)
    if not (q_norm.is_contiguous() and k_norm.is_contiguous()):
        raise ValueError("q_norm / k_norm must be contiguous")


def gated_qk_norm_rope_kv_write(qgkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                                eps: float) -> torch.Tensor:
    """Gated attention's prep in one launch; returns q `[t, nh, hd]` (normed, rope'd).

    qgkv `[t, (2*nh + 2*nkv)*hd]` (rows may be strided); q_norm, k_norm `[hd]` float32 `1 + w`;
    cos, sin `[S_tab, r]` (model dtype, r even <= hd: the rotary dims); positions `[t]` int on the
    device, each in [0, min(S, S_tab)); k_cache, v_cache `[nkv, S, hd]`, written in place at
    `[:, positions[i]]` (normed rope'd k, raw v). Any head dim (a non-power-of-two one is masked).
    """
    _check_gated_qk(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    t, hd = qgkv.shape[0], q_norm.shape[0]
    q = torch.empty((t, n_heads, hd), dtype=qgkv.dtype, device=qgkv.device)
    if t == 0:
        return q
    block = next_pow2(hd)
    _gated_qk_kernel[(t, n_heads + n_kv)](
        qgkv, q_norm, k_norm, cos, sin, positions, q, k_cache, v_cache,
        qgkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        n_heads, n_kv, float(eps), HD=hd, R=cos.shape[-1], BLOCK=block, num_warps=1 if block <= 128 else 2, **pdl_args(qgkv),
    )
    return q


@triton.jit
def _output_gate_kernel(out_ptr, qgkv_ptr, res_ptr, width, stride_out, stride_qgkv, stride_res,
                        HD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    head = offs // HD
    gate_col = head * 2 * HD + HD + (offs - head * HD)  # head h's gate follows its query
    dt = res_ptr.dtype.element_ty
    o = tl.load(out_ptr + row * stride_out + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(qgkv_ptr + row * stride_qgkv + gate_col, mask=mask, other=0.0).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch.sigmoid rounds to the model dtype
    tl.store(res_ptr + row * stride_res + offs, (o * sig).to(dt), mask=mask)


def output_gate(out: torch.Tensor, qgkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`out [t, nh*hd]` (attention output) times `sigmoid(gate)`, the gate read from the fused
    projection `qgkv [t, (2*nh + 2*nkv)*hd]` in place -> `[t, nh*hd]` (model dtype). Rows of
    either input may be strided."""
    check_tensors(out, qgkv)
    check_dtype(out, "out")
    check_last_contiguous(out, "out")
    check_last_contiguous(qgkv, "qgkv")
    t, width = out.shape
    if width % n_heads or qgkv.shape[0] != t or qgkv.shape[1] < 2 * width or qgkv.dtype != out.dtype:
        raise ValueError(f"out {tuple(out.shape)} and qgkv {tuple(qgkv.shape)} {qgkv.dtype} do not fit "
                         f"{n_heads} heads")
    res = torch.empty((t, width), dtype=out.dtype, device=out.device)
    if t == 0:
        return res
    _output_gate_kernel[(t, triton.cdiv(width, BLOCK_COLS))](
        out, qgkv, res, width, out.stride(0), qgkv.stride(0), res.stride(0),
        HD=width // n_heads, BLOCK=BLOCK_COLS, num_warps=4, **pdl_args(out))
    return res


# --------------------------------------------------------------------------- Gated DeltaNet


@triton.jit
def _gdn_gates_row(ba_ptr, a_neg_ptr, dt_bias_ptr, g_ptr, beta_ptr, g_ring_ptr, beta_ring_ptr, row, slot, hv,
                   stride_ba, stride_g, stride_beta, stride_g_ring, stride_beta_ring, threshold,
                   REPLAY: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row `row`'s gates -> g, beta (and with REPLAY into their rings at `slot`). The code of
    `gdn_gates` and of the fused `gdn_conv_gates` (one code, one set of bits)."""
    h = tl.arange(0, BLOCK_H)
    hmask = h < hv
    dt = ba_ptr.dtype.element_ty
    b = tl.load(ba_ptr + row * stride_ba + h, mask=hmask, other=0.0).to(tl.float32)
    a = tl.load(ba_ptr + row * stride_ba + hv + h, mask=hmask, other=0.0).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-b))).to(dt).to(tl.float32)  # sigmoid in the model dtype, then float
    xa = a + tl.load(dt_bias_ptr + h, mask=hmask, other=0.0)
    # softplus = log1p(exp(xa)); log1p as log(u) * e / (u - 1) (exact where u rounds, Goldberg)
    e = tl.exp(xa)
    u = 1.0 + e
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    sp = tl.where(xa > threshold, xa, tl.where(u == 1.0, e, tl.log(u) * (e / d)))
    g = tl.load(a_neg_ptr + h, mask=hmask, other=0.0) * sp
    tl.store(g_ptr + row * stride_g + h, g, mask=hmask)
    tl.store(beta_ptr + row * stride_beta + h, beta, mask=hmask)
    if REPLAY:
        tl.store(g_ring_ptr + slot * stride_g_ring + h, g, mask=hmask)
        tl.store(beta_ring_ptr + slot * stride_beta_ring + h, beta, mask=hmask)


@triton.jit
def _gdn_gates_kernel(ba_ptr, a_neg_ptr, dt_bias_ptr, g_ptr, beta_ptr, idx_ptr, mixed_ptr, xs_ptr,
                      conv_ptr, qkv_ring_ptr, g_ring_ptr, beta_ring_ptr, hv, C, stride_ba,
                      stride_g, stride_beta, stride_mixed, stride_xs, stride_conv, stride_qkv_ring,
                      stride_g_ring, stride_beta_ring, threshold, RECORD: tl.constexpr,
                      REPLAY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, column block): block 0 also computes the row's gates."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    slot = tl.load(idx_ptr + row).to(tl.int64) if RECORD else row  # the row's ring slot
    if RECORD:
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < C
        x = tl.load(mixed_ptr + row * stride_mixed + cols, mask=cmask)
        tl.store(xs_ptr + slot * stride_xs + cols, x, mask=cmask)
        if REPLAY:
            y = tl.load(conv_ptr + row * stride_conv + cols, mask=cmask)
            tl.store(qkv_ring_ptr + slot * stride_qkv_ring + cols, y, mask=cmask)
    if blk == 0:
        _gdn_gates_row(ba_ptr, a_neg_ptr, dt_bias_ptr, g_ptr, beta_ptr, g_ring_ptr, beta_ring_ptr, row, slot, hv,
                       stride_ba, stride_g, stride_beta, stride_g_ring, stride_beta_ring, threshold, REPLAY, BLOCK_H)


def _check_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay):
    check_tensors(ba, a_neg, dt_bias)
    check_dtype(ba, "ba")
    check_last_contiguous(ba, "ba")
    t, hv = ba.shape[0], a_neg.shape[0]
    if ba.dim() != 2 or ba.shape[1] != 2 * hv or dt_bias.shape != (hv,):
        raise ValueError(f"ba {tuple(ba.shape)} is not [t, 2*Hv] for a_neg / dt_bias [{hv}]")
    if a_neg.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        raise ValueError("a_neg and dt_bias must be float32")
    if ring_idx is None:
        if xs_ring is not None or mixed is not None or replay is not None:
            raise ValueError("a record needs ring_idx")
        return
    if xs_ring is None or mixed is None or ring_idx.shape != (t,) or mixed.shape[0] != t:
        raise ValueError("a record needs ring_idx [t], xs_ring [ring, C] and mixed [t, C]")
    rows = [("xs_ring", xs_ring), ("mixed", mixed)]
    if replay is not None:
        qkv_ring, conv, g_ring, beta_ring = replay
        rows += [("qkv_ring", qkv_ring), ("conv", conv)]
        for name, r in (("g_ring", g_ring), ("beta_ring", beta_ring)):
            if r.dim() != 2 or r.shape[1] != hv or r.dtype != torch.float32 or r.stride(-1) != 1:
                raise ValueError(f"{name} must be float32 [ring, {hv}] with contiguous heads")
    c = mixed.shape[1]
    for name, r in rows:
        check_last_contiguous(r, name)
        if r.dim() != 2 or r.shape[1] != c or r.dtype != mixed.dtype:
            raise ValueError(f"{name} {tuple(r.shape)} {r.dtype} does not fit mixed {tuple(mixed.shape)} {mixed.dtype}")
    check_tensors(ba, ring_idx, *(r for _, r in rows))


def gdn_gates(ba: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
              ring_idx: torch.Tensor | None = None, xs_ring: torch.Tensor | None = None,
              mixed: torch.Tensor | None = None, replay: tuple | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeltaNet's gates from `ba [t, 2*Hv]` (the projection's `b | a` columns, model dtype;
    rows may be strided), `a_neg = -exp(A_log)` and `dt_bias` `[Hv]` float32 -> g, beta `[t, Hv]`
    float32 (`g = a_neg * softplus(a + dt_bias)`, `beta = sigmoid(b)`).

    With `ring_idx [t]` (device ints) it also records the rows for a rollback, in the same
    launch: `xs_ring[ring_idx[r]] = mixed[r]` (`mixed [t, C]` the conv inputs, `xs_ring [ring,
    C]`), and with `replay = (qkv_ring, conv, g_ring, beta_ring)` the conv outputs, g and beta
    into their rings too (as `index_copy_` would)."""
    _check_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay)
    t, hv = ba.shape[0], a_neg.shape[0]
    g = torch.empty((t, hv), dtype=torch.float32, device=ba.device)
    beta = torch.empty((t, hv), dtype=torch.float32, device=ba.device)
    if t == 0:
        return g, beta
    record = ring_idx is not None
    c = mixed.shape[1] if record else 0
    qkv_ring, conv, g_ring, beta_ring = replay if replay is not None else (mixed, mixed, g, beta)
    idx = ring_idx if record else g
    mixed_, xs = (mixed, xs_ring) if record else (ba, ba)
    qkv_ring_, conv_ = (qkv_ring, conv) if record else (ba, ba)
    _gdn_gates_kernel[(t, triton.cdiv(c, BLOCK_COLS) if record else 1)](
        ba, a_neg, dt_bias, g, beta, idx, mixed_, xs, conv_, qkv_ring_, g_ring, beta_ring, hv, c,
        ba.stride(0), g.stride(0), beta.stride(0), mixed_.stride(0), xs.stride(0), conv_.stride(0),
        qkv_ring_.stride(0), g_ring.stride(0), beta_ring.stride(0), SOFTPLUS_THRESHOLD,
        RECORD=record, REPLAY=replay is not None, BLOCK_H=next_pow2(hv), BLOCK=BLOCK_COLS, num_warps=4, **pdl_args(ba))
    return g, beta


@triton.jit
def _gdn_conv_gates_kernel(win_ptr, x_ptr, w_ptr, out_ptr, fw_ptr, ba_ptr, a_neg_ptr, dt_bias_ptr, g_ptr, beta_ptr,
                           idx_ptr, xs_ptr, qkv_ring_ptr, g_ring_ptr, beta_ring_ptr, hv, C, stride_win, stride_x,
                           stride_out, stride_fw, stride_ba, stride_g, stride_beta, stride_xs, stride_qkv_ring,
                           stride_g_ring, stride_beta_ring, threshold, K: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_H: tl.constexpr, RECORD: tl.constexpr, REPLAY: tl.constexpr,
                           FINAL: tl.constexpr, PDL: tl.constexpr = False, live_ptr=None, LIVE: tl.constexpr = False):
    """Program (row, block): blocks [0, n) each run the conv over BLOCK columns of the row (and
    record its inputs / outputs, and for the last row the final window, from what they loaded);
    block n (the last) computes the row's gates, beside them rather than after a conv block."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    slot = tl.load(idx_ptr + row).to(tl.int64) if RECORD else row  # the row's ring slot
    if blk == tl.num_programs(1) - 1:
        _gdn_gates_row(ba_ptr, a_neg_ptr, dt_bias_ptr, g_ptr, beta_ptr, g_ring_ptr, beta_ring_ptr, row, slot, hv,
                       stride_ba, stride_g, stride_beta, stride_g_ring, stride_beta_ring, threshold, REPLAY, BLOCK_H)
    else:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < C
        n = tl.num_programs(0)
        if LIVE:  # the rows after the live ones are padding: the window after the last live row
            n = tl.minimum(n, tl.load(live_ptr))
        last = row == n - 1  # its taps 1..K-1 are the window after the step
        y, x = _conv_silu_cols(win_ptr, x_ptr, w_ptr, out_ptr, fw_ptr, row, offs, mask, mask & last, stride_win,
                               stride_x, stride_fw, K, BLOCK, FINAL)
        tl.store(out_ptr + row * stride_out + offs, y, mask=mask)
        if RECORD:
            tl.store(xs_ptr + slot * stride_xs + offs, x, mask=mask)
            if REPLAY:
                tl.store(qkv_ring_ptr + slot * stride_qkv_ring + offs, y, mask=mask)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b intersect (a conservative test on their byte ranges)."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(x):
        lo = x.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_conv_gates(window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs_ring, replay_rings, final_window):
    check_tensors(window, mixed, conv_w, ba)
    check_dtype(mixed, "mixed")
    if mixed.dim() != 2:
        raise ValueError(f"mixed {tuple(mixed.shape)} is not [t, C]")
    t, c = mixed.shape
    k = conv_w.shape[1] if conv_w.dim() == 2 else 0
    if conv_w.shape != (c, k) or k < 1 or conv_w.dtype != torch.float32 or not conv_w.is_contiguous():
        raise ValueError(f"conv_w {tuple(conv_w.shape)} {conv_w.dtype} is not a contiguous float32 [C={c}, K]")
    if window.shape != (k - 1, c) or window.dtype != mixed.dtype:
        raise ValueError(f"window {tuple(window.shape)} {window.dtype} is not [K-1={k - 1}, C={c}] {mixed.dtype}")
    for name, x in (("window", window), ("mixed", mixed)):
        check_last_contiguous(x, name)
    if ba.dim() != 2 or ba.shape[0] != t:
        raise ValueError(f"ba {tuple(ba.shape)} is not [t={t}, 2*Hv]")
    if replay_rings is not None and len(replay_rings) != 3:
        raise ValueError("replay_rings must be (qkv_ring, g_ring, beta_ring)")
    # the gates' checks, the conv output standing in for the replay's conv rows (same shape and dtype)
    replay = None if replay_rings is None else (replay_rings[0], mixed, replay_rings[1], replay_rings[2])
    _check_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, None if ring_idx is None else mixed, replay)
    if final_window is not None:
        check_tensors(mixed, final_window)
        check_last_contiguous(final_window, "final_window")
        if final_window.shape != (k - 1, c) or final_window.dtype != mixed.dtype:
            raise ValueError(f"final_window {tuple(final_window.shape)} {final_window.dtype} is not "
                             f"[K-1={k - 1}, C={c}] {mixed.dtype}")
        if _overlap(final_window, window):
            raise ValueError("final_window must not overlap window (the step's rows read window while its last "
                             "row writes final_window)")


def gdn_conv_gates(window: torch.Tensor, mixed: torch.Tensor, conv_w: torch.Tensor, ba: torch.Tensor,
                   a_neg: torch.Tensor, dt_bias: torch.Tensor, ring_idx: torch.Tensor | None = None,
                   xs_ring: torch.Tensor | None = None, replay_rings: tuple | None = None,
                   final_window: torch.Tensor | None = None, live: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DeltaNet step's conv and gates in one launch -> (conv_out `[t, C]` model dtype, g, beta
    `[t, Hv]` float32): exactly `causal_conv_silu(window, mixed, conv_w)` then `gdn_gates(ba,
    a_neg, dt_bias, ring_idx, xs_ring, mixed, (qkv_ring, conv_out, g_ring, beta_ring))`, bit for
    bit (the same jit code: `deltanet._conv_silu_cols`, `_gdn_gates_row`).

    `window [K-1, C]`, `mixed [t, C]` (the conv inputs, model dtype; rows may be strided),
    `conv_w [C, K]` float32, `ba [t, 2*Hv]`, `a_neg`, `dt_bias [Hv]` float32. With `ring_idx [t]`
    the record as `gdn_gates` writes it, `replay_rings = (qkv_ring, g_ring, beta_ring)` taking the
    conv outputs, g and beta. `final_window [K-1, C]` (model dtype, not overlapping `window`),
    when given, receives the conv window after the last row: the last K-1 rows of
    `cat([window, mixed])` (for t < K-1 partly window rows), written by the last row's programs
    from the taps they load. With `live` (int32 `[1]` on the device, 1 <= live), the rows from
    `min(t, live)` on are a fixed step's padding and `final_window` is the window after the last
    live row (every row's conv, gates and record are computed as without it)."""
    _check_conv_gates(window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs_ring, replay_rings, final_window)
    _check_live(live, mixed.device)
    t, c = mixed.shape
    k, hv = conv_w.shape[1], a_neg.shape[0]
    conv = torch.empty((t, c), dtype=mixed.dtype, device=mixed.device)
    g = torch.empty((t, hv), dtype=torch.float32, device=ba.device)
    beta = torch.empty((t, hv), dtype=torch.float32, device=ba.device)
    if t == 0:
        if final_window is not None:
            final_window.copy_(window)
        return conv, g, beta
    record, replay = ring_idx is not None, replay_rings is not None
    qkv_ring, g_ring, beta_ring = replay_rings if replay else (conv, g, beta)
    idx, xs = (ring_idx, xs_ring) if record else (g, conv)
    fw = final_window if final_window is not None else conv
    _gdn_conv_gates_kernel[(t, triton.cdiv(c, BLOCK_C) + 1)](
        window, mixed, conv_w, conv, fw, ba, a_neg, dt_bias, g, beta, idx, xs, qkv_ring, g_ring, beta_ring, hv, c,
        window.stride(0), mixed.stride(0), conv.stride(0), fw.stride(0), ba.stride(0), g.stride(0), beta.stride(0),
        xs.stride(0), qkv_ring.stride(0), g_ring.stride(0), beta_ring.stride(0), SOFTPLUS_THRESHOLD,
        K=k, BLOCK=BLOCK_C, BLOCK_H=next_pow2(hv), RECORD=record, REPLAY=replay,
        FINAL=final_window is not None, live_ptr=g if live is None else live, LIVE=live is not None,
        num_warps=4, **pdl_args(window))
    return conv, g, beta


@triton.jit
def _gated_norm_kernel(core_ptr, z_ptr, w_ptr, out_ptr, stride_core_t, stride_core_h, stride_z,
                       stride_out, eps, DV: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, value head)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < DV
    dt = out_ptr.dtype.element_ty
    x = tl.load(core_ptr + row * stride_core_t + head * stride_core_h + offs, mask=mask, other=0.0)
    x = x.to(dt).to(tl.float32)  # the twin casts core to the model dtype first
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / DV + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # w * normed, in the model dtype
    z = tl.load(z_ptr + row * stride_z + head * DV + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + head * DV + offs, (y * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mask)


def gated_rms_norm(core: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `Qwen3_5RMSNormGated` over each value head: `core [t, Hv, dv]` float32 (the recurrence's
    output; cast to z's dtype first), `z [t, Hv*dv]` (model dtype, rows may be strided), `w [dv]`
    (model dtype) -> `[t, Hv*dv]` in z's dtype."""
    check_tensors(core, z, w)
    check_dtype(z, "z")
    check_last_contiguous(core, "core")
    check_last_contiguous(z, "z")
    t, hv, dv = core.shape
    if core.dtype != torch.float32 or z.shape != (t, hv * dv) or w.shape != (dv,) or w.dtype != z.dtype:
        raise ValueError(f"core {tuple(core.shape)} {core.dtype}, z {tuple(z.shape)}, w {tuple(w.shape)} {w.dtype} "
                         "do not fit (core float32 [t, Hv, dv], z [t, Hv*dv], w [dv] in z's dtype)")
    out = torch.empty((t, hv * dv), dtype=z.dtype, device=z.device)
    if t == 0:
        return out
    block = next_pow2(dv)
    _gated_norm_kernel[(t, hv)](core, z, w, out, core.stride(0), core.stride(1), z.stride(0), out.stride(0),
                                float(eps), DV=dv, BLOCK=block, num_warps=1 if block <= 128 else 2, **pdl_args(core))
    return out


# ----------------------------------------------------------------------------- references


def _partial_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return _rope_ref(x, cos, sin)
    return torch.cat([_rope_ref(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def gated_qk_norm_rope_kv_write_ref(qgkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                                    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                                    eps: float) -> torch.Tensor:
    """Plain torch twin of `gated_qk_norm_rope_kv_write` (the engine's torch formulas)."""
    t, hd = qgkv.shape[0], q_norm.shape[0]
    qg, k, v = qgkv.split([2 * n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
    c, s = cos[positions], sin[positions]
    q = _partial_rope_ref(rms_norm_1p_ref(qg.view(t, n_heads, 2 * hd)[..., :hd], q_norm, eps), c, s)
    k = _partial_rope_ref(rms_norm_1p_ref(k.view(t, n_kv, hd), k_norm, eps), c, s)
    k_cache.index_copy_(1, positions, k.transpose(0, 1))
    v_cache.index_copy_(1, positions, v.reshape(t, n_kv, hd).transpose(0, 1))
    return q


def output_gate_ref(out: torch.Tensor, qgkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Plain torch twin of `output_gate`: `out * torch.sigmoid(gate)` in the model dtype."""
    t, width = out.shape
    hd = width // n_heads
    gate = qgkv[:, :2 * width].view(t, n_heads, 2 * hd)[..., hd:].reshape(t, width)
    return out * torch.sigmoid(gate)


def gdn_gates_ref(ba: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
                  ring_idx: torch.Tensor | None = None, xs_ring: torch.Tensor | None = None,
                  mixed: torch.Tensor | None = None, replay: tuple | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch twin of `gdn_gates`: its checks, then the op's one torch body."""
    _check_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay)
    return gdn_gates_body(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay)


def gdn_conv_gates_ref(window: torch.Tensor, mixed: torch.Tensor, conv_w: torch.Tensor, ba: torch.Tensor,
                       a_neg: torch.Tensor, dt_bias: torch.Tensor, ring_idx: torch.Tensor | None = None,
                       xs_ring: torch.Tensor | None = None, replay_rings: tuple | None = None,
                       final_window: torch.Tensor | None = None, live: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch twin of `gdn_conv_gates`: `causal_conv_silu_ref`, then `gdn_gates_ref` with the
    conv output as the replay's conv rows, then the final window as the last K-1 rows of
    `cat([window, mixed])` (of `cat([window, mixed[:live]])` with `live`)."""
    _check_conv_gates(window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs_ring, replay_rings, final_window)
    _check_live(live, mixed.device)
    conv = causal_conv_silu_ref(window, mixed, conv_w)
    replay = None if replay_rings is None else (replay_rings[0], conv, replay_rings[1], replay_rings[2])
    g, beta = gdn_gates_ref(ba, a_neg, dt_bias, ring_idx, xs_ring, None if ring_idx is None else mixed, replay)
    if final_window is not None:
        final_window.copy_(window_after(window, mixed, live))
    return conv, g, beta


def gated_rms_norm_ref(core: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch twin of `gated_rms_norm` (HF Qwen3_5RMSNormGated on `core.to(dtype)`)."""
    return gated_rms_norm_heads(core, z, w, eps)
