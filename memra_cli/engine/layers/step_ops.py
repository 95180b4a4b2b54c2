"""The fixed-width step's fused operations, behind one seam: plain torch or Triton kernels.

A model's `static_step` calls only these operations (plus its weight matmuls), so the same
model code runs the torch reference on any device and the fused kernels of `memra_kernels` on
CUDA. The drafter (models/drafter.py) calls them too: its norms and SiLU·mul on every path, and
in its static round and ingest the q/k/v (k/v) projection with its q/k norm + rope + K/V write
(`qkv_rope_kv_write`) and (plain layers) the attention,
with every block row at the block's last position, which makes the causal rule "ctx + the whole
block". Both implementations are row-count invariant (a row's result never depends on the other
rows of its step or on the storage size), which is what keeps fixed-width steps bit-exact.

- `linear(x, w, bias=None) -> x @ w.T (+ bias)`: a step's weight matmul (`w` a plain `[out, in]`
  weight or a quantized linear module); with the kernels, the few-row dense kernel
  (`memra_kernels.dense_linear`) for the weight shapes it was measured faster on, cuBLAS else
- `rms_norm(x, w, eps)`; `add_rms_norm(x, residual, w, eps, res_out=None) -> (normed, x + residual)`
  (`res_out`, rows with a contiguous last axis, receives the sum: a column slice of a step's taps)
- `linear_add_rms_norm(a, w, bias, residual, norm_w, eps, consumer=None, out=None) -> (h, x)`:
  `add_rms_norm(linear(a, w, bias), residual, norm_w, eps)`, a layer's output projection and the
  norm after it (`out`: where the new residual `x` goes, as `res_out`); with the kernels, where
  `linear` takes the dense kernel for both `w` and the weight `consumer` that will multiply `h`,
  one launch, and `h` a `dense_linear.PendingNorm` (the residual add in the projection's
  epilogue, the norm applied by the consumer as it loads its rows; `swiglu`, `linear`,
  `qkv_rope_kv_write` and `lm_head_argmax` take one, and norm it with `norm.rms_norm_partials`
  where they cannot fold it, the same bits): the statistic summed in one fixed order, which may
  differ from `add_rms_norm`'s kernel in its last ulp
- `linear_rms_norm(a, w, norm_w, eps, consumer=None) -> h`: `rms_norm(linear(a, w), norm_w, eps)`,
  a projection whose output is normed next (a drafter's context features); with the kernels,
  where `linear` takes the dense kernel for `w` and for each weight of `consumer` (a weight or a
  sequence of them), one launch and `h` a `PendingNorm`, as `linear_add_rms_norm` without the add
- `qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh, nkv, eps) -> q`
- `rope_kv_write(qkv, cos, sin, positions, k_cache, v_cache, nh, nkv) -> q`: the same without
  the q/k norm (LLaMA), hd the tables' width
- `qkv_rope_kv_write(h, w_qkv, b_qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, nh, nkv,
  eps) -> q`: `linear(h, w_qkv, b_qkv)` then `qk_norm_rope_kv_write` (norms None: `rope_kv_write`);
  with the kernels, where `linear` takes the dense kernel, one launch (the norm, rope and K/V write
  in its epilogue: the projection's bits, then the rope kernel's arithmetic, its norm's float32 sum
  of squares perhaps in another order)
- `attention(q, k_cache, v_cache, positions, scale, window=0, span=None) -> [t, nh*hd]`: causal by
  position over the cache; with a sliding `window` W > 0 a row at p sees keys p - W < j <= p only
  (Gemma 4); `span` > the storage's rows: a ring storage serving positions 0..span-1, key j at row
  j % rows (Gemma 4's sliding layers past `ring_rows`), the bits of a plain storage of the same keys
- `draft_attention(q, k_cache, v_cache, positions, scale) -> [t, nh*hd]`: `attention` for a
  drafter's block (every row at the block's last position, over the draft cache); with the
  kernels on the drafter's own tile, one launch where the draft cache fits one split
  (memra_kernels.attention `draft_block_attention`)
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
- `embed_rms_norm(ids, weight, norm_w, eps, first=None, rows_out=None) -> (normed, rows)`: `embed`
  then `rms_norm` of its rows, a step's first norm (one launch with the kernels, the bits of the
  two); `first` (one element on the device) is row 0's id in place of `ids[0]` (a drafter's
  block: the anchor, then its constant mask ids); `rows_out` as `add_rms_norm`'s `res_out`;
  `embed_rms_norm_1p` the same with the zero-centred `rms_norm_1p` (Qwen3.5's)
- `confidence_raw(hidden, w, b, prev=None, w1=None) -> f32 [n]`: DSpark's accept-rate head
- `pack_round(cand, sel, raws=None) -> f64`: a graphed round's one host read, packed
- `settle_round(cand, sel, raws, inputs, threshold, kind=, cap=, adapt=, restore=None, ring=0, cost=None) -> f64`:
  a chained round's settlement on the device (window, accepted prefix, next inputs written into
  `inputs`; with `restore`, the ring rows a recurrent state's restore re-runs) and its packed
  output (memra_kernels.settle_ref; one launch with the kernels instead of ~30)
- `markov_chain(logits, anchor, w1, w2, dtype, host_loop=False, with_anchor=False) -> tokens`
  (`with_anchor`: `[anchor, tokens...]`, a round's candidates): DSpark's greedy chain
  (the drafter's side of a round; with the kernels one launch per slot, or one launch in all over
  a bias table built once where the vocabulary is small; with torch ~6 ops a slot, or 3 over the
  same table, built once row by row, or, for an eager caller on the CPU, a numpy loop over that
  table: the same picks)
- `markov_chain_confidence(logits, anchor, w1, w2, dtype, hidden, conf_w, conf_b, conf_w1=None,
  host_loop=False) -> (candidates [1 + n], raws [n])`: a round's greedy chain with the anchor
  first, and `confidence_raw` of its slots (each slot's previous token its markov feature); with
  the kernels, over the small vocabulary's bias table, one launch for both
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
  (v the raw key projection with k_eq_v) + the K/V write at rows `positions % S` (a ring storage's
  rows; a plain one's are the positions); caches None: a KV-shared layer's q only
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
  projection then the rope op, `linear_add_rms_norm` as the projection then `add_rms_norm`
  (`linear_rms_norm` then `rms_norm`),
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

import os

import torch

from memra_cli.engine.errors import SettingError
from memra_cli.engine.layers.torch_step_ops import ONEDNN_DTYPES, ONEDNN_F32, ONEDNN_MIN_ROWS, TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps

KERNELS_ENV = "MEMRA_KERNELS"
PDL_ENV = "MEMRA_PDL"  # memra_kernels._pdl reads it at each launch; checked here so a bad value is refused up front


def cpu_linear_note() -> str:
    """What the torch ops' weight matmuls run on, for the CPU's step-ops note."""
    if not ONEDNN_F32:
        return ""
    dtypes = " and ".join(str(d).removeprefix("torch.") for d in ONEDNN_DTYPES)
    return f"; {dtypes} weight matmuls of {ONEDNN_MIN_ROWS}+ rows on oneDNN, fewer on torch's BLAS"


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
