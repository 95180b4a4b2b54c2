"""Gated DeltaNet's fixed-width step (Qwen3.5's linear-attention mixer): the causal conv update
and the gated delta-rule recurrence, each beside its plain-torch twin (`*_ref`).

- `causal_conv_silu(window, x, w)`: depthwise causal conv over `x [t, C]` given the kept window
  `[K-1, C]` (the last K-1 conv inputs before the rows), then SiLU. A fixed-order float32 sum over
  the K taps per element, rounded to the model dtype, SiLU in float32, rounded again (the twin
  is the engine's `causal_conv_silu` on `cat([window, x])`).
- `gated_delta_rule(qkv, g, beta, state, n_k_heads, out, final, stash, stash_idx)`: the delta
  rule over the t rows of a step, one row after the other, float32 state `[Hv, dk, dv]`. It reads
  the conv output `qkv [t, 2*Hk*dk + Hv*dv]` (q | k | v, model dtype) and does the rest of the
  per-row preparation itself (float32, q and k L2-normalized, q divided by sqrt(dk), value head h
  reading key head h // (Hv/Hk)), so a recorded step can be re-run from its conv outputs alone.
  Per row:

      S = S * exp(g);  delta = (v - k.S) * beta;  S = S + k (x) delta;  o = q.S

  Writes `out [t, Hv, dv]` (float32), and on request the state after the last row (`final`, may
  be `state` itself: each program reads its tile before writing it) and the state after every
  row into `stash[stash_idx[r]]` (a per-row stash; rollback to any row is then an index).
- `gated_delta_rule_layers(qkv, g, beta, state, n_k_heads, row0, rows, final)`: the same kernel
  over every layer at once (`[L, ...]` inputs and states), its rows read from a ring by
  position % ring: a rollback's replay of the recorded rows in one launch.
- `gated_delta_restore(qkv, g, beta, state, n_k_heads, params, final, window, xs, final_window,
  live)`: a graphed rollback's whole restore in one launch: that replay with `(row0, rows)` read
  on the device, each of its programs also copying a column block of its layer's conv window
  after the kept rows (`ring_window`), and, with `live`, a round that kept its whole window of
  live rows left alone (the step wrote that state).
- `stash_restore(stash, params, width, final, window, xs, final_window)`: the stash mode's
  (the kept rows' last stashed state of every layer, and the conv windows) in one launch.

Row-count invariance (what keeps fixed-width steps bit-exact): the conv is elementwise per row;
the recurrence runs the same per-row code from the state it is given whatever `t` is, so a
one-row step from the state after row r-1 gives row r's output and state bit for bit. `t` is a
runtime argument (not specialized), so a 1-row and a 16-row launch run one compiled kernel. The
output and stash writes are compile-time flags (a run-time `if` split the loop body, so the
compiler could not overlap a row's output reduction with the next row's update): the
layer-batched replay, which writes neither, is a variant of the same per-row code, and the tests
hold it to the step's bits (tests/kernels/test_deltanet.py, the engine's rollback tests). The recurrence is a chain of
dependent rows: grid (L * Hv, dv / BLOCK_V), one program keeps a `[dk, BLOCK_V]` float32 tile of
the state in registers for all t rows.

Numerics against the twins: the same formulas, but Triton's exp / rsqrt / divide (fast-math on
the GPU) and FMA contraction differ from torch's in the last float32 bits, and the recurrence
carries those differences from row to row; tests/kernels/test_deltanet.py states the tolerances.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_dtype, check_last_contiguous, check_tensors, next_pow2
from ._pdl import pdl_args, pdl_wait
from .deltanet_ref import causal_conv_silu_body, delta_rule_row

BLOCK_C = 256  # conv channels per program
# The recurrence's tile, the fastest of an H200 sweep (docs/tuning.md#deltanet-recurrence).
# One warp keeps dk's reductions inside the warp; the 16-row verify is a chain of dependent rows.
BLOCK_V = 16  # value columns of a state tile per recurrence program ([dk, BLOCK_V] float32 in registers)
REC_WARPS = 1  # warps per recurrence program (with BLOCK_V: where dk's reductions run, so the last bits)
# Where row r+1's normalization (and exp(g)) runs: after row r's state update (True), so the
# single warp's in-order issue does not wait on row r+1's loads before updating; or before it.
# The same ops on the same values either way (the same bits); only the schedule differs.
LATE_PREP = True
# How many rows ahead the recurrence loads its inputs (1 or 2): the chain of row updates waits on
# a row's loads when they land later than the row before it finishes. The same ops on the same
# values either way (the same bits); only when the loads are issued differs. Two rows ahead
# measured faster (docs/tuning.md#deltanet-recurrence).
PREFETCH = 2
L2_EPS = 1e-6  # HF / fla l2norm epsilon


# --------------------------------------------------------------------------- conv


@triton.jit
def _conv_silu_cols(win_ptr, x_ptr, w_ptr, out_ptr, fw_ptr, r, offs, mask, fw_mask, stride_win, stride_x,
                    stride_fw, K: tl.constexpr, BLOCK: tl.constexpr, FINAL: tl.constexpr):
    """Row r's conv + SiLU over the columns `offs`: returns (the output in out's dtype, the row's
    own conv input `x[r]`, the last tap). With FINAL, taps 1..K-1 (rows r+1..r+K-1 of
    `[window; x]`, the window after row r) also go to `fw` rows 0..K-2 where `fw_mask`.
    The code of `causal_conv_silu` and of qwen35's fused `gdn_conv_gates` (one code, one set of bits)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        src = r + j  # row of [window; x]
        from_win = src < K - 1
        a = tl.load(win_ptr + src * stride_win + offs, mask=mask & from_win, other=0.0)
        b = tl.load(x_ptr + (src - (K - 1)) * stride_x + offs, mask=mask & (src >= K - 1), other=0.0)
        raw = tl.where(from_win, a, b)
        if FINAL:
            if j > 0:
                tl.store(fw_ptr + (j - 1) * stride_fw + offs, raw, mask=fw_mask)
        val = raw.to(tl.float32)
        wj = tl.load(w_ptr + offs * K + j, mask=mask, other=0.0)
        acc = acc + val * wj
    dt = out_ptr.dtype.element_ty
    y = acc.to(dt).to(tl.float32)  # rounded to the model dtype before SiLU, as the twin
    return (y / (1.0 + tl.exp(-y))).to(dt), raw


@triton.jit
def _conv_silu_kernel(win_ptr, x_ptr, w_ptr, out_ptr, C, stride_win, stride_x, stride_out,
                      K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    y, _ = _conv_silu_cols(win_ptr, x_ptr, w_ptr, out_ptr, out_ptr, r, offs, mask, mask, stride_win, stride_x, 0,
                           K, BLOCK, False)
    tl.store(out_ptr + r * stride_out + offs, y, mask=mask)


def causal_conv_silu(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU of `x [t, C]` after `window [K-1, C]` (both model dtype),
    weights `w [C, K]` float32 -> `[t, C]` in x's dtype. Row r reads window rows r.. and x rows
    ..r (position r of `[window; x]` through r + K-1)."""
    check_tensors(window, x, w)
    check_dtype(x, "x")
    for name, tensor in (("window", window), ("x", x)):
        check_last_contiguous(tensor, name)
    t, c = x.shape
    k = w.shape[1]
    if window.shape != (k - 1, c) or w.shape != (c, k) or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"window {tuple(window.shape)} / w {tuple(w.shape)} {w.dtype} do not fit x {tuple(x.shape)}")
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    _conv_silu_kernel[(t, triton.cdiv(c, BLOCK_C))](
        window, x, w, out, c, window.stride(0), x.stride(0), out.stride(0), K=k, BLOCK=BLOCK_C, num_warps=4, **pdl_args(window))
    return out


def causal_conv_silu_ref(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of `causal_conv_silu`: the window and rows stacked, then the op's one
    torch body (deltanet_ref.py, also the engine's `layers.deltanet.causal_conv_silu`)."""
    return causal_conv_silu_body(torch.cat([window, x], dim=0), w)


# --------------------------------------------------------------------------- recurrence


@triton.jit
def _gdn_load(qkv_ptr, g_ptr, beta_ptr, layer, slot, layer_qkv, layer_gb, stride_qkv, stride_g, stride_beta,
              kh, h, offs_k, offs_v, live, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """One row's raw recurrence inputs from ring slot `slot` of `layer`: q, k `[DK]`, v `[BLOCK_V]`
    float32, g and beta scalars (zeros unless `live`)."""
    row = qkv_ptr + layer * layer_qkv + slot * stride_qkv
    q = tl.load(row + kh * DK + offs_k, mask=live, other=0.0).to(tl.float32)
    k = tl.load(row + KEY_DIM + kh * DK + offs_k, mask=live, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * KEY_DIM + h * DV + offs_v, mask=live, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + layer * layer_gb + slot * stride_g + h, mask=live, other=0.0)
    beta = tl.load(beta_ptr + layer * layer_gb + slot * stride_beta + h, mask=live, other=0.0)
    return q, k, v, g, beta


@triton.jit
def _gdn_prep(q, k, g, sqrt_dk, eps):
    """q L2-normalized and divided by sqrt(dk), k L2-normalized, the decay exp(g)."""
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) / sqrt_dk
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    return q, k, tl.exp(g)


@triton.jit
def _window_cols(win_ptr, xs_ptr, out_ptr, layer, part, row0, rows, write, ring, C, K1: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Columns `[part * BLOCK, (part + 1) * BLOCK)` of `layer`'s conv window after `rows` ring rows
    from `row0`: window row j is row `rows + j` of `[base (K1 rows); ring rows]` (`ring_window`'s
    rule; contiguous `[L, K1, C]` windows, `[L, ring, C]` ring). Nothing written unless `write`."""
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < C) & write
    for j in tl.static_range(K1):
        i = rows + j
        from_base = i < K1
        slot = (row0 + tl.maximum(i - K1, 0)) % ring
        a = tl.load(win_ptr + (layer * K1 + tl.minimum(i, K1 - 1)) * C + offs, mask=mask & from_base, other=0.0)
        b = tl.load(xs_ptr + (layer * ring + slot) * C + offs, mask=mask & (i >= K1), other=0.0)
        tl.store(out_ptr + (layer * K1 + j) * C + offs, tl.where(from_base, a, b), mask=mask)


@triton.jit(do_not_specialize=["t", "ratio", "write_final", "row0", "ring", "layer_qkv", "layer_gb", "C"])
def _gdn_kernel(qkv_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, final_ptr, stash_ptr, idx_ptr,
                t, ratio, write_final, row0, ring, layer_qkv, layer_gb,
                stride_qkv, stride_g, stride_beta, sqrt_dk, eps,
                HV: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_V: tl.constexpr, LATE_PREP: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_STASH: tl.constexpr,
                PREFETCH: tl.constexpr = 1, ROWS_ON_DEVICE: tl.constexpr = False, PDL: tl.constexpr = False,
                live_ptr=None, LIVE: tl.constexpr = False, win_ptr=None, xs_ptr=None, win_out_ptr=None, C=1,
                K1: tl.constexpr = 1, WINDOW: tl.constexpr = False, WIN_BLOCK: tl.constexpr = 16):
    # program (layer * HV + head, value block); row r of the step reads input row (row0 + r) % ring
    # of its layer (layer_qkv / layer_gb: the layer strides of the inputs; states are contiguous
    # [layers, HV, DK, DV]). One kernel serves the step (1 layer, rows 0..t-1) and the batched
    # replay over a ring (every layer, rows from the record's base): the same per-row code, so
    # the same bits (the replay's variant only drops the output and stash writes).
    pdl_wait(PDL)
    t_all = t  # the step's rows; with LIVE only the first `live` of them run (the rest are padding)
    if LIVE and not ROWS_ON_DEVICE:
        t = tl.minimum(t, tl.load(live_ptr))
    if ROWS_ON_DEVICE:  # (row0, t) from the int32 pair at idx_ptr: a graphed replay's inputs
        row0 = tl.load(idx_ptr)
        t = tl.load(idx_ptr + 1)
        if LIVE:  # the step ran only `live` rows and wrote the state after them: keeping them all is -1
            if t == tl.load(live_ptr):
                t = -1
        if t < 0:  # rows -1: the state is already in `final` (a round that kept every row)
            write_final = 0
            t = 0
    pid = tl.program_id(0)
    layer = (pid // HV).to(tl.int64)
    h = pid % HV
    n_layers = tl.num_programs(0) // HV
    if WINDOW:  # the restore's conv windows too (`ring_window`'s copy): this program's columns of its layer's
        _window_cols(win_ptr, xs_ptr, win_out_ptr, layer, h * tl.num_programs(1) + tl.program_id(1), row0, t,
                     write_final != 0, ring, C, K1, WIN_BLOCK)
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    kh = h // ratio
    tile = (layer * HV + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]  # [DK, BLOCK_V] of one head's state
    if ROWS_ON_DEVICE:  # rows -1: not even the state's read (48 MiB at the 4B's shapes)
        s = tl.load(state_ptr + tile, mask=(tile >= 0) & (write_final != 0), other=0.0)  # (a tile-shaped mask)
    else:
        s = tl.load(state_ptr + tile)
    # Row r+1's inputs are loaded (and q, k normalized) while row r updates the state: they do
    # not depend on it, and the step is a chain of t dependent row updates, so their load latency
    # would otherwise sit on that chain. The arithmetic is the same per row either way.
    live = t > 0  # a zero-row call still writes `final` (its state): load nothing then
    q, k, v, g, beta = _gdn_load(qkv_ptr, g_ptr, beta_ptr, layer, row0 % ring, layer_qkv, layer_gb, stride_qkv,
                                 stride_g, stride_beta, kh, h, offs_k, offs_v, live, KEY_DIM, DK, DV)
    q, k, decay = _gdn_prep(q, k, g, sqrt_dk, eps)
    if PREFETCH == 2:  # row 1's raw inputs, in flight while row 0 computes
        q_1, k_1, v_1, g_1, beta_1 = _gdn_load(qkv_ptr, g_ptr, beta_ptr, layer, (row0 + tl.maximum(tl.minimum(1, t - 1), 0)) % ring,
                                               layer_qkv, layer_gb, stride_qkv, stride_g, stride_beta, kh, h, offs_k,
                                               offs_v, live, KEY_DIM, DK, DV)
    for r in range(t):
        # the last rows reload the last one (in bounds, unused)
        nxt = tl.minimum(r + PREFETCH, t - 1)
        q_f, k_f, v_f, g_f, beta_f = _gdn_load(qkv_ptr, g_ptr, beta_ptr, layer, (row0 + nxt) % ring, layer_qkv,
                                               layer_gb, stride_qkv, stride_g, stride_beta, kh, h, offs_k, offs_v,
                                               live, KEY_DIM, DK, DV)
        if PREFETCH == 2:  # row r+1 was loaded a row ago; row r+2's loads start now
            q_n, k_n, v_n, g_n, beta_n = q_1, k_1, v_1, g_1, beta_1
            q_1, k_1, v_1, g_1, beta_1 = q_f, k_f, v_f, g_f, beta_f
        else:
            q_n, k_n, v_n, g_n, beta_n = q_f, k_f, v_f, g_f, beta_f
        if not LATE_PREP:  # normalize row r+1 before row r's update: waits for its loads first
            q_n, k_n, decay_n = _gdn_prep(q_n, k_n, g_n, sqrt_dk, eps)
        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        if WRITE_OUT:
            tl.store(out_ptr + ((r * n_layers + layer) * HV + h) * DV + offs_v, tl.sum(s * q[:, None], axis=0))
        if WRITE_STASH:
            st = tl.load(idx_ptr + r).to(tl.int64)
            tl.store(stash_ptr + st * (HV * DK * DV) + tile, s)
        if LATE_PREP:  # after the update: row r+1's loads land while row r computes
            q_n, k_n, decay_n = _gdn_prep(q_n, k_n, g_n, sqrt_dk, eps)
        q, k, v, decay, beta = q_n, k_n, v_n, decay_n, beta_n
    if WRITE_OUT and LIVE:  # padding rows: zero outputs (what follows them reads defined values)
        for r in range(t, t_all):
            tl.store(out_ptr + ((r * n_layers + layer) * HV + h) * DV + offs_v, tl.zeros([BLOCK_V], tl.float32))
    if write_final != 0:
        tl.store(final_ptr + tile, s)


def _check_recurrence(qkv, g, beta, state, n_k_heads, final, stash, stash_idx):
    check_tensors(qkv, g, beta, state)
    check_dtype(qkv, "qkv")
    t = qkv.shape[0]
    hv, dk, dv = state.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("state must be a contiguous float32 [Hv, dk, dv]")
    if qkv.shape[1] != 2 * n_k_heads * dk + hv * dv or hv % n_k_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {n_k_heads} key heads and state {tuple(state.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (t, hv) or x.dtype != torch.float32 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 [{t}, {hv}] with contiguous heads, got {tuple(x.shape)} {x.dtype}")
    check_last_contiguous(qkv, "qkv")
    for name, x in (("final", final), ("stash", stash)):
        if x is not None and (x.dtype != torch.float32 or not x.is_contiguous() or x.shape[-3:] != state.shape):
            raise ValueError(f"{name} must be contiguous float32 [..., {hv}, {dk}, {dv}]")
    if (stash is None) != (stash_idx is None) or (stash_idx is not None and stash_idx.shape != (t,)):
        raise ValueError("stash and stash_idx [t] come together")


def gated_delta_rule(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                     n_k_heads: int, final: torch.Tensor | None = None, stash: torch.Tensor | None = None,
                     stash_idx: torch.Tensor | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
    """The delta rule over `qkv [t, 2*Hk*dk + Hv*dv]` (conv output, model dtype), `g`, `beta`
    `[t, Hv]` float32, from `state [Hv, dk, dv]` float32 (read only, unless it is `final`).
    Returns `out [t, Hv, dv]` float32; writes the state after the last row into `final [Hv, dk,
    dv]` and the state after row r into `stash[stash_idx[r]]` (`stash [n, Hv, dk, dv]`) when given.

    `live` (int32 `[1]` on the device, read there): only rows `r < min(t, live)` run; the rows
    after them are a fixed step's padding: their outputs are zeros, they are not stashed, and
    `final` gets the state after the last live row. A live row's output and state are the same
    bits either way (rows run one after the other; padding comes after the live rows)."""
    _check_recurrence(qkv, g, beta, state, n_k_heads, final, stash, stash_idx)
    _check_live(live, state.device)
    t = qkv.shape[0]
    hv, dk, dv = state.shape
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=state.device)
    if dk != next_pow2(dk) or dv != next_pow2(dv):
        raise ValueError(f"head dims must be powers of two (dk {dk}, dv {dv})")
    if t == 0 and final is None:
        return out
    block_v = min(dv, BLOCK_V)
    _gdn_kernel[(hv, dv // block_v)](
        qkv, g, beta, state, out, state if final is None else final, state if stash is None else stash,
        g if stash_idx is None else stash_idx,
        t, hv // n_k_heads, int(final is not None), 0, max(t, 1), 0, 0,
        qkv.stride(0), g.stride(0), beta.stride(0), float(dk) ** 0.5, L2_EPS,
        HV=hv, KEY_DIM=n_k_heads * dk, DK=dk, DV=dv, BLOCK_V=block_v, LATE_PREP=LATE_PREP, WRITE_OUT=True,
        WRITE_STASH=stash is not None, PREFETCH=PREFETCH, live_ptr=g if live is None else live, LIVE=live is not None,
        num_warps=REC_WARPS, **pdl_args(qkv))
    return out


def _check_live(live: torch.Tensor | None, device: torch.device) -> None:
    if live is not None and (live.shape != (1,) or live.dtype != torch.int32 or live.device != device):
        raise ValueError(f"live must be an int32 [1] tensor on {device}, got {tuple(live.shape)} {live.dtype} "
                         f"on {live.device}")


def _check_layers(qkv, g, beta, state, final, n_k_heads, row0, rows):
    check_tensors(qkv, g, beta, state, final)
    check_dtype(qkv, "qkv")
    n, hv, dk, dv = state.shape
    for name, x in (("state", state), ("final", final)):
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != state.shape:
            raise ValueError(f"{name} must be a contiguous float32 [layers, Hv, dk, dv] like state, got {tuple(x.shape)}")
    if qkv.dim() != 3 or qkv.shape[0] != n or qkv.shape[2] != 2 * n_k_heads * dk + hv * dv or qkv.stride(2) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not a [layers, ring, C] ring fitting state {tuple(state.shape)}")
    ring = qkv.shape[1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (n, ring, hv) or x.dtype != torch.float32 or x.stride(2) != 1:
            raise ValueError(f"{name} must be float32 [{n}, {ring}, {hv}], got {tuple(x.shape)} {x.dtype}")
    if g.stride() != beta.stride():
        raise ValueError("g and beta must share their strides")
    if not 0 <= rows <= ring or row0 < 0:
        raise ValueError(f"rows {rows} from {row0} do not fit a ring of {ring}")


def gated_delta_rule_layers(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            n_k_heads: int, row0: int, rows: int, final: torch.Tensor) -> None:
    """Every layer's recurrence over `rows` recorded rows, in one launch: layer l runs rows
    `(row0 + r) % ring`, r = 0..rows-1, of its ring `qkv [L, ring, C]` (conv outputs, model dtype),
    `g`, `beta` `[L, ring, Hv]` float32, from `state [L, Hv, dk, dv]` float32, and writes the state
    after the last row into `final` (same shape; may be `state`). No outputs: a rollback's replay.
    The per-row code is `gated_delta_rule`'s (one kernel), so its states are the step's bits."""
    _check_layers(qkv, g, beta, state, final, n_k_heads, row0, rows)
    n, hv, dk, dv = state.shape
    if dk != next_pow2(dk) or dv != next_pow2(dv):
        raise ValueError(f"head dims must be powers of two (dk {dk}, dv {dv})")
    if n == 0:
        return
    ring, block_v = qkv.shape[1], min(dv, BLOCK_V)  # the step's tile: the same per-row code
    _gdn_kernel[(n * hv, dv // block_v)](
        qkv, g, beta, state, state, final, state, g,
        rows, hv // n_k_heads, 1, row0 % ring, ring, qkv.stride(0), g.stride(0),
        qkv.stride(1), g.stride(1), beta.stride(1), float(dk) ** 0.5, L2_EPS,
        HV=hv, KEY_DIM=n_k_heads * dk, DK=dk, DV=dv, BLOCK_V=block_v, LATE_PREP=LATE_PREP, WRITE_OUT=False,
        WRITE_STASH=False, PREFETCH=PREFETCH, num_warps=REC_WARPS, **pdl_args(qkv))


def gated_delta_replay_dev(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                           n_k_heads: int, params: torch.Tensor, final: torch.Tensor) -> None:
    """`gated_delta_rule_layers` with its ring start and row count read on the device from
    `params` (int32 `[row0, rows]`, 0 <= rows <= ring), so a CUDA graph captured once replays any
    rollback: the same compiled per-row code (the same bits), only where t and row0 come from.
    `rows` -1 writes nothing (`final` already holds the state: a round that kept every row)."""
    _check_layers(qkv, g, beta, state, final, n_k_heads, 0, 0)
    if params.shape != (2,) or params.dtype != torch.int32 or params.device != state.device:
        raise ValueError(f"params must be int32 [row0, rows] on {state.device}, got {tuple(params.shape)} {params.dtype}")
    n, hv, dk, dv = state.shape
    if dk != next_pow2(dk) or dv != next_pow2(dv):
        raise ValueError(f"head dims must be powers of two (dk {dk}, dv {dv})")
    if n == 0:
        return
    ring, block_v = qkv.shape[1], min(dv, BLOCK_V)
    _gdn_kernel[(n * hv, dv // block_v)](
        qkv, g, beta, state, state, final, state, params,
        0, hv // n_k_heads, 1, 0, ring, qkv.stride(0), g.stride(0),
        qkv.stride(1), g.stride(1), beta.stride(1), float(dk) ** 0.5, L2_EPS,
        HV=hv, KEY_DIM=n_k_heads * dk, DK=dk, DV=dv, BLOCK_V=block_v, LATE_PREP=LATE_PREP, WRITE_OUT=False,
        WRITE_STASH=False, PREFETCH=PREFETCH, ROWS_ON_DEVICE=True, num_warps=REC_WARPS, **pdl_args(qkv))


def gated_delta_restore(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                        n_k_heads: int, params: torch.Tensor, final: torch.Tensor, window: torch.Tensor,
                        xs: torch.Tensor, final_window: torch.Tensor, live: torch.Tensor | None = None) -> None:
    """A rollback's whole restore in one launch: `gated_delta_replay_dev(qkv, g, beta, state,
    n_k_heads, params, final)` and `ring_window(window, xs, params, final_window)` (each program of
    the replay also copies its share of its layer's window), the same bits as the two. `live`
    (int32 `[1]`, the live rows the recorded step ran with): rows equal to it count as -1 (the step
    wrote the state and the window after its live rows: a round that kept its whole window). The
    windows `[L, K-1, C]` and the ring `xs [L, ring, C]` contiguous, `final_window` apart from
    `window`."""
    _check_layers(qkv, g, beta, state, final, n_k_heads, 0, 0)
    _check_window(window, xs, params, final_window)
    _check_live(live, state.device)
    if params.device != state.device:
        raise ValueError(f"params must be on {state.device}")
    n, hv, dk, dv = state.shape
    if window.shape[0] != n or xs.shape[1] != qkv.shape[1] or window.shape[1] < 1:
        raise ValueError(f"window {tuple(window.shape)} and xs {tuple(xs.shape)} do not fit the state's {n} layers "
                         f"and ring of {qkv.shape[1]} (K-1 >= 1 rows)")
    for name, x in (("window", window), ("xs", xs), ("final_window", final_window)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if dk != next_pow2(dk) or dv != next_pow2(dv):
        raise ValueError(f"head dims must be powers of two (dk {dk}, dv {dv})")
    if n == 0:
        return
    ring, block_v = qkv.shape[1], min(dv, BLOCK_V)
    k1, c = window.shape[1], window.shape[2]
    parts = hv * (dv // block_v)  # programs of a layer: each copies one column block of its window
    _gdn_kernel[(n * hv, dv // block_v)](
        qkv, g, beta, state, state, final, state, params,
        0, hv // n_k_heads, 1, 0, ring, qkv.stride(0), g.stride(0),
        qkv.stride(1), g.stride(1), beta.stride(1), float(dk) ** 0.5, L2_EPS,
        HV=hv, KEY_DIM=n_k_heads * dk, DK=dk, DV=dv, BLOCK_V=block_v, LATE_PREP=LATE_PREP, WRITE_OUT=False,
        WRITE_STASH=False, PREFETCH=PREFETCH, ROWS_ON_DEVICE=True, live_ptr=live, LIVE=live is not None,
        win_ptr=window, xs_ptr=xs, win_out_ptr=final_window, C=c, K1=k1, WINDOW=True,
        WIN_BLOCK=max(16, next_pow2(triton.cdiv(c, parts))), num_warps=REC_WARPS, **pdl_args(qkv))


def gated_delta_restore_ref(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            n_k_heads: int, params: torch.Tensor, final: torch.Tensor, window: torch.Tensor,
                            xs: torch.Tensor, final_window: torch.Tensor, live: torch.Tensor | None = None) -> None:
    """Plain torch twin of `gated_delta_restore` (reads params and live on the host)."""
    row0, rows = (int(v) for v in params.tolist())
    if live is not None and rows == int(live.item()):
        rows = -1
    host = torch.tensor([row0, rows], dtype=torch.int32, device=params.device)
    ring_window_ref(window, xs, host, final_window)
    gated_delta_replay_dev_ref(qkv, g, beta, state, n_k_heads, host, final)


STASH_BLOCK = 2048  # state floats a stash-restore program copies


@triton.jit(do_not_specialize=["width", "ring", "C"])
def _stash_restore_kernel(stash_ptr, params_ptr, final_ptr, win_ptr, xs_ptr, win_out_ptr, width, ring, C,
                          STATE: tl.constexpr, K1: tl.constexpr, BLOCK: tl.constexpr, WIN_BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Program (layer, part): floats `[part * BLOCK, (part + 1) * BLOCK)` of the layer's state
    after the kept rows (the stash row of the last one) and a column block of its conv window."""
    pdl_wait(PDL)
    layer = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row0 = tl.load(params_ptr)
    rows = tl.load(params_ptr + 1)
    write_window = rows >= 0  # rows -1: every row kept, the step wrote the window (not the state)
    kept = tl.where(rows < 0, width, rows)
    slot = ((row0 + kept - 1 + ring) % ring).to(tl.int64)  # (non-negative: Python's `%`, as the twin's)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < STATE
    v = tl.load(stash_ptr + (layer * ring + slot) * STATE + offs, mask=mask)
    tl.store(final_ptr + layer * STATE + offs, v, mask=mask)
    _window_cols(win_ptr, xs_ptr, win_out_ptr, layer, part, row0, kept, write_window, ring, C, K1, WIN_BLOCK)


def _check_stash_restore(stash, params, final, window, xs, final_window):
    check_tensors(stash, params, final, window, xs, final_window)
    _check_window(window, xs, params, final_window)
    if stash.dim() != 5 or stash.dtype != torch.float32 or final.dtype != torch.float32 \
            or final.shape != stash.shape[:1] + stash.shape[2:] or stash.shape[1] != xs.shape[1] \
            or window.shape[0] != stash.shape[0]:
        raise ValueError(f"stash [L, ring, Hv, dk, dv] and final [L, Hv, dk, dv] float32 fitting the windows "
                         f"[L, K-1, C] and ring xs [L, ring, C], got {tuple(stash.shape)} {tuple(final.shape)} "
                         f"{tuple(window.shape)} {tuple(xs.shape)}")
    for name, x in (("stash", stash), ("final", final), ("window", window), ("xs", xs), ("final_window", final_window)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def stash_restore(stash: torch.Tensor, params: torch.Tensor, width: int, final: torch.Tensor,
                  window: torch.Tensor, xs: torch.Tensor, final_window: torch.Tensor) -> None:
    """A stash-mode round's restore in one launch: every layer's state after the kept rows, the
    stash row of the last one (`final[l] = stash[l, (row0 + rows - 1) % ring]`), and its conv
    window (`ring_window(window, xs, params, final_window)`), `(row0, rows)` = `params` (int32,
    on the device, rows >= 1; -1: the step's `width` rows all kept, whose window the step wrote:
    the state is still copied, the window not). A copy: the bits are the stash's."""
    _check_stash_restore(stash, params, final, window, xs, final_window)
    n, ring = stash.shape[0], stash.shape[1]
    state, (k1, c) = final[0].numel() if n else 0, window.shape[1:]
    if n == 0 or state == 0:
        return
    parts = triton.cdiv(state, STASH_BLOCK)
    _stash_restore_kernel[(n, parts)](
        stash, params, final, window, xs, final_window, width, ring, c, STATE=state, K1=k1, BLOCK=STASH_BLOCK,
        WIN_BLOCK=max(16, next_pow2(triton.cdiv(c, parts))), num_warps=4, **pdl_args(stash))


def stash_restore_ref(stash: torch.Tensor, params: torch.Tensor, width: int, final: torch.Tensor,
                      window: torch.Tensor, xs: torch.Tensor, final_window: torch.Tensor) -> None:
    """Plain torch twin of `stash_restore` (reads params on the host)."""
    _check_stash_restore(stash, params, final, window, xs, final_window)
    row0, rows = (int(v) for v in params.tolist())
    ring_window_ref(window, xs, params, final_window)
    final.copy_(stash[:, (row0 + (width if rows < 0 else rows) - 1) % stash.shape[1]])


@triton.jit
def _ring_window_kernel(base_ptr, xs_ptr, params_ptr, out_ptr, C, ring, layer_base, layer_xs, layer_out,
                        stride_base, stride_xs, stride_out, K1: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (layer, window row j, column block): row j of the last K1 rows of
    [base (K1 rows); ring rows row0 .. row0+rows-1]."""
    pdl_wait(PDL)
    layer = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    row0 = tl.load(params_ptr)
    rows = tl.load(params_ptr + 1)
    mask = mask & (rows >= 0)  # rows -1: `out` already holds the window (nothing written)
    i = rows + j  # index into the K1 + rows sequence
    from_base = i < K1
    slot = (row0 + tl.maximum(i - K1, 0)) % ring
    a = tl.load(base_ptr + layer * layer_base + tl.minimum(i, K1 - 1) * stride_base + offs, mask=mask & from_base,
                other=0.0)
    b = tl.load(xs_ptr + layer * layer_xs + slot * stride_xs + offs, mask=mask & (i >= K1), other=0.0)
    tl.store(out_ptr + layer * layer_out + j * stride_out + offs, tl.where(from_base, a, b), mask=mask)


def _check_window(base, xs, params, out):
    check_tensors(base, xs, params, out)
    if base.dim() != 3 or xs.dim() != 3 or out.shape != base.shape or xs.shape[0] != base.shape[0] \
            or xs.shape[2] != base.shape[2] or xs.dtype != base.dtype or out.dtype != base.dtype:
        raise ValueError(f"base/out [L, K-1, C] and xs [L, ring, C] of one dtype, got {tuple(base.shape)} "
                         f"{tuple(xs.shape)} {tuple(out.shape)}")
    for name, x in (("base", base), ("xs", xs), ("out", out)):
        check_last_contiguous(x, name)
    if params.shape != (2,) or params.dtype != torch.int32:
        raise ValueError(f"params must be int32 [row0, rows], got {tuple(params.shape)} {params.dtype}")


def ring_window(base: torch.Tensor, xs: torch.Tensor, params: torch.Tensor, out: torch.Tensor) -> None:
    """Every layer's conv window after a run of recorded rows: `out[l]` = the last K-1 rows of
    `[base[l]; xs[l][(row0 + r) % ring] for r < rows]` with `(row0, rows)` = `params` (int32, on
    the device; `rows` -1 writes nothing). `base`, `out` `[L, K-1, C]`, `xs` `[L, ring, C]` (one
    dtype; `out` must not overlap `base`). A rollback's conv restore, graph-capturable (a copy:
    the bits are the rows')."""
    _check_window(base, xs, params, out)
    n, k1, c = base.shape
    if n == 0 or k1 == 0:
        return
    _ring_window_kernel[(n, k1, triton.cdiv(c, BLOCK_C))](
        base, xs, params, out, c, xs.shape[1], base.stride(0), xs.stride(0), out.stride(0),
        base.stride(1), xs.stride(1), out.stride(1), K1=k1, BLOCK=BLOCK_C, num_warps=4, **pdl_args(base))


def ring_window_ref(base: torch.Tensor, xs: torch.Tensor, params: torch.Tensor, out: torch.Tensor) -> None:
    """Plain torch twin of `ring_window` (reads params on the host)."""
    _check_window(base, xs, params, out)
    row0, rows = (int(v) for v in params.tolist())
    if rows < 0:
        return
    idx = (torch.arange(rows, device=xs.device) + row0) % xs.shape[1]
    out.copy_(torch.cat([base, xs.index_select(1, idx)], dim=1)[:, -base.shape[1]:])


def gated_delta_replay_dev_ref(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               n_k_heads: int, params: torch.Tensor, final: torch.Tensor) -> None:
    """Plain torch twin of `gated_delta_replay_dev` (reads params on the host)."""
    row0, rows = (int(v) for v in params.tolist())
    if rows < 0:
        return
    gated_delta_rule_layers_ref(qkv, g, beta, state, n_k_heads, row0, rows, final)


def gated_delta_rule_layers_ref(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                n_k_heads: int, row0: int, rows: int, final: torch.Tensor) -> None:
    """Plain torch twin of `gated_delta_rule_layers`: `gated_delta_rule_ref` layer by layer over
    the ring's rows in order."""
    _check_layers(qkv, g, beta, state, final, n_k_heads, row0, rows)
    ring = qkv.shape[1]
    idx = torch.tensor([(row0 + r) % ring for r in range(rows)], dtype=torch.long, device=qkv.device)
    for i in range(state.shape[0]):
        gated_delta_rule_ref(qkv[i].index_select(0, idx), g[i].index_select(0, idx), beta[i].index_select(0, idx),
                             state[i], n_k_heads, final=final[i])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta_rule_ref(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                         n_k_heads: int, final: torch.Tensor | None = None, stash: torch.Tensor | None = None,
                         stash_idx: torch.Tensor | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch twin of `gated_delta_rule`: the engine's prep (float32, l2norm, q / sqrt(dk),
    key heads repeated to the value heads) and HF's per-row recurrence, one row at a time with
    the same ops whatever t is; with `live`, rows from `min(t, live)` on are padding (zero
    outputs, not stashed; `final` is the state after the last live row). Reads `live` on the host."""
    _check_recurrence(qkv, g, beta, state, n_k_heads, final, stash, stash_idx)
    _check_live(live, state.device)
    t = qkv.shape[0]
    n = t if live is None else min(t, int(live[0]))
    hv, dk, dv = state.shape
    key_dim = n_k_heads * dk
    q, k, v = qkv.split([key_dim, key_dim, hv * dv], dim=-1)
    q = _l2norm(q.reshape(t, n_k_heads, dk).float())
    k = _l2norm(k.reshape(t, n_k_heads, dk).float())
    if hv != n_k_heads:
        q = q.repeat_interleave(hv // n_k_heads, dim=1)
        k = k.repeat_interleave(hv // n_k_heads, dim=1)
    q = q / (dk ** 0.5)
    v = v.reshape(t, hv, dv).float()
    out = torch.zeros((t, hv, dv), dtype=torch.float32, device=state.device)
    s = state
    for i in range(n):
        s, out[i] = delta_rule_row(s, q[i], k[i], v[i], g[i], beta[i])
        if stash is not None:
            stash.index_copy_(0, stash_idx[i:i + 1], s.unsqueeze(0))
    if final is not None:
        final.copy_(s)
    return out
