"""The fixed-width step's fused operations, behind one seam: plain torch or Triton kernels.

A model's `static_step` calls only these operations (plus its weight matmuls), so the same
model code runs the torch reference on any device and the fused kernels of `memra_kernels` on
CUDA. The drafter (models/drafter.py) calls them too: its norms and SiLU·mul on every path, and
in its static round and ingest the q/k norm + rope + K/V write and (plain layers) the attention,
with every block row at the block's last position, which makes the causal rule "ctx + the whole
block". Both implementations are row-count invariant (a row's result never depends on the other
rows of its step or on the storage size), which is what keeps fixed-width steps bit-exact.

- `linear(x, w, bias=None) -> x @ w.T (+ bias)`: a step's weight matmul (`w` a plain `[out, in]`
  weight or a quantized linear module); with the kernels, the few-row dense kernel
  (`memra_kernels.dense_linear`) for the weight shapes it was measured faster on, cuBLAS else
- `rms_norm(x, w, eps)`; `add_rms_norm(x, residual, w, eps) -> (normed, x + residual)`
- `linear_add_rms_norm(a, w, bias, residual, norm_w, eps, consumer=None) -> (h, x)`:
  `add_rms_norm(linear(a, w, bias), residual, norm_w, eps)`, a layer's output projection and the
  norm after it; with the kernels, where `linear` takes the dense kernel for both `w` and the
  weight `consumer` that will multiply `h`, one launch, and `h` a `dense_linear.PendingNorm`
  (the residual add in the projection's epilogue, the norm applied by the consumer as it loads its
  rows; `swiglu`, `linear`, `qkv_rope_kv_write` and `lm_head_argmax` take one, and norm it with
  `norm.rms_norm_partials` where they cannot fold it, the same bits): the statistic summed in one
  fixed order, which may differ from `add_rms_norm`'s kernel in its last ulp
- `qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh, nkv, eps) -> q`
- `rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache, nh, nkv) -> q`: the same without
  the q/k norm (LLaMA), hd the tables' width
- `qkv_rope_kv_write(h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh, nkv,
  eps) -> q`: `linear(h, w_qkv, b_qkv)` then `qk_norm_rope_kv_write` (norms None: `rope_kv_write`);
  with the kernels, where `linear` takes the dense kernel, one launch (the norm, rope and K/V write
  in its epilogue: the projection's bits, then the rope kernel's arithmetic, its norm's float32 sum
  of squares perhaps in another order)
- `attention(q, k_cache, v_cache, positions, scale, window=0) -> [t, nh*hd]`: causal by position
  over the cache; with a sliding `window` W > 0 a row at p sees keys p - W < j <= p only (Gemma 4)
- `silu_mul(gate_up) -> silu(gate) * up`
- `moe_swiglu(x, weights, experts, w_gate_up, w_down, activation="silu") -> [t, hidden]`: the
  routed experts' GLU (SwiGLU, or `activation="gelu_tanh"`: Gemma 4's) and weighted combine
  (memra_kernels.moe_ref; with the kernels, `memra_kernels.moe`: each routed expert read once per
  32 rows, the ids read on the device)
- `moe_swiglu_add_rms_norm(x, weights, experts, w_gate_up, w_down, residual, norm_w, eps,
  activation="silu") -> (normed, residual + out)`: `moe_swiglu` then `add_rms_norm`, a sparse
  layer's end (with the kernels the add and norm run in the combine's launch:
  `memra_kernels.moe.moe_swiglu_add_rms_norm`)
- `moe_swiglu_shared_add_rms_norm_1p(x, weights, experts, w_gate_up, w_down, shared, gate, residual,
  w1p, eps) -> (normed, residual + ff)`: `ff = moe_swiglu(...) + sigmoid(gate) * shared`, then
  `add_rms_norm_1p` (the Qwen3.5 MoE hybrid's layer end; with the kernels the gated shared expert,
  the add and the zero-centred norm in the combine's launch:
  `memra_kernels.moe.moe_swiglu_shared_add_rms_norm_1p`)
- `router_route(x, router, k, normalize, live=None, counts=None, scale=None, pre_norm=None) ->
  (weights, ids)`: `moe_route(linear(x, router), ...)`, a router's logits and picks (with the
  kernels, for a step's rows, one launch: `memra_kernels.moe_route.router_route`); `pre_norm`
  `(weight, factor, eps)`: Gemma 4's router norm of x first (in that launch with the kernels)
- `moe_route(logits, k, normalize, live=None, counts=None, scale=None) -> (weights, ids)`: a
  router's picks from its logits `[t, E]` (softmax in float32, top-k with ties to the lower
  index, renormalised, a per-expert scale, cast; rows from `live` on routed to no expert; the
  call's distinct experts added to `counts`) (memra_kernels.moe_route_ref; with the kernels one
  launch of `memra_kernels.moe_route` instead of ~14)
- `swiglu(x, w_gate_up) -> silu_mul(linear(x, w_gate_up))`: the MLP's fused gate/up matmul and
  its activation; with the kernels one launch of the dense kernel (the activation in its
  epilogue, the same bits as the two launches) wherever `linear` would take that kernel, and of
  the q8_0 / q4_0 kernel for a quantized drafter's fused gate/up
- `prefill_attention(q, keys, values, mask) -> [t, nh*hd]`: a prefill chunk's attention (rows at
  the cache's last positions, causal by position; `mask` the forward's folded boolean mask,
  built only when `prefill_mask` is True)
- `embed(ids, weight) -> rows`: an embedding lookup (a copy of the rows)
- `embed_rms_norm(ids, weight, norm_w, eps) -> (normed, rows)`: `embed` then `rms_norm` of its rows,
  a step's first norm (one launch with the kernels, the bits of the two); `embed_rms_norm_1p`
  the same with the zero-centred `rms_norm_1p` (Qwen3.5's)
- `confidence_raw(hidden, w, b, prev=None, w1=None) -> f32 [n]`: DSpark's accept-rate head
- `pack_round(cand, sel, raws=None) -> f64`: a graphed round's one host read, packed
- `settle_round(cand, sel, raws, inputs, threshold, kind=, cap=, adapt=, restore=None, ring=0, cost=None) -> f64`:
  a chained round's settlement on the device (window, accepted prefix, next inputs written into
  `inputs`; with `restore`, the ring rows a recurrent state's restore re-runs) and its packed
  output (memra_kernels.settle_ref; one launch with the kernels instead of ~30)
- `markov_chain(logits, anchor, w1, w2, dtype, host_loop=False) -> tokens`: DSpark's greedy chain
  (the drafter's side of a round; with the kernels one launch per slot, or one launch in all over
  a bias table built once where the vocabulary is small; with torch ~6 ops a slot, or 3 over the
  same table, built once row by row, or, for an eager caller on the CPU, a numpy loop over that
  table: the same picks)
- `lm_head_argmax(h, w) -> (logits, picks)`: `linear(h, w)` (model dtype) and its `argmax`, a
  greedy step's head; with the kernels, where `linear` takes the dense kernel with unsplit tiles,
  one launch (the argmax in its epilogue, the same picks)
- `argmax(x) -> int64 [rows]`: each row's `torch.argmax` (first index among equal maxima, NaN
  as the maximum), a greedy round's picks from its logits (one program per row with the
  kernels: torch's generic reduce is slow for 16 rows; kernels/argmax.py)
- `conv_silu(window, x, w)`: Gated DeltaNet's causal conv update + SiLU over a step's rows
- `gated_delta_rule(qkv, g, beta, state, n_k_heads, final, stash, stash_idx, live) -> out`: its
  recurrence over the rows (float32 state; final state and per-row stash written on request);
  `live` (int32 `[1]`, on the device) marks the rows from it on as a fixed step's padding: not
  run (zero outputs), `final` after the last live row
- `gated_delta_replay(qkv, g, beta, state, n_k_heads, row0, rows, final)`: that recurrence for
  every layer at once over recorded ring rows (a rollback's replay: one launch with the kernels);
  `gated_delta_replay_dev(..., params, final)` the same with `(row0, rows)` read on the device
  (rows -1: nothing written), and `ring_window(base, xs, params, out)` the conv windows after
  those rows: a rollback as a CUDA graph captured once, or inside a round's graph
  (models/qwen3_5.py `Qwen35State.restore_round`). Neither reads a value on the host, in torch
  either (there every ring row runs, masked: a graph body's form, not the CPU's rollback);
  `gated_delta_restore(..., params, final, window, xs, final_window, live)` both at once (one
  launch with the kernels), with `live` (the recorded step's live rows) a kept count equal to it
  read as -1 (the step wrote that state and window); `stash_restore(stash, params, width, final,
  window, xs, final_window)` stash mode's: the last kept row's stashed states and the windows

Qwen3.5's (models/qwen3_5.py; every norm but the DeltaNet's gated one is zero-centred, `w1p` the
float32 `1 + w`):

- `rms_norm_1p(x, w1p, eps)`; `add_rms_norm_1p(x, residual, w1p, eps) -> (normed, x + residual)`
- `gated_qk_norm_rope_kv_write(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh,
  nkv, eps) -> q`: gated attention's q/k norms + partial rope + K/V write, from the projection
  whose query heads carry their output gate (`[q | gate]` per head); the gate stays there
- `output_gate(out, qgkv, nh) -> out * sigmoid(gate)`, the gate read from the projection
- `gated_attention(q, k_cache, v_cache, positions, scale, qgkv, nh)`: `attention` then
  `output_gate` (with the kernels, the gate is applied in the attention's combine launch)
- `gdn_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay) -> (g, beta)`: the DeltaNet's
  decay and write strength, plus (with `ring_idx`) the step's rollback record into the ring
- `gdn_conv_gates(window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs_ring, replay_rings,
  final_window) -> (conv_out, g, beta)`: `conv_silu` then `gdn_gates` as one op (one launch with
  the kernels, the same bits as the two), `replay_rings = (qkv_ring, g_ring, beta_ring)` taking
  its own conv output; with `final_window [K-1, C]` also the conv window after the last row
  (after the last live row, with `live`)
- `gated_rms_norm(core, z, w, eps) -> [t, Hv*dv]`: the per-head gated norm of the recurrence output
Gemma 4's (models/gemma4.py; memra_kernels.gemma4, twins in gemma4_ref):

- `gemma_qk_norm_rope_kv_write(proj, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh, nkv,
  eps, k_eq_v) -> q`: Gemma's q/k norms (weight before the cast) + rope + the unweighted v norm
  (v the raw key projection with k_eq_v) + the K/V write; caches None: a KV-shared layer's q only
- `gemma_add_norm(x, branch, w_branch, w_out, eps, scalar=None) -> (x, normed)`: a sandwich norm's
  residual add `x + norm(branch)` (times `layer_scalar` after the feed-forward) and the norm after it
- `gemma_add_two_norms(x, branch, w_branch, w_out, w_out2, eps) -> (x, normed, normed2)`:
  `gemma_add_norm` and a second norm of the new residual (the MoE block's pre_ff_2 beside pre_ff)
- `moe_gemma_add_norm(x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next, eps,
  scalar) -> (x, normed)`: Gemma 4's MoE layer end, `gemma_add_norm(residual, norm(dense, post_1) +
  norm(moe_swiglu(..., "gelu_tanh"), post_2), post_ff, w_next, eps, scalar)` (`norms`: post_1,
  post_2, post_ff; with the kernels all in the MoE combine's launch: `memra_kernels.moe.moe_gemma_add_norm`)
- `gelu_tanh_mul(gate_up) -> gelu_tanh(gate) * up`: the GELU-tanh MLP's activation on its fused
  gate/up projection
- `softcap(z, cap, out_dtype=None)`: the logits' `cap * tanh(z / cap)` in z's dtype (out_dtype
  float32: widened in the same pass)

- `unfused()`: these ops with this seam's launch fusions undone (`embed_rms_norm` as the gather
  then the norm, `lm_head_argmax` as the matmul then the argmax, `qkv_rope_kv_write` as the
  projection then the rope op, `linear_add_rms_norm` as the projection then `add_rms_norm`,
  `moe_swiglu_add_rms_norm` as the experts then the add + norm, `router_route` as the router's
  matmul then the routing): the same bits but for the q/k/v epilogue's and the folded norms'
  float32 statistics (another summation order, as against the torch twins), more
  launches; what the GPU benchmarks time those fusions against (`target_step --variants
  triton-unfused`; the SwiGLU epilogue has its own switch, `unfused_swiglu`, variant `noglu`)
- `plain_launches()`: a context in which the ops' kernels launch in plain stream order (no
  programmatic dependent launch); a no-op for the torch ops

`TorchStepOps` is the reference numerics exactly (HF transformers' Qwen3 / Qwen3.5 order of
roundings, op for op; a float32 CPU matmul of 8+ rows sums on oneDNN, in its own order); on
the CPU its attention runs over whole key blocks aligned at position 0 (`blocked_attention`: the
live ones in an eager step), elsewhere over the whole cache storage under a position mask.
`TritonStepOps` reads only the live keys (split over
keys at a fixed size) and fuses each norm with its neighbours; its kernels round where torch
rounds, so they differ from torch only in float32 arithmetic (reduction order, exp / log).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from memra_cli.engine.errors import SettingError
from memra_cli.engine.layers.deltanet import (conv_silu_update, gated_delta_replay, gated_delta_replay_dev,
                                              gated_delta_restore, gated_delta_step, ring_window, rms_norm_1p,
                                              stash_restore)
from memra_cli.engine.layers.ops import sdpa
from memra_cli.engine.layers.rope import apply_partial_rope
from memra_kernels.activation_ref import silu_mul_ref
from memra_kernels.argmax_ref import row_argmax_ref
from memra_kernels.moe_route_ref import moe_route_ref, router_pre_norm_ref
from memra_kernels.gather_ref import confidence_raw_ref, embed_rows_ref, pack_round_ref
from memra_kernels.gemma4_ref import (gelu_tanh_mul_ref, gemma_add_norm_ref, gemma_add_two_norms_ref,
                                      gemma_qk_norm_rope_kv_write_ref,
                                      gemma_rms_norm_ref, softcap_ref)
from memra_kernels.markov_ref import markov_bias_ref, markov_chain_body
from memra_kernels.moe_ref import (moe_gemma_add_norm_ref, moe_swiglu_add_rms_norm_ref, moe_swiglu_ref,
                                   moe_swiglu_shared_add_rms_norm_1p_ref)
from memra_kernels.norm_ref import (add_rms_norm_1p_ref, add_rms_norm_ref, embed_rms_norm_1p_ref, embed_rms_norm_ref,
                                    gated_rms_norm_heads, rms_norm_ref)
from memra_kernels.qwen35_ref import gdn_gates_body, window_after
from memra_kernels.rope_ref import qk_norm_rope_kv_write_ref, rope_kv_write_ref
from memra_kernels.settle_ref import settle_round

KERNELS_ENV = "MEMRA_KERNELS"
PDL_ENV = "MEMRA_PDL"  # memra_kernels._pdl reads it at each launch; checked here so a bad value is refused up front


def unfused_swiglu(ops, x: torch.Tensor, w_gate_up) -> torch.Tensor:
    """The MLP's SwiGLU as two step ops, `ops.silu_mul(ops.linear(x, w_gate_up))`: the torch path's
    `swiglu`, the kernels' fallback where the fused launch does not apply, and what the benchmarks'
    unfused variants (`--no-glu`, target_step's `noglu`) install as `swiglu` to time the epilogue
    against. `x [t, hidden]`, `w_gate_up` `[2*ffn, hidden]` (or a linear module) -> `[t, ffn]`."""
    return ops.silu_mul(ops.linear(x, w_gate_up))


def unfused_embed_rms_norm_1p(ops, ids: torch.Tensor, weight: torch.Tensor, w1p: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`unfused_embed_rms_norm` with the zero-centred norm (`ops.rms_norm_1p`; Qwen3.5's first norm)."""
    rows = ops.embed(ids, weight)
    return ops.rms_norm_1p(rows, w1p, eps), rows


def unfused_embed_rms_norm(ops, ids: torch.Tensor, weight: torch.Tensor, norm_w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's embedding and first norm as two step ops, `(ops.rms_norm(rows, norm_w, eps), rows)`
    with `rows = ops.embed(ids, weight)`: the unfused form `unfused()` installs."""
    rows = ops.embed(ids, weight)
    return ops.rms_norm(rows, norm_w, eps), rows


def unfused_qkv_rope_kv_write(ops, h: torch.Tensor, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                              v_cache, n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """The fused projection, then the (q/k norm +) rope + K/V write, as two step ops."""
    qkv = ops.linear(h, w_qkv, b_qkv)
    if q_norm is None:
        return ops.rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache, n_heads, n_kv)
    return ops.qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, n_heads, n_kv, eps)


def unfused_linear_add_rms_norm(ops, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor,
                                eps: float, consumer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection and the residual add + norm after it as two step ops, `add_rms_norm` (the
    norm kernel's statistic: the folded one's order differs, so may its last ulp); `consumer`
    (the next weight) is unused here."""
    return ops.add_rms_norm(ops.linear(a, w, bias), residual, norm_w, eps)


def unfused_router_route(ops, x, router, k: int, normalize: bool, live=None, counts=None, scale=None,
                         pre_norm=None):
    """`ops.linear` then `ops.moe_route`: a router's logits, then its picks (the unfused form);
    `pre_norm` `(weight, factor, eps)`: Gemma 4's router norm first, in torch (`router_pre_norm_ref`)."""
    if pre_norm is not None:
        x = router_pre_norm_ref(x, *pre_norm)
    return ops.moe_route(ops.linear(x, router), k, normalize, live, counts, scale)


def unfused_moe_swiglu_add_rms_norm(ops, x, weights, experts, w_gate_up, w_down, residual, norm_w, eps: float,
                                    activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu` then `ops.add_rms_norm`: the unfused form `unfused()` installs."""
    return ops.add_rms_norm(ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation), residual, norm_w, eps)


def unfused_moe_swiglu_shared_add_rms_norm_1p(ops, x, weights, experts, w_gate_up, w_down, shared, gate, residual,
                                              w1p, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu`, the gated shared expert's torch ops, then `ops.add_rms_norm_1p`: the
    unfused form `unfused()` installs (the twin's ops, op for op)."""
    ff = ops.moe_swiglu(x, weights, experts, w_gate_up, w_down) + torch.sigmoid(gate) * shared
    return ops.add_rms_norm_1p(ff, residual, w1p, eps)


def unfused_gemma_add_two_norms(ops, x, branch, w_branch, w_out, w_out2, eps: float):
    """`ops.gemma_add_norm`, then the second norm in torch: the unfused form `unfused()` installs."""
    x, normed = ops.gemma_add_norm(x, branch, w_branch, w_out, eps)
    return x, normed, gemma_rms_norm_ref(x, w_out2, eps)


def unfused_moe_gemma_add_norm(ops, x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next,
                               eps: float, scalar) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe_swiglu` (GELU-tanh), the two post norms and their sum in torch, then
    `ops.gemma_add_norm`: the unfused form `unfused()` installs (the twin's ops, op for op)."""
    post_1, post_2, post_ff = norms
    routed = ops.moe_swiglu(x, weights, experts, w_gate_up, w_down, "gelu_tanh")
    ff = gemma_rms_norm_ref(dense, post_1, eps) + gemma_rms_norm_ref(routed, post_2, eps)
    return ops.gemma_add_norm(residual, ff, post_ff, w_next, eps, scalar)


def unfused_lm_head_argmax(ops, h: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy step's head as two step ops: `(logits, ops.argmax(logits))`, `logits = ops.linear(h, w)`."""
    logits = ops.linear(h, w)
    return logits, ops.argmax(logits)


def markov_chain_host(logits: torch.Tensor, anchor: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The greedy markov chain `tok_k = argmax(logits[k] + table[tok_{k-1}])` (`tok_-1 = anchor`)
    over CPU tensors, `logits [n, V]` (float32 or a narrower float) and the float32 bias
    `table [V_in, V]`, looped in numpy over zero-copy views. Returns int64 tokens `[n]`.

    The picks are the torch loop's, bit for bit: torch adds a narrower logit row to the float32
    bias by widening it exactly first, as `.float()` does here; a float32 add is the same IEEE
    operation in both libraries; and both argmaxes return the first index of the maximum, a NaN
    counting as the maximum. Why: the chain is ~4 tiny ops a slot, 15 slots a round for the
    embedded DSpark drafter, and torch's dispatch cost per op is several times numpy's; on the
    2-core dev CPU, inside sessions (benchmarks/cpu_round_parts.py), the torch loop took ~0.45
    ms a round and this ~0.22."""
    rows = logits.detach().float().contiguous().numpy()
    bias = table.detach().numpy()
    prev = int(anchor.reshape(-1)[0])
    out = np.empty(rows.shape[0], dtype=np.int64)
    for k in range(rows.shape[0]):
        prev = int(np.argmax(rows[k] + bias[prev]))
        out[k] = prev
    return torch.from_numpy(out)


# A float32 weight matmul of a few rows on the CPU: torch's F.linear goes to MKL's sgemm, which
# on the dev CPU (AMD EPYC, AVX-512) runs 8-16 rows at ~1.6x oneDNN's time; at 1-4 rows MKL is
# faster (docs/perf.md, "The DSpark round on the CPU"). The choice depends on the row count and
# dtype only, so a fixed-width step's rows always take the same kernel: the step-width rule holds.
ONEDNN_MIN_ROWS = 8
ONEDNN_F32 = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


def onednn_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `onednn_linear` takes this call: float32 CPU tensors, `x [t, in]`, a contiguous
    weight (and bias) of x's dtype."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() == 2
            and not x.requires_grad and not w.requires_grad and w.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` through oneDNN's matmul (`x [t, in]`, `w [out, in]` -> `[t, out]`):
    the same products, summed in oneDNN's order (float32 rounding differences only)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


ATTN_KEY_BLOCK = 64  # keys per block of blocked_attention: at most 63 masked keys past the live ones


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                      scale: float, window: int = 0) -> torch.Tensor:
    """A step's attention over the live keys only, in blocks of `ATTN_KEY_BLOCK` keys aligned at
    absolute position 0, with every row's result independent of how many blocks follow its own.

    `q [t, nh, hd]` at `positions [t]` over `k_cache, v_cache [nkv, n, hd]` -> `[t, nh*hd]` in
    q's dtype (float32 arithmetic). It reads no value on the host: a caller that knows the live
    length passes the storage cut at `key_extent` (the blocks past it are masked for every row,
    so the cut changes no bit), a graph body the whole storage. Why blocks: one matmul over a
    key count that varies (the live length, or the session's storage) sums in a BLAS order that depends
    on that count, so a row's bits would depend on the step it rode in or on the storage size
    (docs/perf.md, "The DSpark round on the CPU"). Here every matmul and row sum has a fixed
    shape per block (scores `[g*t, B]`, sums over B, weights `[g*t, B] @ [B, hd]`), the blocks
    are combined by a sequential `cumsum` in block order, and a block past a row's position is
    masked for it: exp gives exact zeros, and adding zeros changes no bit. The max is exact in
    any order. So a row's result is a function of its own keys and position only."""
    t, nh, hd = q.shape
    nkv, n = k_cache.shape[0], k_cache.shape[1]
    g, block = nh // nkv, ATTN_KEY_BLOCK
    blocks = -(-n // block)
    keys, values = k_cache, v_cache
    if n < blocks * block:  # the storage ends inside its last block: zero keys past it (masked)
        pad = (0, 0, 0, blocks * block - n)
        keys, values = F.pad(keys, pad), F.pad(values, pad)
    root = math.sqrt(scale)  # SDPA's math backend scales q and k by the root of the scale each
    wide = q.dtype != torch.float32
    qf = ((q.float() if wide else q) * root).view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, 1, g * t, hd)
    kb = ((keys.float() if wide else keys) * root).view(nkv, blocks, block, hd)
    scores = torch.matmul(qf, kb.transpose(-2, -1))  # [nkv, blocks, g*t, block]
    key_pos = torch.arange(blocks * block, device=q.device).view(blocks, 1, block)
    row_pos = positions.expand(g, t).reshape(1, g * t, 1)  # folded rows: head group major, as qf
    hidden = key_pos > row_pos  # [blocks, g*t, block]
    if window:
        hidden |= key_pos <= row_pos - window
    scores.masked_fill_(hidden, -math.inf)
    weights = scores.sub_(scores.amax(-1, keepdim=True).amax(1, keepdim=True)).exp_()
    total = weights.sum(-1, keepdim=True).cumsum(1)[:, -1]  # [nkv, g*t, 1]
    vb = (values.float() if wide else values).view(nkv, blocks, block, hd)
    out = torch.matmul(weights, vb).cumsum(1)[:, -1] / total
    out = out.to(q.dtype) if wide else out
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)


def key_extent(live: int, storage: int) -> int:
    """How many cache rows a blocked_attention call needs for keys `[0, live)`: `live` rounded
    up to whole key blocks, at most the storage (a cut there changes no row's bits)."""
    return min(-(-live // ATTN_KEY_BLOCK) * ATTN_KEY_BLOCK, storage)


class TorchStepOps:
    """The reference: plain torch, any device."""

    name = "torch"
    restores_on_device = False  # its replay and window restore read their rows on the host

    @staticmethod
    def plain_launches():
        return contextlib.nullcontext()

    moe_route = staticmethod(moe_route_ref)  # the op's one torch body

    def router_route(self, x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                     live: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None, pre_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`moe_route` of the router's logits `linear(x, router)` (model dtype), through this
        instance's two ops; `pre_norm` `(weight, factor, eps)`: x through Gemma 4's router norm
        first (`moe_route_ref.router_pre_norm_ref`)."""
        return unfused_router_route(self, x, router, k, normalize, live, counts, scale, pre_norm)

    @staticmethod
    def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ w.T (+ bias)` for a plain weight `[out, in]`; `w(x)` for a quantized linear. A
        float32 call of `ONEDNN_MIN_ROWS` rows or more on the CPU runs on oneDNN (`onednn_linear`)."""
        if isinstance(w, torch.Tensor):
            if ONEDNN_F32 and x.shape[0] >= ONEDNN_MIN_ROWS and onednn_applies(x, w, bias):
                return onednn_linear(x, w, bias)
            return F.linear(x, w, bias)
        y = w(x)
        return y if bias is None else y + bias

    # the norms' one torch bodies (memra_kernels.norm_ref; a float add is commutative, bit for bit)
    rms_norm = staticmethod(rms_norm_ref)
    add_rms_norm = staticmethod(add_rms_norm_ref)

    @classmethod
    def linear_add_rms_norm(cls, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                            consumer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm(linear(a, w, bias), residual, norm_w, eps)` -> (normed, new residual);
        `consumer` (the weight that multiplies the normed rows next) is the kernels' hint only."""
        return cls.add_rms_norm(cls.linear(a, w, bias), residual, norm_w, eps)

    qk_norm_rope_kv_write = staticmethod(qk_norm_rope_kv_write_ref)  # the op's one torch body

    rope_kv_write = staticmethod(rope_kv_write_ref)  # no q/k norm (LLaMA): the op's one torch body

    gemma_qk_norm_rope_kv_write = staticmethod(gemma_qk_norm_rope_kv_write_ref)  # Gemma 4's: its one torch body
    gemma_add_norm = staticmethod(gemma_add_norm_ref)  # Gemma 4's residual add + norms: the op's one torch body
    gemma_add_two_norms = staticmethod(gemma_add_two_norms_ref)  # and a second norm: its one torch body
    gelu_tanh_mul = staticmethod(gelu_tanh_mul_ref)  # Gemma 4's MLP activation: the op's one torch body
    softcap = staticmethod(softcap_ref)  # the logits' softcap: the op's one torch body

    @staticmethod
    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
        """Causal by position over the cache; `window` W > 0 also masks keys j <= p - W. On the
        CPU `blocked_attention` (live key blocks only, storage-size independent); elsewhere over
        the whole storage under a position mask. K/V are never repeated: the g query heads of a
        KV head are folded into rows."""
        if q.device.type == "cpu":
            return blocked_attention(q, k_cache, v_cache, positions, scale, window)
        t, nh, hd = q.shape
        nkv, n = k_cache.shape[0], k_cache.shape[1]
        g = nh // nkv
        keys = torch.arange(n, device=q.device)
        mask = keys[None, :] <= positions[:, None]
        if window:
            mask &= keys[None, :] > positions[:, None] - window
        mask = mask.repeat(g, 1)
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = sdpa(qf, k_cache, v_cache, mask, scale)
        return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    silu_mul = staticmethod(silu_mul_ref)  # the op's one torch body

    @classmethod
    def swiglu(cls, x: torch.Tensor, w_gate_up) -> torch.Tensor:
        """`silu(x @ gate.T) * (x @ up.T)` for the fused `[gate; up]` weight (or linear module)."""
        return unfused_swiglu(cls, x, w_gate_up)

    moe_swiglu = staticmethod(moe_swiglu_ref)  # the routed experts' GLU + combine: the op's one torch body
    moe_swiglu_add_rms_norm = staticmethod(moe_swiglu_add_rms_norm_ref)  # then the add + norm: its one torch body
    # Qwen3.5 MoE's layer end: the experts, the gated shared expert, the add + zero-centred norm
    moe_swiglu_shared_add_rms_norm_1p = staticmethod(moe_swiglu_shared_add_rms_norm_1p_ref)
    moe_gemma_add_norm = staticmethod(moe_gemma_add_norm_ref)  # Gemma 4's MoE layer end: its one torch body

    prefill_mask = True  # prefill_attention reads the forward's folded [g*t, n] mask

    @staticmethod
    def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """`q [t, nh, hd]` (positions n-t..n-1) over `keys/values [nkv, n, hd]` under the folded
        `mask [g*t, n]` (None: one row, which sees every key): the g query heads of a KV head are
        folded into rows, so K/V are never repeated. Returns `[t, nh*hd]`."""
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        g = nh // nkv
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = sdpa(qf, keys, values, mask)
        return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    MARKOV_TABLE_MAX_BYTES = 64 << 20  # the largest float32 bias table built (the embedded drafter's: 64 MiB)

    def __init__(self):
        self._markov_tables: dict[tuple, tuple] = {}  # (w1, w2, dtype) -> (w1, w2, table)

    markov_bias = staticmethod(markov_bias_ref)  # the chain's bias after a token: the op's one torch body

    def markov_chain(self, logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     dtype: torch.dtype, host_loop: bool = False) -> torch.Tensor:
        """Greedy chain over `logits [n, V]` (float32, or the model dtype) -> tokens `[n]`: slot k
        takes `argmax(logits[k] + linear(w1[prev], w2))` in `dtype`, prev starting at `anchor`.

        A slot's bias comes from a table of every bias row, `[V_in, V]` float32, where it fits
        (`MARKOV_TABLE_MAX_BYTES`): one gather instead of a gather, a cast, a rank-r GEMV and a
        widening. On the CPU the GEMV and its ops cost ~4x the gather + add + argmax that are
        left (the embedded drafter: 15 slots a round). The table is built once per weights, row
        by row through `markov_bias` itself, so each row is the very bits the GEMV gives (one
        GEMM over every row may sum in another order) and the chain picks what it picked without
        it; kept with references to its weights, so their addresses, its key, stay theirs.

        `host_loop`: the caller is eager, never a graph body (the proposer's eager rounds), so
        on CPU tensors over a table the loop may run in numpy (`markov_chain_host`): the same
        picks at a fraction of torch's per-op cost. A body that may be captured reads nothing on
        the host, so it keeps the torch loop (the CPU stand-ins of capture check that too)."""
        table = self._markov_table(w1, w2, dtype)
        if host_loop and table is not None and logits.device.type == "cpu":
            return markov_chain_host(logits, anchor, table)
        if table is not None:
            return markov_chain_body(logits, anchor, lambda prev: table[prev])
        return markov_chain_body(logits, anchor, lambda prev: self.markov_bias(w1, w2, prev, dtype))

    def prepare_markov(self, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> bool:
        """Build the chain's bias table now (at load) rather than in the first round; whether
        one fits. Building it reads every row: a one-time cost of loading, not of decoding."""
        return self._markov_table(w1, w2, dtype) is not None

    def _markov_table(self, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Every bias row `[V_in, V]` float32 (row p = `markov_bias(w1, w2, [p], dtype)`), built on
        first use; None where it would pass `MARKOV_TABLE_MAX_BYTES`."""
        if w1.shape[0] * w2.shape[0] * 4 > self.MARKOV_TABLE_MAX_BYTES:
            return None
        key = (w1.data_ptr(), tuple(w1.shape), w2.data_ptr(), tuple(w2.shape), dtype)
        entry = self._markov_tables.get(key)
        if entry is None:
            rows = torch.arange(w1.shape[0], device=w1.device)
            table = torch.cat([self.markov_bias(w1, w2, rows[p : p + 1], dtype) for p in range(w1.shape[0])])
            entry = self._markov_tables[key] = (w1, w2, table)
        return entry[2]

    embed = staticmethod(embed_rows_ref)  # the op's one torch body
    embed_rms_norm = staticmethod(embed_rms_norm_ref)  # the gather then the norm: the op's one torch body
    embed_rms_norm_1p = staticmethod(embed_rms_norm_1p_ref)  # the same with the zero-centred norm

    def unfused(self):
        """The torch ops fuse nothing: themselves."""
        return self

    @classmethod
    def qkv_rope_kv_write(cls, h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache,
                          n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
        """The projection, then the (q/k norm +) rope + K/V write."""
        return unfused_qkv_rope_kv_write(cls, h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                                         v_cache, n_heads, n_kv, eps)

    @classmethod
    def lm_head_argmax(cls, h: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
        """`(linear(h, w), argmax of it)`: a greedy step's model-dtype logits and picks."""
        return unfused_lm_head_argmax(cls, h, w)

    confidence_raw = staticmethod(confidence_raw_ref)  # DSpark's accept-rate head: the op's one torch body

    pack_round = staticmethod(pack_round_ref)  # the op's one torch body

    argmax = staticmethod(row_argmax_ref)  # the op's one torch body

    settle_round = staticmethod(settle_round)

    conv_silu = staticmethod(conv_silu_update)
    gated_delta_rule = staticmethod(gated_delta_step)
    gated_delta_replay = staticmethod(gated_delta_replay)
    gated_delta_replay_dev = staticmethod(gated_delta_replay_dev)
    ring_window = staticmethod(ring_window)
    gated_delta_restore = staticmethod(gated_delta_restore)
    stash_restore = staticmethod(stash_restore)

    # ------------------------------------------------------------------ Qwen3.5

    rms_norm_1p = staticmethod(rms_norm_1p)

    @staticmethod
    def add_rms_norm_1p(x: torch.Tensor, residual: torch.Tensor, w1p: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_1p_ref(x, residual, w1p, eps)  # the op's one torch body

    @staticmethod
    def gated_qk_norm_rope_kv_write(qgkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache,
                                    n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
        """`qgkv [t, (2*nh + 2*nkv)*hd]` -> q `[t, nh, hd]`; k/v written at `positions`. cos/sin
        `[S_tab, r]` over the rotary dims (the first r of each head)."""
        t, hd = qgkv.shape[0], q_norm.shape[0]
        qg, k, v = qgkv.split([2 * n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
        c, s = cos[positions], sin[positions]
        q = apply_partial_rope(rms_norm_1p(qg.view(t, n_heads, 2 * hd)[..., :hd], q_norm, eps), c, s)
        k = apply_partial_rope(rms_norm_1p(k.view(t, n_kv, hd), k_norm, eps), c, s)
        k_cache.index_copy_(1, positions, k.transpose(0, 1))
        v_cache.index_copy_(1, positions, v.reshape(t, n_kv, hd).transpose(0, 1))
        return q

    @classmethod
    def gated_attention(cls, q, k_cache, v_cache, positions, scale: float, qgkv: torch.Tensor,
                        n_heads: int) -> torch.Tensor:
        """`attention` then `output_gate` (Qwen3.5's gated attention in a fixed step)."""
        return cls.output_gate(cls.attention(q, k_cache, v_cache, positions, scale), qgkv, n_heads)

    @staticmethod
    def output_gate(out: torch.Tensor, qgkv: torch.Tensor, n_heads: int) -> torch.Tensor:
        """`out [t, nh*hd] * sigmoid(gate)`, head h's gate the hd columns after its query."""
        t, width = out.shape
        hd = width // n_heads
        return out * torch.sigmoid(qgkv[:, :2 * width].view(t, n_heads, 2 * hd)[..., hd:].reshape(t, width))

    gdn_gates = staticmethod(gdn_gates_body)  # the op's one torch body (memra_kernels.qwen35_ref)

    @staticmethod
    def gdn_conv_gates(window: torch.Tensor, mixed: torch.Tensor, conv_w: torch.Tensor, ba: torch.Tensor,
                       a_neg: torch.Tensor, dt_bias: torch.Tensor, ring_idx: torch.Tensor | None = None,
                       xs_ring: torch.Tensor | None = None, replay_rings: tuple | None = None,
                       final_window: torch.Tensor | None = None, live: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`conv_silu(window, mixed, conv_w)` then `gdn_gates` (the record's replay rings
        `(qkv_ring, g_ring, beta_ring)` taking that conv output) -> (conv_out, g, beta); with
        `final_window [K-1, C]` the window after the last row (after the last live row, with
        `live`: the rows after it are padding) copied into it."""
        conv = conv_silu_update(window, mixed, conv_w)
        replay = None if replay_rings is None else (replay_rings[0], conv, replay_rings[1], replay_rings[2])
        g, beta = TorchStepOps.gdn_gates(ba, a_neg, dt_bias, ring_idx, xs_ring, mixed, replay)
        if final_window is not None:
            final_window.copy_(window_after(window, mixed, live))
        return conv, g, beta

    @staticmethod
    def gated_rms_norm(core: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """`core [t, Hv, dv]` float32, `z [t, Hv*dv]` -> `[t, Hv*dv]` in z's dtype."""
        return gated_rms_norm_heads(core, z, w, eps)


class TritonStepOps:
    """`memra_kernels` (CUDA tensors; on CPU only under Triton's interpreter, for tests)."""

    name = "triton"
    restores_on_device = True  # gated_delta_replay_dev / ring_window read their rows on the device
    prefill_mask = False  # the prefill's attention is causal by construction (no mask tensor)

    @staticmethod
    def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """`TorchStepOps.prefill_attention` through PyTorch's fused SDPA kernels: the causal rule
        as a lower-right `CausalBias` (query i of t sees keys up to n-t+i) instead of a boolean
        mask, which sends a long prompt's chunks to the slow math path (docs/tuning.md#prefill-sdpa).
        K/V are repeated per query head for the chunk (one layer's worth at a time): the
        fused kernels take equal head counts. Prefill is shared by plain and speculative
        decoding, so this changes no comparison the exactness gate makes."""
        t, nh, hd = q.shape
        if t == 1:
            return TorchStepOps.prefill_attention(q, keys, values, None)
        from torch.nn.attention.bias import causal_lower_right

        g = nh // keys.shape[0]
        n = keys.shape[1]
        k = keys.repeat_interleave(g, dim=0)[None]  # [1, nh, n, hd]
        v = values.repeat_interleave(g, dim=0)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=causal_lower_right(t, n))
        return out[0].transpose(0, 1).reshape(t, nh * hd)

    def __init__(self):
        from memra_kernels import (_pdl, activation, argmax, attention, deltanet, dense_linear, gather, gemma4, markov,
                                   moe, moe_route, norm, quant_linear, qwen35, rope, settle)

        self.rms_norm = norm.rms_norm
        self.add_rms_norm = norm.add_rms_norm
        self._norm = norm
        self.qk_norm_rope_kv_write = rope.qk_norm_rope_kv_write
        self.rope_kv_write = rope.rope_kv_write
        self.attention = attention.decode_attention
        self.gemma_qk_norm_rope_kv_write = gemma4.gemma_qk_norm_rope_kv_write
        self.gemma_add_norm = gemma4.gemma_add_norm
        self.gemma_add_two_norms = gemma4.gemma_add_two_norms
        self.gelu_tanh_mul = gemma4.gelu_tanh_mul
        self.softcap = gemma4.softcap
        self.silu_mul = activation.silu_mul
        self._markov = markov
        self._markov_tables: dict[tuple, tuple] = {}  # (w1, w2, dtype) -> (w1, w2, table)
        self.argmax = argmax.row_argmax
        self.embed = gather.embed_rows
        self.embed_rms_norm = norm.embed_rms_norm
        self.embed_rms_norm_1p = norm.embed_rms_norm_1p
        self.confidence_raw = gather.confidence_raw
        self.pack_round = gather.pack_round
        self.settle_round = settle.settle_round
        self.conv_silu = deltanet.causal_conv_silu
        self.gated_delta_rule = deltanet.gated_delta_rule
        self.gated_delta_replay = deltanet.gated_delta_rule_layers
        self.gated_delta_replay_dev = deltanet.gated_delta_replay_dev
        self.ring_window = deltanet.ring_window
        self.gated_delta_restore = deltanet.gated_delta_restore
        self.stash_restore = deltanet.stash_restore
        self.rms_norm_1p = norm.rms_norm_1p
        self.add_rms_norm_1p = norm.add_rms_norm_1p
        self.gated_qk_norm_rope_kv_write = qwen35.gated_qk_norm_rope_kv_write
        self.output_gate = qwen35.output_gate
        self.gated_attention = lambda q, k, v, pos, scale, qgkv, nh: attention.gated_decode_attention(
            q, k, v, pos, scale, qgkv)  # the gate in the combine launch (nh: q's heads)
        self.gdn_gates = qwen35.gdn_gates
        self.gdn_conv_gates = qwen35.gdn_conv_gates
        self.gated_rms_norm = qwen35.gated_rms_norm
        self.plain_launches = _pdl.plain_launches
        self._dense = dense_linear
        self._quant = quant_linear
        self._moe = moe
        self._moe_route = moe_route

    def unfused(self) -> "TritonStepOps":
        """New ops with the head and tail fusions as their parts (module docstring): the same bits,
        more launches."""
        ops = TritonStepOps()
        ops.embed_rms_norm = functools.partial(unfused_embed_rms_norm, ops)
        ops.embed_rms_norm_1p = functools.partial(unfused_embed_rms_norm_1p, ops)
        ops.lm_head_argmax = functools.partial(unfused_lm_head_argmax, ops)
        ops.qkv_rope_kv_write = functools.partial(unfused_qkv_rope_kv_write, ops)
        ops.linear_add_rms_norm = functools.partial(unfused_linear_add_rms_norm, ops)
        ops.moe_swiglu_add_rms_norm = functools.partial(unfused_moe_swiglu_add_rms_norm, ops)
        ops.moe_swiglu_shared_add_rms_norm_1p = functools.partial(unfused_moe_swiglu_shared_add_rms_norm_1p, ops)
        ops.moe_gemma_add_norm = functools.partial(unfused_moe_gemma_add_norm, ops)
        ops.gemma_add_two_norms = functools.partial(unfused_gemma_add_two_norms, ops)
        ops.router_route = functools.partial(unfused_router_route, ops)
        return ops

    def linear_add_rms_norm(self, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                            consumer=None):
        """`TorchStepOps.linear_add_rms_norm`; where `folds_norm`, one launch
        (`dense_linear.dense_linear_add_norm`) and the normed rows a `PendingNorm` the consumer
        folds in: (PendingNorm, new residual); else the projection and `add_rms_norm`. The choice
        goes by weight shapes and the row count up to MAX_ROWS, so it never splits a step's rows."""
        if self.folds_norm(a, w, bias, norm_w, consumer):
            pending = self._dense.dense_linear_add_norm(a, w, residual, norm_w, eps)
            return pending, pending.rows
        return self.add_rms_norm(self.linear(a, w, bias), residual, norm_w, eps)

    def folds_norm(self, a: torch.Tensor, w, bias, norm_w: torch.Tensor, consumer) -> bool:
        """Whether `linear_add_rms_norm` leaves its norm to `consumer`: `linear` takes the dense
        kernel for `a @ w.T` (no bias) and for the normed rows times the plain weight `consumer`,
        and the norm weight has the rows' dtype."""
        return (bias is None and isinstance(w, torch.Tensor) and isinstance(consumer, torch.Tensor)
                and self._dense.eligible(a, w) and norm_w.dtype == a.dtype
                and self._dense.eligible_rows(a.shape[0], w.shape[0], a.dtype, consumer))

    def normed(self, h):
        """A `PendingNorm`'s normed rows (`norm.rms_norm_partials`: the bits a folding consumer
        uses), for a consumer that cannot fold it; a tensor as it is."""
        if isinstance(h, self._dense.PendingNorm):
            return self._norm.rms_norm_partials(h.rows, h.sumsq, h.weight, h.eps)
        return h

    def qkv_rope_kv_write(self, h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache,
                          n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
        """`TorchStepOps.qkv_rope_kv_write`; where `linear` takes the dense kernel (no bias) and
        its tiles lie inside heads, one launch (`dense_linear.dense_qkv_rope_kv_write`). The choice
        depends on the weight's shape and the row count only up to MAX_ROWS, and either path is
        row-count invariant, so every fixed-width step gets the same bits for a row."""
        rows = h.rows if isinstance(h, self._dense.PendingNorm) else h
        if b_qkv is None and isinstance(w_qkv, torch.Tensor) and self._dense.eligible(h, w_qkv) \
                and self._dense.qkv_rope_eligible(rows, w_qkv, cos.shape[1]):
            return self._dense.dense_qkv_rope_kv_write(h, w_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                                                       v_cache, n_heads, n_kv, eps)
        return unfused_qkv_rope_kv_write(self, h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache,
                                         v_cache, n_heads, n_kv, eps)

    def lm_head_argmax(self, h: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.lm_head_argmax`; where `linear` takes the dense kernel and the shape's
        tiles do not split `in`, one launch with the argmax in its epilogue (the picks of
        `argmax(linear(h, w))`, bit for bit: the choice cannot change a pick)."""
        rows = h.rows if isinstance(h, self._dense.PendingNorm) else h
        if isinstance(w, torch.Tensor) and self._dense.eligible(h, w) \
                and self._dense.config_for(*w.shape, rows.element_size()).split_k == 1:
            picks = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
            return self._dense.dense_linear(h, w, argmax_out=picks), picks
        return unfused_lm_head_argmax(self, h, w)

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`TorchStepOps.linear`, with a plain weight whose shape is in `dense_linear.TUNED` (and
        a call of at most `dense_linear.MAX_ROWS` rows, no bias) on the few-row kernel. The
        choice depends on the weight's shape and the row count only up to MAX_ROWS, and the
        kernel's rows never depend on each other, so every fixed-width step (and the one-row
        plain step) gets the same bits for a row."""
        if bias is None and isinstance(w, torch.Tensor) and self._dense.eligible(x, w):
            return self._dense.dense_linear(x, w)  # a PendingNorm x: normed as it is loaded
        return TorchStepOps.linear(self.normed(x), w, bias)

    def swiglu(self, x: torch.Tensor, w_gate_up) -> torch.Tensor:
        """`TorchStepOps.swiglu`; where `linear` would take the dense kernel (the same rule), one
        launch of it with the activation in its epilogue (`dense_linear(..., glu=True)`: the
        bits of `silu_mul(linear(...))`, so the choice can never split a step's rows)."""
        if isinstance(w_gate_up, torch.Tensor) and self._dense.eligible(x, w_gate_up) \
                and w_gate_up.shape[0] % 2 == 0:
            return self._dense.dense_linear(x, w_gate_up, glu=True)
        x = self.normed(x)
        if isinstance(w_gate_up, self._quant.QuantLinear) and w_gate_up.shape[0] % 2 == 0:
            return w_gate_up.swiglu(x)  # a q8_0 / q4_0 drafter's: the same epilogue in quant_linear's launch
        return unfused_swiglu(self, x, w_gate_up)

    def moe_swiglu(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """`TorchStepOps.moe_swiglu` on the MoE kernels (`memra_kernels.moe`): every step and
        prefill chunk (a graphed prefill bucket reads no value on the host either); the twin only
        for weights the kernels do not take (`moe.eligible`: strided rows)."""
        if self._moe.eligible(x, w_gate_up, w_down):
            return self._moe.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation)
        return moe_swiglu_ref(x, weights, experts, w_gate_up, w_down, activation)

    def moe_swiglu_add_rms_norm(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                w_gate_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor,
                                norm_w: torch.Tensor, eps: float, activation: str = "silu"
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_swiglu_add_rms_norm` with the residual add and the norm in the MoE
        combine's launch (`moe.moe_swiglu_add_rms_norm`); `moe_swiglu` then `add_rms_norm` where
        the kernels do not take the tensors. The choice depends on shapes and dtypes only."""
        if self._moe.eligible(x, w_gate_up, w_down) and self._moe.norm_eligible(x, residual, norm_w):
            return self._moe.moe_swiglu_add_rms_norm(x, weights, experts, w_gate_up, w_down, residual, norm_w, eps,
                                                     activation)
        return unfused_moe_swiglu_add_rms_norm(self, x, weights, experts, w_gate_up, w_down, residual, norm_w, eps,
                                               activation)

    def moe_gemma_add_norm(self, x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next,
                           eps: float, scalar) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_gemma_add_norm` with the sandwich norms, the residual add, the scalar
        and the next norm in the MoE combine's launch (`moe.gemma_eligible`); the unfused ops
        otherwise. The choice depends on shapes and dtypes only."""
        if self._moe.eligible(x, w_gate_up, w_down) and self._moe.gemma_eligible(x, dense, residual, norms, w_next,
                                                                                 scalar):
            return self._moe.moe_gemma_add_norm(x, weights, experts, w_gate_up, w_down, dense, residual, norms,
                                                w_next, eps, scalar)
        return unfused_moe_gemma_add_norm(self, x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next,
                                          eps, scalar)

    def moe_swiglu_shared_add_rms_norm_1p(self, x, weights, experts, w_gate_up, w_down, shared, gate, residual,
                                          w1p, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_swiglu_shared_add_rms_norm_1p` with the gated shared expert, the
        residual add and the zero-centred norm in the MoE combine's launch (`moe.shared_eligible`);
        the unfused ops otherwise. The choice depends on shapes and dtypes only."""
        if self._moe.eligible(x, w_gate_up, w_down) and self._moe.shared_eligible(x, shared, gate, residual, w1p):
            return self._moe.moe_swiglu_shared_add_rms_norm_1p(x, weights, experts, w_gate_up, w_down, shared, gate,
                                                               residual, w1p, eps)
        return unfused_moe_swiglu_shared_add_rms_norm_1p(self, x, weights, experts, w_gate_up, w_down, shared, gate,
                                                         residual, w1p, eps)

    def router_route(self, x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                     live: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None, pre_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.router_route` in one launch for a step's rows (`moe_route.router_eligible`:
        up to 64 rows, a router of up to 1024 experts), the router's matmul and the picks
        together (and Gemma 4's router norm, `pre_norm`); `linear` then `moe_route` otherwise (a
        prefill chunk). The choice depends on the row count only past a step's rows, so every
        fixed-width step routes a row alike."""
        if self._moe_route.router_eligible(x, router):
            return self._moe_route.router_route(x, router, k, normalize, live, counts, scale, pre_norm)
        return unfused_router_route(self, x, router, k, normalize, live, counts, scale, pre_norm)

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_route` in one launch (`memra_kernels.moe_route`), for every router
        the kernel's tile holds (`moe_route.eligible`: up to 1024 experts); the twin otherwise."""
        if self._moe_route.eligible(logits):
            return self._moe_route.moe_route(logits, k, normalize, live, counts, scale)
        return moe_route_ref(logits, k, normalize, live, counts, scale)

    def markov_chain(self, logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     dtype: torch.dtype, host_loop: bool = False) -> torch.Tensor:
        """The chain kernel; for a small vocabulary through its bias table (one launch), built
        on first use and kept with references to its weights (so their addresses, its key, stay
        theirs). The first use is outside any capture: graphs warm their body up first.
        `host_loop` is the torch seam's CPU choice, unused here."""
        return self._markov.markov_chain(logits, anchor, w1, w2, dtype, table=self._markov_table(w1, w2, dtype))

    def prepare_markov(self, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> bool:
        """Build the chain's bias table now (at load) rather than in the first round; whether one fits."""
        return self._markov_table(w1, w2, dtype) is not None

    def _markov_table(self, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The bias table for a small vocabulary, built on first use and kept with references to
        its weights (their addresses are its key); None where it does not fit."""
        if not self._markov.table_fits(w1, w2, dtype):
            return None
        key = (w1.data_ptr(), tuple(w1.shape), w2.data_ptr(), tuple(w2.shape), dtype)
        entry = self._markov_tables.get(key)
        if entry is None:
            entry = self._markov_tables[key] = (w1, w2, self._markov.bias_table(w1, w2, dtype))
        return entry[2]


def cpu_linear_note() -> str:
    """What the torch ops' weight matmuls run on, for the CPU's step-ops note."""
    if not ONEDNN_F32:
        return ""
    return f"; float32 weight matmuls of {ONEDNN_MIN_ROWS}+ rows on oneDNN, fewer on torch's BLAS"


def select_step_ops(device: torch.device, setting: bool | None = None, env: dict | None = None):
    """The `kernels` setting -> (ops, what was applied). Unset: Triton kernels on CUDA when
    `memra_kernels` imports (MEMRA_KERNELS=0 turns them off), torch elsewhere."""
    env = os.environ if env is None else env
    raw = env.get(KERNELS_ENV, "")
    if setting is None and raw not in ("", "0", "1"):
        raise SettingError("kernels", raw, "expected 0 or 1")
    pdl_raw = env.get(PDL_ENV, "")
    if pdl_raw not in ("", "0", "1"):
        raise SettingError("pdl", pdl_raw, "expected 0 or 1")
    if setting is None and raw:
        setting = raw == "1"
    if setting is False:
        return TorchStepOps(), "step ops: torch (kernels off)"
    if device.type != "cuda":
        if setting:
            raise SettingError("kernels", True, f"the Triton kernels need a CUDA device (device {device})", quote=False)
        return TorchStepOps(), "step ops: torch (not on CUDA)" + cpu_linear_note()
    try:
        ops = TritonStepOps()
    except ImportError as exc:
        if setting:
            raise SettingError("kernels", True, f"memra_kernels cannot load ({exc})", quote=False) from None
        return TorchStepOps(), f"step ops: torch (memra_kernels unavailable: {exc})"
    from memra_kernels import _pdl

    if pdl_raw == "0":
        launch = "launched in stream order (MEMRA_PDL=0)"
    elif _pdl.enabled(device):
        launch = "launches overlapped with programmatic dependent launch"
    else:
        launch = "launched in stream order (programmatic dependent launch needs sm_90+)"
    from memra_kernels import dense_linear

    return ops, ("step ops: Triton kernels (fused norms, rope + KV write, live-length attention, DeltaNet conv, "
                 f"gates and recurrence, gated norm; {launch}); weight matmuls of up to {dense_linear.MAX_ROWS} rows "
                 f"on memra's dense kernel for the {len(dense_linear.TUNED)} weight shapes it was measured on "
                 "(Qwen3-8B and its DFlash drafter, Qwen3.5-4B), cuBLAS for the others")
