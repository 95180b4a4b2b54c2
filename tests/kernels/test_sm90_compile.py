"""Every kernel the engine launches, compiled for sm_90 (the H200) on the CPU.

The other tests here run the kernels through Triton's interpreter, which runs their Python
semantics and checks nothing the compiler checks (one type per name across the branches of a
run-time `if`, constexpr rules, shapes that lower, shared memory a block, ...): a kernel can pass
all of them and fail to compile on the GPU. This module compiles them for real, down to a cubin
with Triton's bundled ptxas, through Triton's own launch path rather than hand-written signatures:
each public wrapper runs on small CPU tensors while Triton's active driver is a stand-in for one
H200 (target cuda / sm_90, warps of 32, 227 KiB of shared memory a block) whose launcher
launches nothing. So what compiles is exactly what a wrapper launches (its constexprs, num_warps
and num_stages, argument dtypes and the alignment / divisibility specialization, from the CPU
tensors' data_ptr), and Triton's load-time checks (shared memory, threads a block) run as on the
GPU. The wrappers' "CUDA tensors only" checks are the only thing relaxed (see `_relax_checks`).

Configurations: the engine's shapes (the embedded Qwen3 pair, Qwen3-8B, Qwen3.5-4B), the module
tile constants (attention's TILES per head_dim class, DeltaNet's BLOCK_V / REC_WARPS with LATE_PREP
both ways, quant_linear's TUNED table (quant_tuning.py) and its heuristic, aligned or not), each in
bf16 and f32.
The coverage tests then require that every kernel launched in kernels/*.py compiled, that every
boolean constexpr compiled both ways, and the tile constants exactly; so a wrapper that stops
launching (a silent torch fallback) fails too.

conftest.py sets TRITON_INTERPRET=1 on a CPU-only machine before the kernel modules import
(Triton picks the interpreter when it decorates), so the compiles run in subprocesses (this file
as a script, TRITON_INTERPRET unset, a fresh TRITON_CACHE_DIR), a few shards side by side.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"

# The H200 as Triton's loader sees it (cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90).
SM90_MAX_SHARED = 232448
# Constexprs that only the interpreter sets True (its bf16 arithmetic on raw bits): on the GPU,
# hence here, they must compile False.
INTERPRETER_ONLY = {"DOT_F32", "WIDEN", "PLAIN_SQUARE"}
DTYPES = ("bf16", "f32")
WORKER_TIMEOUT_S = 540

# --------------------------------------------------------------------------------------------
# Cases: each calls public wrappers as the engine does; `ctx.launch` checks the named kernels
# were launched (so compiled) and records any error. Run in the worker only.
# --------------------------------------------------------------------------------------------

CASES: dict[str, tuple] = {}  # name -> (function, argument, relative cost for the shards)

# Compiles every kernel for sm_90 in subprocesses: the exhaustive tier (CI runs it; the quick tier
# runs every kernel through the interpreter).
pytestmark = pytest.mark.exhaustive


def _case(name, fn, arg=None, cost=1.0):
    CASES[name] = (fn, arg, cost)


# Engine shapes: (n_heads, n_kv, head_dim) of the embedded Qwen3 pair, Qwen3-8B, Qwen3.5-4B.
ATTN_SHAPES = ((4, 2, 64), (32, 8, 128), (16, 4, 256))
# Gemma-4-31B's attention: sliding layers (window 1024) and full layers (k_eq_v): (nh, nkv, hd, window)
GEMMA4_ATTN = ((32, 16, 256, 1024), (32, 4, 512, 0))


def _norm(ctx, dt):
    n = ctx.k.norm
    for d in (256, 4096):  # the embedded models, Qwen3-8B (BLOCK_D 4096: 8 warps)
        x, r, w = ctx.t(3, d, dtype=dt), ctx.t(3, d, dtype=dt), ctx.t(d, dtype=dt)
        ctx.launch(f"rms_norm d{d}", "_rms_norm_kernel", n.rms_norm, x, w, 1e-6)
        ctx.launch(f"add_rms_norm d{d}", "_rms_norm_kernel", n.add_rms_norm, x, r, w, 1e-6)
        ctx.launch(f"embed_rms_norm d{d}", "_rms_norm_kernel", n.embed_rms_norm, ctx.idx(3), ctx.t(50, d, dtype=dt),
                   w, 1e-6)  # the step's embedding gather fused with its first norm (GATHER)
        # the statistic from the dense kernel's per-tile partials (PARTIALS: its folded norm as a tensor)
        ctx.launch(f"rms_norm_partials d{d}", "_rms_norm_kernel", n.rms_norm_partials, x, ctx.t(3, d // 64, dtype="f32"),
                   w, 1e-6)
        # a drafter's block (FIRST: row 0's id from the anchor) and a step's taps (rows into a column slice)
        taps = ctx.t(3, 3 * d, dtype=dt)
        ctx.launch(f"embed_rms_norm first d{d}", "_rms_norm_kernel", n.embed_rms_norm, ctx.idx(3),
                   ctx.t(50, d, dtype=dt), w, 1e-6, first=ctx.idx(1), rows_out=taps[:, :d])
        ctx.launch(f"add_rms_norm res_out d{d}", "_rms_norm_kernel", n.add_rms_norm, x, r, w, 1e-6,
                   res_out=taps[:, d:2 * d])
    d = 2560  # Qwen3.5-4B's zero-centred norms (1 + w in float32)
    x, r, w1p = ctx.t(3, d, dtype=dt), ctx.t(3, d, dtype=dt), ctx.t(d, dtype="f32")
    ctx.launch("rms_norm_1p", "_rms_norm_kernel", n.rms_norm_1p, x, w1p, 1e-6)
    ctx.launch("add_rms_norm_1p", "_rms_norm_kernel", n.add_rms_norm_1p, x, r, w1p, 1e-6)
    ctx.launch("embed_rms_norm_1p", "_rms_norm_kernel", n.embed_rms_norm_1p, ctx.idx(3), ctx.t(50, d, dtype=dt),
               w1p, 1e-6)  # the hybrid step's embedding gather fused with its first norm


def _rope(ctx, dt):
    for nh, nkv, hd in ATTN_SHAPES[:2]:
        t, s = 16, 512
        kv = ctx.t(2, nkv, s, hd, dtype=dt)
        ctx.launch(f"qk_norm_rope_kv_write hd{hd}", "_qk_norm_rope_kv_kernel", ctx.k.rope.qk_norm_rope_kv_write,
                   ctx.t(t, (nh + 2 * nkv) * hd, dtype=dt), ctx.t(hd, dtype=dt), ctx.t(hd, dtype=dt),
                   ctx.t(s, hd, dtype=dt), ctx.t(s, hd, dtype=dt), ctx.idx(t), kv[0], kv[1], nh, nkv, 1e-6)
        ctx.launch(f"rope_kv_write hd{hd}", "_qk_norm_rope_kv_kernel", ctx.k.rope.rope_kv_write,
                   ctx.t(t, (nh + 2 * nkv) * hd, dtype=dt), ctx.t(s, hd, dtype=dt), ctx.t(s, hd, dtype=dt),
                   ctx.idx(t), kv[0], kv[1], nh, nkv)  # LLaMA's: no q/k norm (NORM off)


def _activation(ctx, dt):
    for inter in (768, 12288, 9216):
        ctx.launch(f"silu_mul I{inter}", "_silu_mul_kernel", ctx.k.activation.silu_mul, ctx.t(16, 2 * inter, dtype=dt))


def _argmax(ctx, dt):
    am = ctx.k.argmax
    for v in (4096, 100):  # the embedded vocabulary, a small one: one program a row
        ctx.launch(f"row_argmax V{v}", "_row_argmax_kernel", am.row_argmax, ctx.t(16, v, dtype=dt))
    for v in (151936, 248320):  # Qwen3, Qwen3.5: rows cut into chunks, then folded
        for rows in (1, 16):
            ctx.launch(f"row_argmax V{v} rows{rows}", ("_row_argmax_kernel", "_fold_chunks_kernel"), am.row_argmax,
                       ctx.t(rows, v, dtype=dt))
    ctx.launch("row_argmax out=", "_row_argmax_kernel", am.row_argmax, ctx.t(16, 4096, dtype=dt), out=ctx.idx(16))


def _attention(ctx, dt):
    a = ctx.k.attention
    for nh, nkv, hd in ATTN_SHAPES:
        t, s = 16, 1100
        kv = ctx.t(2, nkv, s, hd, dtype=dt)
        ctx.launch(f"decode_attention {nh}/{nkv}x{hd}", ("_split_kernel", "_combine_kernel"), a.decode_attention,
                   ctx.t(t, nh, hd, dtype=dt), kv[0], kv[1], ctx.idx(t), hd ** -0.5)
        ctx.launch(f"gated_decode_attention {nh}/{nkv}x{hd}", ("_split_kernel", "_combine_kernel"),
                   a.gated_decode_attention, ctx.t(t, nh, hd, dtype=dt), kv[0], kv[1], ctx.idx(t), hd ** -0.5,
                   ctx.t(t, (2 * nh + 2 * nkv) * hd, dtype=dt))
        # a drafter's block over its draft cache: a storage of one split (DIRECT: no combine), then of two
        b = 16
        for rows in (528, 1100):
            d = ctx.t(2, nkv, rows, hd, dtype=dt)
            one = rows <= a.draft_tile_for(hd).split
            ctx.launch(f"draft_block_attention {nh}/{nkv}x{hd} storage {rows}",
                       "_split_kernel" if one else ("_split_kernel", "_combine_kernel"), a.draft_block_attention,
                       ctx.t(b, nh, hd, dtype=dt), d[0], d[1], ctx.idx(b), hd ** -0.5)
    for nh, nkv, hd, window in GEMMA4_ATTN:
        t, s = 16, 1100
        kv = ctx.t(2, nkv, s, hd, dtype=dt)
        ctx.launch(f"decode_attention gemma4 {nh}/{nkv}x{hd} window {window}", ("_split_kernel", "_combine_kernel"),
                   a.decode_attention, ctx.t(t, nh, hd, dtype=dt), kv[0], kv[1], ctx.idx(t), 1.0, window)
        if window:  # a sliding layer's ring at 32k positions: window + 512 rows
            ring = ctx.t(2, nkv, window + 512, hd, dtype=dt)
            ctx.launch(f"decode_attention gemma4 {nh}/{nkv}x{hd} window {window} ring",
                       ("_split_kernel", "_combine_kernel"), a.decode_attention, ctx.t(t, nh, hd, dtype=dt), ring[0],
                       ring[1], ctx.idx(t), 1.0, window, span=32768)


def _gemma4(ctx, dt):
    g4 = ctx.k.gemma4
    t, s = 16, 512
    for nh, nkv, hd, window in GEMMA4_ATTN:
        k_eq_v = window == 0  # the 31B's full layers take v from the key projection
        kv = ctx.t(2, nkv, s, hd, dtype=dt)
        args = (ctx.t(hd, dtype=dt), ctx.t(hd, dtype=dt), ctx.t(s, hd, dtype=dt), ctx.t(s, hd, dtype=dt), ctx.idx(t))
        ctx.launch(f"gemma_qk_norm_rope_kv_write hd{hd} k_eq_v={k_eq_v}", "_gemma_qkv_kernel",
                   g4.gemma_qk_norm_rope_kv_write, ctx.t(t, (nh + nkv * (1 if k_eq_v else 2)) * hd, dtype=dt),
                   *args, kv[0], kv[1], nh, nkv, 1e-6, k_eq_v)
    h = 5376  # the 31B's hidden size: after attention (no scalar), after the MLP (layer_scalar)
    for scalar in (None, ctx.t(1, dtype=dt)):
        ctx.launch(f"gemma_add_norm scalar={scalar is not None}", "_add_norm_kernel", g4.gemma_add_norm,
                   ctx.t(t, h, dtype=dt), ctx.t(t, h, dtype=dt), ctx.t(h, dtype=dt), ctx.t(h, dtype=dt), 1e-6, scalar)
    # the MoE block's step: the experts' input norm beside the MLP's in the same program (OUT2)
    ctx.launch("gemma_add_two_norms", "_add_norm_kernel", g4.gemma_add_two_norms, ctx.t(t, h, dtype=dt),
               ctx.t(t, h, dtype=dt), ctx.t(h, dtype=dt), ctx.t(h, dtype=dt), ctx.t(h, dtype=dt), 1e-6)
    ctx.launch("gelu_tanh_mul I21504", "_gelu_mul_kernel", g4.gelu_tanh_mul, ctx.t(t, 2 * 21504, dtype=dt))
    ctx.launch("softcap V262144", "_softcap_kernel", g4.softcap, ctx.t(16, 262144, dtype=dt), 30.0)
    ctx.launch("softcap V262144 widened", "_softcap_kernel", g4.softcap, ctx.t(16, 262144, dtype=dt), 30.0,
               ctx.torch.float32)


def _deltanet(ctx, dt):
    dn = ctx.k.deltanet
    hk, hv, dk, dv, t, ring, layers = 16, 32, 128, 128, 16, 32, 3  # Qwen3.5-4B's DeltaNet
    c = 2 * hk * dk + hv * dv
    ctx.launch("causal_conv_silu", "_conv_silu_kernel", dn.causal_conv_silu,
               ctx.t(3, c, dtype=dt), ctx.t(t, c, dtype=dt), ctx.t(c, 4, dtype="f32"))
    ctx.launch("ring_window", "_ring_window_kernel", dn.ring_window, ctx.t(layers, 3, c, dtype=dt),
               ctx.t(layers, ring, c, dtype=dt), ctx.torch.zeros(2, dtype=ctx.torch.int32), ctx.t(layers, 3, c, dtype=dt))
    saved = dn.LATE_PREP, dn.PREFETCH
    try:
        # the module's choice and the other schedules (hybrid_step.py --gdn-tile): both LATE_PREP
        # with the module's PREFETCH, and the other PREFETCH
        for late, ahead in ((True, saved[1]), (False, saved[1]), (saved[0], 3 - saved[1])):
            dn.LATE_PREP, dn.PREFETCH = late, ahead
            state = ctx.t(hv, dk, dv, dtype="f32")
            qkv, g, beta = ctx.t(t, c, dtype=dt), ctx.t(t, hv, dtype="f32"), ctx.t(t, hv, dtype="f32")
            ctx.launch(f"gated_delta_rule LATE_PREP={late} PREFETCH={ahead}", "_gdn_kernel", dn.gated_delta_rule,
                       qkv, g, beta, state, hk)
            ctx.launch(f"gated_delta_rule final+stash LATE_PREP={late} PREFETCH={ahead}", "_gdn_kernel", dn.gated_delta_rule,
                       qkv, g, beta, state, hk, final=ctx.t(hv, dk, dv, dtype="f32"),
                       stash=ctx.t(ring, hv, dk, dv, dtype="f32"), stash_idx=ctx.idx(t))
            # a fixed step's live rows (the padding after them skipped), as the engine's steps run it
            ctx.launch(f"gated_delta_rule final+live LATE_PREP={late} PREFETCH={ahead}", "_gdn_kernel",
                       dn.gated_delta_rule, qkv, g, beta, state, hk, final=ctx.t(hv, dk, dv, dtype="f32"),
                       live=ctx.torch.ones(1, dtype=ctx.torch.int32))
            states = ctx.t(layers, hv, dk, dv, dtype="f32")
            ctx.launch(f"gated_delta_rule_layers LATE_PREP={late} PREFETCH={ahead}", "_gdn_kernel", dn.gated_delta_rule_layers,
                       ctx.t(layers, ring, c, dtype=dt), ctx.t(layers, ring, hv, dtype="f32"),
                       ctx.t(layers, ring, hv, dtype="f32"), states, hk, 5, t, states)
            params = ctx.torch.zeros(2, dtype=ctx.torch.int32)  # a graphed rollback's (row0, rows)
            ctx.launch(f"gated_delta_replay_dev LATE_PREP={late} PREFETCH={ahead}", "_gdn_kernel", dn.gated_delta_replay_dev,
                       ctx.t(layers, ring, c, dtype=dt), ctx.t(layers, ring, hv, dtype="f32"),
                       ctx.t(layers, ring, hv, dtype="f32"), states, hk, params, ctx.t(layers, hv, dk, dv, dtype="f32"))
    finally:
        dn.LATE_PREP, dn.PREFETCH = saved
    # a graphed rollback's whole restore (windows + states, one launch): the host's rollback, and a
    # round's with the live rows its step ran
    for live in (None, ctx.torch.ones(1, dtype=ctx.torch.int32)):
        ctx.launch(f"gated_delta_restore live={live is not None}", "_gdn_kernel", dn.gated_delta_restore,
                   ctx.t(layers, ring, c, dtype=dt), ctx.t(layers, ring, hv, dtype="f32"),
                   ctx.t(layers, ring, hv, dtype="f32"), ctx.t(layers, hv, dk, dv, dtype="f32"), hk,
                   ctx.torch.zeros(2, dtype=ctx.torch.int32), ctx.t(layers, hv, dk, dv, dtype="f32"),
                   ctx.t(layers, 3, c, dtype=dt), ctx.t(layers, ring, c, dtype=dt), ctx.t(layers, 3, c, dtype=dt),
                   live=live)
    ctx.launch("stash_restore", "_stash_restore_kernel", dn.stash_restore, ctx.t(layers, ring, hv, dk, dv, dtype="f32"),
               ctx.torch.zeros(2, dtype=ctx.torch.int32), t, ctx.t(layers, hv, dk, dv, dtype="f32"),
               ctx.t(layers, 3, c, dtype=dt), ctx.t(layers, ring, c, dtype=dt), ctx.t(layers, 3, c, dtype=dt))


def _gather(ctx, dt):
    gt = ctx.k.gather
    for h in (256, 4096, 2560):
        ctx.launch(f"embed_rows H{h}", "_embed_kernel", gt.embed_rows, ctx.idx(16), ctx.t(64, h, dtype=dt))
    h, r, n = 256, 64, 15  # the embedded DSpark drafter's confidence head (+ markov features)
    w, b = ctx.t(h, dtype="f32"), ctx.t(1, dtype="f32")
    ctx.launch("confidence_raw", "_confidence_kernel", gt.confidence_raw, ctx.t(n, h, dtype=dt), w, b)
    ctx.launch("confidence_raw markov", "_confidence_kernel", gt.confidence_raw, ctx.t(n, h, dtype=dt),
               ctx.t(h + r, dtype="f32"), b, ctx.idx(n), ctx.t(4096, r, dtype=dt))
    # the drafter's final norm left to its heads (NORM_IN: a PendingNorm's rows normed as loaded)
    pending = ctx.k.dense_linear.PendingNorm(ctx.t(n, h, dtype=dt), ctx.t(n, 4, dtype="f32"), ctx.t(h, dtype=dt), 1e-6)
    ctx.launch("confidence_raw markov norm_in", "_confidence_kernel", gt.confidence_raw, pending,
               ctx.t(h + r, dtype="f32"), b, ctx.idx(n), ctx.t(4096, r, dtype=dt))


def _pack_round(ctx, _):
    gt = ctx.k.gather
    ctx.launch("pack_round", "_pack_kernel", gt.pack_round, ctx.idx(16), ctx.idx(16))
    ctx.launch("pack_round raws", "_pack_kernel", gt.pack_round, ctx.idx(16), ctx.idx(16), ctx.t(15, dtype="f32"))


def _settle(ctx, _):
    st, torch = ctx.k.settle, ctx.torch
    threshold = torch.zeros(1, dtype=torch.float64)
    for kind, nd in (("ladder", 0), ("confidence", 15), ("confidence-slot", 16)):
        for adapt in (True, False):
            raws = ctx.t(nd, dtype="f32") if nd else None
            ctx.launch(f"settle_round {kind} adapt={adapt}", "_settle_kernel", st.settle_round, ctx.idx(16), ctx.idx(16),
                       raws, ctx.idx(5), threshold if nd else None, kind=kind, cap=16, adapt=adapt)
    # the priced windows: from the raws, and fitted to the runs carried in inputs [7]
    cost = torch.ones(16, dtype=torch.float64)
    ctx.launch("settle_round priced", "_settle_kernel", st.settle_round, ctx.idx(16), ctx.idx(16), ctx.t(15, dtype="f32"),
               ctx.idx(5), None, kind="priced", cap=16, adapt=True, cost=cost)
    ctx.launch("settle_round priced-runs", "_settle_kernel", st.settle_round, ctx.idx(16), ctx.idx(16), None, ctx.idx(7),
               None, kind="priced-runs", cap=16, adapt=True, cost=cost)
    # a hybrid state's round: also the replay restore's ring rows (int32 [2])
    ctx.launch("settle_round restore", "_settle_kernel", st.settle_round, ctx.idx(16), ctx.idx(16), None, ctx.idx(5),
               None, kind="ladder", cap=16, adapt=False, restore=torch.zeros(2, dtype=torch.int32), ring=64)


def _markov(ctx, dt):
    mk = ctx.k.markov
    v, r, n = 4096, 64, 15  # the embedded DSpark drafter
    logits, anchor = ctx.t(n, v, dtype="f32"), ctx.idx(1)
    w1, w2 = ctx.t(v, r, dtype=dt), ctx.t(v, r, dtype=dt)
    ctx.launch("markov_chain slots", "_markov_slot_kernel", mk.markov_chain, logits, anchor, w1, w2, ctx.dtype(dt))
    table = ctx.t(v, v, dtype=dt)  # bias_table's shape and dtype
    ctx.launch("markov_chain table", "_markov_table_kernel", mk.markov_chain, logits, anchor, w1, w2, ctx.dtype(dt),
               table=table)
    ctx.launch("markov_chain table, model-dtype logits", "_markov_table_kernel", mk.markov_chain,
               ctx.t(n, v, dtype=dt), anchor, w1, w2, ctx.dtype(dt), table=table)
    ctx.launch("markov_chain table, with the anchor", "_markov_table_kernel", mk.markov_chain, logits, anchor, w1, w2,
               ctx.dtype(dt), table=table, with_anchor=True)  # a round's candidates (WITH_ANCHOR)
    vb = mk.TABLE_BLOCK + 64  # a vocabulary over one tile (ONE_TILE False)
    ctx.launch("markov_chain table, two tiles", "_markov_table_kernel", mk.markov_chain, ctx.t(n, vb, dtype="f32"),
               anchor, ctx.t(vb, r, dtype=dt), ctx.t(vb, r, dtype=dt), ctx.dtype(dt), table=ctx.t(vb, vb, dtype=dt))
    # a round's chain that scores its slots (WITH_CONF): the head with its markov features over the
    # final norm left to it (WITH_MARKOV, NORM_IN), then the hidden part alone over normed rows
    h = 256
    pending = ctx.k.dense_linear.PendingNorm(ctx.t(n, h, dtype=dt), ctx.t(n, 4, dtype="f32"), ctx.t(h, dtype=dt), 1e-6)
    ctx.launch("markov_chain_confidence markov norm_in", "_markov_table_kernel", mk.markov_chain_confidence, logits,
               anchor, w1, w2, ctx.dtype(dt), table, pending, ctx.t(h + r, dtype="f32"), ctx.t(1, dtype="f32"), w1)
    ctx.launch("markov_chain_confidence hidden-only, two tiles", "_markov_table_kernel", mk.markov_chain_confidence,
               ctx.t(n, vb, dtype="f32"), anchor, ctx.t(vb, r, dtype=dt), ctx.t(vb, r, dtype=dt), ctx.dtype(dt),
               ctx.t(vb, vb, dtype=dt), ctx.t(n, h, dtype=dt), ctx.t(h, dtype="f32"), ctx.t(1, dtype="f32"))


# Shapes quant_linear meets outside TUNED (its heuristic): the embedded pair's projections
# (fused q/k/v, o, gate/up, down), Qwen3.5-4B's, and odd ones (out and in off the tiles).
QUANT_HEURISTIC_SHAPES = ((512, 256), (256, 256), (1536, 256), (256, 768), (18432, 2560), (2560, 9216),
                          (80, 96), (200, 160))


def _quant_linear(ctx, arg):
    qtype, dt, which = arg
    ql, qt = ctx.k.quant_linear, ctx.k.quant_tuning
    if which == "tuned":
        shapes = [(n, k) for (q, n, k) in qt.TUNED if q == qtype]
    else:
        shapes = list(QUANT_HEURISTIC_SHAPES)
    for n, k in shapes:
        packed = ctx.packed(qtype, n, k)
        cfg = qt.config_for(qtype, n, k)
        label = f"quant_linear {qtype} {n}x{k} {cfg}"
        ctx.launch(label, "_quant_linear_kernel", ql.quant_linear, ctx.t(16, k, dtype=dt), packed)
    if which == "heuristic":
        # Packed.rows: a view whose scales start off 16 bytes (Triton compiles for that alignment)
        packed = ctx.packed(qtype, 1024, 4096).rows(3, 515)
        ctx.launch(f"quant_linear {qtype} rows(3, 515)", "_quant_linear_kernel", ql.quant_linear,
                   ctx.t(16, 4096, dtype=dt), packed)
    else:
        # the SwiGLU epilogue: the drafter's fused gate/up (heuristic tiles) and a TUNED split-K shape
        for n, k in ((24576, 4096), (4096, 12288)):
            ctx.launch(f"quant_linear {qtype} {n}x{k} glu", "_quant_linear_kernel", ql.quant_linear,
                       ctx.t(16, k, dtype=dt), ctx.packed(qtype, n, k), glu=True)


# Shapes the dense kernel meets outside TUNED when called directly (its heuristic), out and in off
# the tiles (masked rows, a last k tile cut short).
DENSE_HEURISTIC_SHAPES = ((80, 96), (200, 320))


def _dense_linear(ctx, dt):
    dl = ctx.k.dense_linear
    for n, k in list(dl.TUNED) + list(DENSE_HEURISTIC_SHAPES):
        ctx.launch(f"dense_linear {n}x{k} {dl.config_for(n, k)}", "_dense_linear_kernel", dl.dense_linear,
                   ctx.t(16, k, dtype=dt), ctx.t(n, k, dtype=dt))
    saved = dl.PDL_PREFETCH
    dl.PDL_PREFETCH = 2  # the early-launch variant: weight lines asked of L2 before the wait
    try:
        for n, k in list(dl.TUNED)[:2]:
            ctx.launch(f"dense_linear {n}x{k} prefetch", "_dense_linear_kernel", dl.dense_linear,
                       ctx.t(16, k, dtype=dt), ctx.t(n, k, dtype=dt))
    finally:
        dl.PDL_PREFETCH = saved
    # the SwiGLU epilogue (gate and up rows in one tile): the step's gate/up shapes, one split and
    # (the drafter's fc shape as if it were one) split-K
    for n, k in ((24576, 4096), (18432, 2560), (4096, 12288)):
        ctx.launch(f"dense_linear {n}x{k} glu", "_dense_linear_kernel", dl.dense_linear,
                   ctx.t(16, k, dtype=dt), ctx.t(n, k, dtype=dt), glu=True)
    # the q/k/v projection's epilogue (ROPE): Qwen3-8B's (q/k norm: NORM) and LLaMA-3.1-8B's (none)
    nh, nkv, hd, s_len = 32, 8, 128, 512
    for norm in (True, False):
        w = ctx.t((nh + 2 * nkv) * hd, 4096, dtype=dt)
        ctx.launch(f"dense_qkv_rope_kv_write norm={norm}", "_dense_linear_kernel", dl.dense_qkv_rope_kv_write,
                   ctx.t(16, 4096, dtype=dt), w, ctx.t(hd, dtype=dt) if norm else None,
                   ctx.t(hd, dtype=dt) if norm else None, ctx.t(s_len, hd, dtype=dt), ctx.t(s_len, hd, dtype=dt),
                   ctx.idx(16), ctx.t(nkv, s_len, hd, dtype=dt), ctx.t(nkv, s_len, hd, dtype=dt), nh, nkv, 1e-6)
    # the residual epilogue (RESID: Qwen3-8B's o, one split, and down, split-K) and the norm folded
    # into the next matmul (NORM_IN: its gate/up with SwiGLU, q/k/v with rope, lm_head with argmax)
    for n, k in ((4096, 4096), (4096, 12288)):
        ctx.launch(f"dense_linear_add_norm {n}x{k}", "_dense_linear_kernel", dl.dense_linear_add_norm,
                   ctx.t(16, k, dtype=dt), ctx.t(n, k, dtype=dt), ctx.t(16, n, dtype=dt), ctx.t(n, dtype=dt), 1e-6)
    # the down projection's new residual into a column slice of the step's taps
    ctx.launch("dense_linear_add_norm 4096x12288 into the taps", "_dense_linear_kernel", dl.dense_linear_add_norm,
               ctx.t(16, 12288, dtype=dt), ctx.t(4096, 12288, dtype=dt), ctx.t(16, 4096, dtype=dt),
               ctx.t(4096, dtype=dt), 1e-6, out=ctx.t(16, 3 * 4096, dtype=dt)[:, 4096:8192])
    # a drafter's context features, their norm left to the k/v projections (RESID without ADD_RES):
    # the 8B-shape drafter's fc (3 taps)
    ctx.launch("dense_linear_norm 4096x12288", "_dense_linear_kernel", dl.dense_linear_norm,
               ctx.t(16, 12288, dtype=dt), ctx.t(4096, 12288, dtype=dt), ctx.t(4096, dtype=dt), 1e-6)
    pending = dl.PendingNorm(ctx.t(16, 4096, dtype=dt), ctx.t(16, 64, dtype="f32"), ctx.t(4096, dtype=dt), 1e-6)
    ctx.launch("dense_linear 24576x4096 glu norm_in", "_dense_linear_kernel", dl.dense_linear, pending,
               ctx.t(24576, 4096, dtype=dt), glu=True)
    ctx.launch("dense_qkv_rope_kv_write norm_in", "_dense_linear_kernel", dl.dense_qkv_rope_kv_write, pending,
               ctx.t((nh + 2 * nkv) * hd, 4096, dtype=dt), ctx.t(hd, dtype=dt), ctx.t(hd, dtype=dt),
               ctx.t(s_len, hd, dtype=dt), ctx.t(s_len, hd, dtype=dt), ctx.idx(16), ctx.t(nkv, s_len, hd, dtype=dt),
               ctx.t(nkv, s_len, hd, dtype=dt), nh, nkv, 1e-6)
    ctx.launch("dense_linear 151936x4096 argmax norm_in", "_dense_linear_kernel", dl.dense_linear, pending,
               ctx.t(151936, 4096, dtype=dt), argmax_out=ctx.idx(16))
    # the argmax epilogue (ARGMAX): the lm_heads of Qwen3-8B and Qwen3.5-4B, whose tiles do not split `in`
    for n, k in ((151936, 4096), (248320, 2560)):
        ctx.launch(f"dense_linear {n}x{k} argmax", "_dense_linear_kernel", dl.dense_linear,
                   ctx.t(16, k, dtype=dt), ctx.t(n, k, dtype=dt), argmax_out=ctx.idx(16))


def _quant_scale_after(ctx, dt):
    """The scale-after-dot variant: no TUNED shape uses it, but benchmarks launch it (`config=`),
    and with bf16 q4_0 it is the inline-PTX nibble path."""
    ql, qt = ctx.k.quant_linear, ctx.k.quant_tuning
    for qtype in ("q8_0", "q4_0"):
        cfg = qt.KernelConfig(block_m=16, block_n=64, block_k=128, split_k=2, scale_after_dot=True)
        ctx.launch(f"quant_linear {qtype} scale_after_dot", "_quant_linear_kernel", ql.quant_linear,
                   ctx.t(16, 4096, dtype=dt), ctx.packed(qtype, 1024, 4096), config=cfg)


def _quant_mantissa(ctx, dt):
    """The byte-permute dequantization (inline PTX on the GPU): no TUNED shape uses it yet, but the
    sweep (benchmarks/gpu/quant_linear_sweep.py) launches it in both operand orders, with the
    per-warp MMAs (swap, 1-2 warps) and the warpgroup ones (swap, 4 warps, block_n 64), and GLU."""
    ql = ctx.k.quant_linear
    C = ctx.k.quant_tuning.KernelConfig
    for qtype in ("q8_0", "q4_0"):
        for cfg in (C(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=2, swap_ab=True, mantissa=True),
                    C(block_m=16, block_n=64, block_k=128, split_k=2, num_warps=4, swap_ab=True, mantissa=True),
                    C(block_m=16, block_n=128, block_k=128, split_k=2, num_warps=4, mantissa=True)):
            ctx.launch(f"quant_linear {qtype} {cfg}", "_quant_linear_kernel", ql.quant_linear,
                       ctx.t(16, 4096, dtype=dt), ctx.packed(qtype, 2048, 4096), config=cfg)
        cfg = C(block_m=16, block_n=64, block_k=128, split_k=1, num_warps=2, swap_ab=True, mantissa=True)
        ctx.launch(f"quant_linear {qtype} glu mantissa", "_quant_linear_kernel", ql.quant_linear,
                   ctx.t(16, 4096, dtype=dt), ctx.packed(qtype, 24576, 4096), config=cfg, glu=True)


def _qwen35(ctx, dt):
    q = ctx.k.qwen35
    nh, nkv, hd, r, t, s = 16, 4, 256, 64, 16, 512  # Qwen3.5-4B's gated attention (partial rope)
    qgkv = ctx.t(t, (2 * nh + 2 * nkv) * hd, dtype=dt)
    kv = ctx.t(2, nkv, s, hd, dtype=dt)
    ctx.launch("gated_qk_norm_rope_kv_write", "_gated_qk_kernel", q.gated_qk_norm_rope_kv_write, qgkv,
               ctx.t(hd, dtype="f32"), ctx.t(hd, dtype="f32"), ctx.t(s, r, dtype=dt), ctx.t(s, r, dtype=dt),
               ctx.idx(t), kv[0], kv[1], nh, nkv, 1e-6)
    ctx.launch("output_gate", "_output_gate_kernel", q.output_gate, ctx.t(t, nh * hd, dtype=dt), qgkv, nh)

    hk, hv, dk, dv, ring, k = 16, 32, 128, 128, 32, 4  # its DeltaNet
    c = 2 * hk * dk + hv * dv
    ba, a_neg, dt_bias = ctx.t(t, 2 * hv, dtype=dt), ctx.t(hv, dtype="f32"), ctx.t(hv, dtype="f32")
    mixed, xs_ring = ctx.t(t, c, dtype=dt), ctx.t(ring, c, dtype=dt)
    qkv_ring, g_ring, beta_ring = ctx.t(ring, c, dtype=dt), ctx.t(ring, hv, dtype="f32"), ctx.t(ring, hv, dtype="f32")
    ctx.launch("gdn_gates", "_gdn_gates_kernel", q.gdn_gates, ba, a_neg, dt_bias)
    ctx.launch("gdn_gates record", "_gdn_gates_kernel", q.gdn_gates, ba, a_neg, dt_bias, ctx.idx(t), xs_ring, mixed)
    ctx.launch("gdn_gates replay", "_gdn_gates_kernel", q.gdn_gates, ba, a_neg, dt_bias, ctx.idx(t), xs_ring, mixed,
               (qkv_ring, ctx.t(t, c, dtype=dt), g_ring, beta_ring))
    window, conv_w = ctx.t(k - 1, c, dtype=dt), ctx.t(c, k, dtype="f32")
    records = {"": {}, " record": dict(ring_idx=ctx.idx(t), xs_ring=xs_ring),
               " replay": dict(ring_idx=ctx.idx(t), xs_ring=xs_ring, replay_rings=(qkv_ring, g_ring, beta_ring))}
    for name, kw in records.items():  # the engine's modes: no record, stash, replay; each with a final window or not
        for final in (None, ctx.t(k - 1, c, dtype=dt)):
            ctx.launch(f"gdn_conv_gates{name}{' final' if final is not None else ''}", "_gdn_conv_gates_kernel",
                       q.gdn_conv_gates, window, mixed, conv_w, ba, a_neg, dt_bias, final_window=final, **kw)
    ctx.launch("gdn_conv_gates replay final live", "_gdn_conv_gates_kernel", q.gdn_conv_gates, window, mixed, conv_w,
               ba, a_neg, dt_bias, final_window=ctx.t(k - 1, c, dtype=dt), live=ctx.torch.ones(1, dtype=ctx.torch.int32),
               **records[" replay"])
    ctx.launch("gated_rms_norm", "_gated_norm_kernel", q.gated_rms_norm, ctx.t(t, hv, dv, dtype="f32"),
               ctx.t(t, hv * dv, dtype=dt), ctx.t(dv, dtype=dt), 1e-6)


# MoE shapes (experts, hidden, expert intermediate, top-k): Qwen3-30B-A3B, Qwen3.5-35B-A3B, and an
# odd one off every tile (masked I, hidden and K tiles; k not a power of two).
MOE_SHAPES = ((128, 2048, 768, 8), (256, 2048, 512, 8), (8, 80, 48, 3))


def _moe(ctx, dt):
    mo = ctx.k.moe
    for n_exp, h, inter, k in MOE_SHAPES:
        for rows in (16, 33):  # a verify step; two row tiles
            ctx.launch(f"moe_swiglu E{n_exp} h{h} I{inter} k{k} rows{rows}",
                       ("_moe_gate_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"), mo.moe_swiglu,
                       ctx.t(rows, h, dtype=dt), ctx.t(rows, k, dtype=dt), ctx.torch.zeros(rows, k, dtype=ctx.torch.int64),
                       ctx.t(n_exp, 2 * inter, h, dtype=dt), ctx.t(n_exp, h, inter, dtype=dt))
        # the router's picks: a step's 16 rows (live rows, the count in the launch; renormalised, Gemma's
        # scale) and a prefill's tiles (every row live, no fused count; unnormalised and unscaled), so every
        # flag compiles both ways
        for rows, step in ((16, True), (80, False)):
            ctx.launch(f"moe_route E{n_exp} k{k} rows{rows}", "_moe_route_kernel", ctx.k.moe_route.moe_route,
                       ctx.t(rows, n_exp, dtype=dt), k, step, ctx.torch.ones(1, dtype=ctx.torch.int32) if step else None,
                       ctx.torch.zeros(2, dtype=ctx.torch.int64) if step else None,
                       ctx.t(n_exp, dtype=dt) if step else None)
        # the router's matmul and picks in one launch: a step's (live rows, counted; Gemma's scale and
        # router norm) and a bare call, so its flags compile both ways
        for rows, step in ((16, True), (1, False)):
            ctx.launch(f"router_route E{n_exp} h{h} k{k} rows{rows}", "_router_route_kernel",
                       ctx.k.moe_route.router_route, ctx.t(rows, h, dtype=dt), ctx.t(n_exp, h, dtype=dt), k, step,
                       ctx.torch.ones(1, dtype=ctx.torch.int32) if step else None,
                       ctx.torch.zeros(2, dtype=ctx.torch.int64) if step else None,
                       ctx.t(n_exp, dtype=dt) if step else None,
                       (ctx.t(h, dtype=dt), h ** -0.5, 1e-6) if step else None,
                       routed=ctx.torch.zeros(n_exp, dtype=ctx.torch.int32) if step else None)  # a step's ranked list
        # a plain decode step's: one row routed of the 16 (the host bound), the rest stored as padding
        ctx.launch(f"router_route plain E{n_exp} h{h} k{k}", "_router_route_kernel", ctx.k.moe_route.router_route,
                   ctx.t(16, h, dtype=dt), ctx.t(n_exp, h, dtype=dt), k, True, ctx.torch.ones(1, dtype=ctx.torch.int32),
                   ctx.torch.zeros(2, dtype=ctx.torch.int64), routed=ctx.torch.zeros(n_exp, dtype=ctx.torch.int32),
                   bound=1)
        # a step's sparse-layer end: the residual add and the next norm in the combine's launch (NORM)
        ctx.launch(f"moe_swiglu_add_rms_norm E{n_exp} h{h} I{inter} k{k}", "_moe_combine_kernel",
                   mo.moe_swiglu_add_rms_norm, ctx.t(16, h, dtype=dt), ctx.t(16, k, dtype=dt),
                   ctx.torch.zeros(16, k, dtype=ctx.torch.int64), ctx.t(n_exp, 2 * inter, h, dtype=dt),
                   ctx.t(n_exp, h, inter, dtype=dt), ctx.t(16, h, dtype=dt), ctx.t(h, dtype=dt), 1e-6)
        # Qwen3.5 MoE's layer end: the gated shared expert and the zero-centred norm too (SHARED, ZERO_CENTRED)
        ctx.launch(f"moe_swiglu_shared_add_rms_norm_1p E{n_exp} h{h} I{inter} k{k}", "_moe_combine_kernel",
                   mo.moe_swiglu_shared_add_rms_norm_1p, ctx.t(16, h, dtype=dt), ctx.t(16, k, dtype=dt),
                   ctx.torch.zeros(16, k, dtype=ctx.torch.int64), ctx.t(n_exp, 2 * inter, h, dtype=dt),
                   ctx.t(n_exp, h, inter, dtype=dt), ctx.t(16, h, dtype=dt), ctx.t(16, 1, dtype=dt),
                   ctx.t(16, h, dtype=dt), ctx.t(h, dtype="f32"), 1e-6)
        # the matmuls' other grid (ITEMS on: a program per multiprocessor over the work items, the A/B's `x1` tiles)
        ctx.launch(f"moe_swiglu work items E{n_exp} h{h} I{inter} k{k}", ("_moe_gate_up_kernel", "_moe_down_kernel"),
                   mo.moe_swiglu, ctx.t(16, h, dtype=dt), ctx.t(16, k, dtype=dt),
                   ctx.torch.zeros(16, k, dtype=ctx.torch.int64), ctx.t(n_exp, 2 * inter, h, dtype=dt),
                   ctx.t(n_exp, h, inter, dtype=dt), config=mo.MoeConfig(programs_per_sm=1))
        # a step's matmuls over the router's ranked list (ROUTED), on the grid and on the work items
        for sms in (0, 1):
            ctx.launch(f"moe_swiglu routed x{sms} E{n_exp} h{h} I{inter} k{k}",
                       ("_moe_gate_up_kernel", "_moe_down_kernel"), mo.moe_swiglu, ctx.t(16, h, dtype=dt),
                       ctx.t(16, k, dtype=dt), ctx.torch.zeros(16, k, dtype=ctx.torch.int64),
                       ctx.t(n_exp, 2 * inter, h, dtype=dt), ctx.t(n_exp, h, inter, dtype=dt),
                       config=mo.MoeConfig(programs_per_sm=sms), routed=ctx.torch.zeros(n_exp, dtype=ctx.torch.int32))
    n_exp, h, inter, k = MOE_SHAPES[-1]  # Gemma 4's GELU-tanh experts: the gate/up epilogue's other branch
    # and its layer end in the combine (GEMMA: the sandwich norms, the add, the scalar, the next norm)
    ctx.launch(f"moe_gemma_add_norm E{n_exp} h{h} I{inter} k{k}", "_moe_combine_kernel", mo.moe_gemma_add_norm,
               ctx.t(16, h, dtype=dt), ctx.t(16, k, dtype=dt), ctx.torch.zeros(16, k, dtype=ctx.torch.int64),
               ctx.t(n_exp, 2 * inter, h, dtype=dt), ctx.t(n_exp, h, inter, dtype=dt), ctx.t(16, h, dtype=dt),
               ctx.t(16, h, dtype=dt), tuple(ctx.t(h, dtype=dt) for _ in range(3)), ctx.t(h, dtype=dt), 1e-6,
               ctx.t(1, dtype=dt))
    ctx.launch(f"moe_swiglu gelu_tanh E{n_exp} h{h} I{inter} k{k}", "_moe_gate_up_kernel", mo.moe_swiglu,
               ctx.t(16, h, dtype=dt), ctx.t(16, k, dtype=dt), ctx.torch.zeros(16, k, dtype=ctx.torch.int64),
               ctx.t(n_exp, 2 * inter, h, dtype=dt), ctx.t(n_exp, h, inter, dtype=dt), "gelu_tanh")


# Costs: seconds a case took on one CPU core with an empty cache (they only balance the shards).
for _dt in DTYPES:
    _f32 = _dt == "f32"  # float32 dots (IEEE, no tensor cores) take the compiler longer
    _case(f"norm-{_dt}", _norm, _dt, 0.8)
    _case(f"rope-{_dt}", _rope, _dt, 0.3)
    _case(f"activation-{_dt}", _activation, _dt, 0.1)
    _case(f"argmax-{_dt}", _argmax, _dt, 0.2)
    _case(f"attention-{_dt}", _attention, _dt, 6.5 if _f32 else 2.0)
    _case(f"deltanet-{_dt}", _deltanet, _dt, 1.7)
    _case(f"gather-{_dt}", _gather, _dt, 0.3)
    _case(f"markov-{_dt}", _markov, _dt, 0.8)
    _case(f"qwen35-{_dt}", _qwen35, _dt, 2.3)
    _case(f"gemma4-{_dt}", _gemma4, _dt, 0.6)
    for _q in ("q8_0", "q4_0"):
        _case(f"quant_linear-{_q}-tuned-{_dt}", _quant_linear, (_q, _dt, "tuned"), 4.5 if _f32 else 1.5)
        _case(f"quant_linear-{_q}-heuristic-{_dt}", _quant_linear, (_q, _dt, "heuristic"), 2.1 if _f32 else 0.8)
    _case(f"quant_linear-scale_after-{_dt}", _quant_scale_after, _dt, 2.2 if _f32 else 0.7)
    _case(f"quant_linear-mantissa-{_dt}", _quant_mantissa, _dt, 3.0 if _f32 else 1.2)
    _case(f"dense_linear-{_dt}", _dense_linear, _dt, 2.0 if _f32 else 0.8)
    _case(f"moe-{_dt}", _moe, _dt, 1.0)
_case("pack_round", _pack_round, None, 0.2)
_case("settle_round", _settle, None, 0.4)
_case("pack_round-pdl", _pack_round, None, 0.2)
_case("settle_round-pdl", _settle, None, 0.4)


def _pdl_on(case: str) -> bool:
    """Programmatic dependent launch (kernels/_pdl.py) for a case: on for the bf16 cases (the
    GPU's dtype, and PDL is on by default there) and the `-pdl` twins, off for the f32 ones, so
    every kernel compiles its `PDL` flag both ways."""
    return case.endswith("-bf16") or case.endswith("-pdl")


# --------------------------------------------------------------------------------------------
# Worker: this file run as a script, with TRITON_INTERPRET unset
# --------------------------------------------------------------------------------------------


def _sm90_driver(records):
    """A stand-in for Triton's CUDA driver: one H200 (sm_90), stream 0, a launcher that records
    what it was asked to launch and launches nothing."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": SM90_MAX_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536,
                    "warpSize": 32, "arch": "sm_90"}

        def load_binary(self, name, kernel, shared, device):
            return None, None, 0, 0, 1024  # module, function, n_regs, n_spills, max threads a block

    class Launcher:
        def __init__(self, src, metadata):
            fn = src.fn
            const = {p.name: src.constants[(p.num,)] for p in fn.params if p.is_constexpr}
            self.record = {
                "kernel": fn.__name__,
                "module": fn.fn.__module__,
                "constexprs": {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in const.items()},
                "signature": {k: str(v) for k, v in src.signature.items() if v != "constexpr"},
                "num_warps": metadata.num_warps,
                "num_stages": metadata.num_stages,
                "shared": metadata.shared,
                "launch_pdl": bool(getattr(metadata, "launch_pdl", False)),
            }

        def __call__(self, *args, **kwargs):
            records.append(dict(self.record))

    class Sm90Driver(DriverBase):
        def __init__(self):
            self.utils = Utils()
            self.launcher_cls = Launcher

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

    return Sm90Driver()


def _import_kernels():
    """This checkout's kernels/ as `memra_kernels` (as conftest.py aliases it), every module."""
    import importlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("memra_kernels", KERNELS / "__init__.py",
                                                  submodule_search_locations=[str(KERNELS)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["memra_kernels"] = pkg
    spec.loader.exec_module(pkg)
    for path in sorted(KERNELS.glob("*.py")):
        if path.stem != "__init__":
            setattr(pkg, path.stem, importlib.import_module(f"memra_kernels.{path.stem}"))
    return pkg


def _relax_checks(pkg):
    """The wrappers refuse CPU tensors unless TRITON_INTERPRET is set (`_common.check_tensors`,
    `quant_linear`'s own check). Here only that refusal goes: tensors must still share a device.
    quant_linear reads one flag for the check and for WIDEN (the interpreter's bf16 workaround),
    so the check sees it set and its launch sees it clear (WIDEN False, as on the GPU)."""
    common = pkg._common
    original = common.check_tensors

    def check_tensors(*tensors):
        device = tensors[0].device
        for x in tensors:
            if x.device != device:
                raise ValueError(f"tensors on different devices: {x.device} vs {device}")

    for path in KERNELS.glob("*.py"):
        mod = sys.modules.get(f"memra_kernels.{path.stem}")
        if mod is None:
            continue
        for name, value in list(vars(mod).items()):
            if value is original:  # `from ._common import check_tensors` (under any name)
                setattr(mod, name, check_tensors)
    ql = pkg.quant_linear
    ql._INTERPRET = True
    launch = ql._launch

    def _launch(*args, **kwargs):
        ql._INTERPRET = False
        try:
            return launch(*args, **kwargs)
        finally:
            ql._INTERPRET = True

    ql._launch = _launch


def _jit_functions(pkg):
    """{module: {@triton.jit function defined there: whether the module launches it}}, launched
    meaning `name[grid](...)` in its source (the others are helpers that kernels call)."""
    from triton.runtime.jit import JITFunction

    out = {}
    for path in sorted(KERNELS.glob("*.py")):
        if path.stem.startswith("_"):  # __init__ and the shared helpers (_pdl's pdl_wait), no launches
            continue
        mod = getattr(pkg, path.stem)
        src = path.read_text()
        out[path.stem] = {name: bool(re.search(rf"(?<![\w.]){re.escape(name)}\s*\[", src))
                          for name, obj in vars(mod).items()
                          if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__}
    return out


class _Ctx:
    def __init__(self, torch, pkg, records):
        self.torch, self.k, self.records = torch, pkg, records
        self.errors: list[str] = []
        self.calls = 0

    def dtype(self, name):
        return {"bf16": self.torch.bfloat16, "f32": self.torch.float32}[name]

    def t(self, *shape, dtype):
        return self.torch.empty(shape, dtype=self.dtype(dtype))

    def idx(self, n):
        return self.torch.zeros(n, dtype=self.torch.int64)

    def packed(self, qtype, n, k):
        torch, qp = self.torch, self.k.quant_pack
        q = torch.empty((n, k), dtype=torch.int8) if qtype == "q8_0" else torch.empty((n, k // 2), dtype=torch.uint8)
        return qp.Packed(qtype, (n, k), q, torch.empty((n, k // 32), dtype=torch.float16))

    def launch(self, label, expect, fn, *args, **kwargs):
        """Call a wrapper; an exception (a compile error among them) or a kernel in `expect` that
        it did not launch is an error of the case."""
        expect = (expect,) if isinstance(expect, str) else tuple(expect)
        before = len(self.records)
        self.calls += 1
        try:
            fn(*args, **kwargs)
        except Exception:
            self.errors.append(f"{label}:\n{traceback.format_exc()[-6000:]}")
            return
        launched = {r["kernel"] for r in self.records[before:]}
        missing = [k for k in expect if k not in launched]
        if missing:
            self.errors.append(f"{label}: launched {sorted(launched)}, not {missing} (a fallback?)")


def _constants(pkg):
    from dataclasses import asdict

    a, dn, qt = pkg.attention, pkg.deltanet, pkg.quant_tuning
    return {
        "attention_tiles": {str(k): asdict(v) for k, v in a.TILES.items()},
        "attention_draft_tiles": {str(k): asdict(v) for k, v in a.DRAFT_TILES.items()},
        "attention_f32_stages": {str(k): v for k, v in a.FLOAT32_MAX_STAGES.items()},
        "deltanet": {"BLOCK_V": dn.BLOCK_V, "REC_WARPS": dn.REC_WARPS, "LATE_PREP": dn.LATE_PREP,
                     "PREFETCH": dn.PREFETCH},
        "quant_tuned": [[list(key), asdict(cfg)] for key, cfg in qt.TUNED.items()],
    }


def _worker(out_path, names):
    sys.path.insert(0, str(ROOT))  # this checkout's memra_cli (quant_linear imports it)
    import torch
    from triton.runtime.driver import driver

    records: list[dict] = []
    driver.set_active(_sm90_driver(records))
    pkg = _import_kernels()
    _relax_checks(pkg)
    result = {"cases": {}, "jit": _jit_functions(pkg), "constants": _constants(pkg)}
    for name in names:
        fn, arg, _ = CASES[name]
        pkg._pdl.enabled = lambda device, on=_pdl_on(name): on  # what pdl_args consults
        ctx = _Ctx(torch, pkg, records)
        start, first = time.perf_counter(), len(records)
        try:
            fn(ctx, arg)
        except Exception:
            ctx.errors.append(f"case {name}:\n{traceback.format_exc()[-6000:]}")
        result["cases"][name] = {"records": records[first:], "errors": ctx.errors, "calls": ctx.calls,
                                 "seconds": round(time.perf_counter() - start, 2)}
    Path(out_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------
# The tests (pytest process): shards of the cases in subprocesses, then checks on their records
# --------------------------------------------------------------------------------------------


def _toolchain_missing() -> str | None:
    try:
        from triton.backends import backends
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"triton is not importable ({exc})"
    if "nvidia" not in backends:
        return "Triton's nvidia backend is not installed"
    try:
        from triton import knobs

        ptxas = knobs.nvidia.ptxas.path
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"no ptxas for Triton's nvidia backend ({exc})"
    if not ptxas or not os.access(ptxas, os.X_OK):
        return f"ptxas not executable: {ptxas!r}"
    return None


def _shards(n):
    """Greedy by cost, largest first: n lists of case names."""
    shards = [[0.0, []] for _ in range(n)]
    for name, (_, _, cost) in sorted(CASES.items(), key=lambda kv: -kv[1][2]):
        shard = min(shards, key=lambda s: s[0])
        shard[0] += cost
        shard[1].append(name)
    return [names for _, names in shards if names]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    reason = _toolchain_missing()
    if reason:
        pytest.skip(f"sm_90 compile needs Triton's nvidia backend and ptxas: {reason}")
    tmp = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    procs = []
    for i, names in enumerate(_shards(max(1, min(cpus, 4)))):
        out = tmp / f"shard{i}.json"
        log = open(tmp / f"shard{i}.log", "w+")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), *names]
        procs.append((names, out, log, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)))
    result = {"cases": {}, "jit": None, "constants": None, "crashed": {}}
    start = time.perf_counter()
    for names, out, log, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, WORKER_TIMEOUT_S - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.seek(0)
        text = log.read()
        log.close()
        if rc != 0 or not out.exists():
            for name in names:
                result["crashed"][name] = f"worker exit {rc}:\n{text[-6000:]}"
            continue
        part = json.loads(out.read_text())
        result["cases"].update(part["cases"])
        result["jit"], result["constants"] = part["jit"], part["constants"]
    return result


def _records(compiled, kernel=None):
    return [r for c in compiled["cases"].values() for r in c["records"] if kernel is None or r["kernel"] == kernel]


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_sm90(compiled, name):
    """The case's wrappers compiled for sm_90 (to a cubin) and launched what they should."""
    if name in compiled["crashed"]:
        pytest.fail(compiled["crashed"][name])
    case = compiled["cases"][name]
    assert not case["errors"], "\n\n".join(case["errors"])
    assert case["records"], "no launch recorded"


def _need_records(compiled):
    if not compiled["cases"] or compiled["jit"] is None:
        pytest.fail("no worker finished: see test_compiles_for_sm90")


def test_every_launched_kernel_compiled(compiled):
    """Each kernel that kernels/*.py launches compiled at least once (a new kernel needs a case)."""
    _need_records(compiled)
    for module, fns in compiled["jit"].items():  # the scan still finds the launches
        assert not fns or any(fns.values()), f"kernels/{module}.py: no launch of {sorted(fns)} found"
    launched = {name for fns in compiled["jit"].values() for name, is_launched in fns.items() if is_launched}
    missing = launched - {r["kernel"] for r in _records(compiled)}
    assert not missing, f"never compiled: {sorted(missing)}"


def test_every_flag_both_ways(compiled):
    """Every boolean constexpr compiled True and False; interpreter-only ones False only."""
    _need_records(compiled)
    values: dict[tuple, set] = {}
    for r in _records(compiled):
        for k, v in r["constexprs"].items():
            if isinstance(v, bool):
                values.setdefault((r["kernel"], k), set()).add(v)
    assert values
    for (kernel, flag), seen in sorted(values.items()):
        want = {False} if flag in INTERPRETER_ONLY else {False, True}
        assert seen == want, f"{kernel}.{flag}: compiled {sorted(seen)}, want {sorted(want)}"


def test_pdl_launch_matches_wait(compiled):
    """Every launched kernel has the `PDL` flag, and a kernel launched with the PDL attribute is
    the variant that waits for the previous kernel (PDL True) and the other way round: a PDL
    launch of a kernel that does not wait could read what the previous kernel is still writing."""
    _need_records(compiled)
    from test_pdl import PLAIN_ORDER

    records = _records(compiled)
    assert {r["launch_pdl"] for r in records} == {False, True}
    for r in records:
        if r["kernel"] in PLAIN_ORDER:
            assert not r["launch_pdl"] and "PDL" not in r["constexprs"], r["kernel"]
            continue
        assert "PDL" in r["constexprs"], f"{r['kernel']} has no PDL flag"
        assert r["constexprs"]["PDL"] is r["launch_pdl"], \
            f"{r['kernel']}: launch_pdl={r['launch_pdl']} but PDL={r['constexprs']['PDL']}"


def _dtype_of(record, arg):
    return record["signature"][arg].lstrip("*")


def test_engine_tiles_compiled(compiled):
    """The module tile constants the engine launches compiled as they stand, in bf16 and f32."""
    _need_records(compiled)
    const = compiled["constants"]
    split = _records(compiled, "_split_kernel")
    for hd_class, tile in const["attention_tiles"].items():
        for dt in ("bf16", "fp32"):
            stages = tile["num_stages"] if dt == "bf16" else \
                min(tile["num_stages"], const["attention_f32_stages"].get(hd_class, tile["num_stages"]))
            assert any(r["constexprs"]["SPLIT"] == tile["split"] and r["constexprs"]["BLOCK_N"] == tile["block_n"]
                       and r["constexprs"]["BLOCK_M"] == tile["block_m"] and r["num_warps"] == tile["num_warps"]
                       and r["num_stages"] == stages and 64 < r["constexprs"]["BLOCK_D"] <= int(hd_class)
                       and r["constexprs"]["BLOCK_DV"] == (tile["block_dv"] or r["constexprs"]["BLOCK_D"])
                       and _dtype_of(r, "q_ptr") == dt for r in split), f"attention TILES[{hd_class}] {dt}"
    for hd_class, tile in const["attention_draft_tiles"].items():  # a drafter's storage of one split: DIRECT
        for dt in ("bf16", "fp32"):
            assert any(r["constexprs"]["SPLIT"] == tile["split"] and r["constexprs"]["BLOCK_N"] == tile["block_n"]
                       and r["constexprs"]["BLOCK_M"] == tile["block_m"] and r["num_warps"] == tile["num_warps"]
                       and r["constexprs"]["DIRECT"] is True and 64 < r["constexprs"]["BLOCK_D"] <= int(hd_class)
                       and _dtype_of(r, "q_ptr") == dt for r in split), f"attention DRAFT_TILES[{hd_class}] {dt}"
    dn = const["deltanet"]
    gdn = _records(compiled, "_gdn_kernel")
    for late in (True, False):
        for dt in ("bf16", "fp32"):
            assert any(r["constexprs"]["LATE_PREP"] is late and r["constexprs"]["BLOCK_V"] == dn["BLOCK_V"]
                       and r["constexprs"]["PREFETCH"] == dn["PREFETCH"]
                       and r["num_warps"] == dn["REC_WARPS"] and _dtype_of(r, "qkv_ptr") == dt for r in gdn), \
                f"_gdn_kernel LATE_PREP={late} {dt}"
    assert {r["constexprs"]["PREFETCH"] for r in gdn} == {1, 2}
    quant = _records(compiled, "_quant_linear_kernel")
    for (qtype, n, k), cfg in const["quant_tuned"]:
        for dt in ("bf16", "fp32"):
            assert any(r["constexprs"]["Q4"] == (qtype == "q4_0") and r["constexprs"]["BLOCK_M"] == cfg["block_m"]
                       and r["constexprs"]["BLOCK_N"] == cfg["block_n"] and r["constexprs"]["BLOCK_K"] == cfg["block_k"]
                       and r["constexprs"]["SPLIT"] == (cfg["split_k"] > 1)
                       and r["constexprs"]["SCALE_AFTER"] == cfg["scale_after_dot"]
                       and r["constexprs"]["SWAP"] == cfg["swap_ab"] and r["num_warps"] == cfg["num_warps"]
                       and r["num_stages"] == cfg["num_stages"] and _dtype_of(r, "x_ptr") == dt
                       for r in quant), f"TUNED {qtype} {n}x{k} {dt}"


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker OUT.json CASE...  (run the tests with pytest)")
