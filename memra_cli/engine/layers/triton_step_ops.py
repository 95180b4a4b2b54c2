"""The step ops on `memra_kernels`' Triton kernels (`TritonStepOps`): CUDA, or Triton's interpreter in tests.

The seam's contract (every op's signature and rule, `unfused()`, `plain_launches()`) is
layers/step_ops.py's docstring; each op here names the `TorchStepOps` op it matches. The kernels
are imported when an instance is built (an ImportError there is `select_step_ops`' cue to fall
back to torch), so importing this module needs no Triton.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.unfused import (unfused_embed_rms_norm, unfused_embed_rms_norm_1p,
                                             unfused_gemma_add_two_norms, unfused_linear_add_rms_norm,
                                             unfused_linear_rms_norm,
                                             unfused_lm_head_argmax, unfused_moe_gemma_add_norm,
                                             unfused_moe_swiglu_add_rms_norm,
                                             unfused_moe_swiglu_shared_add_rms_norm_1p, unfused_qkv_rope_kv_write,
                                             unfused_router_route, unfused_swiglu)
from memra_kernels.moe_ref import moe_swiglu_ref
from memra_kernels.moe_route_ref import moe_route_ref


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
        self.draft_attention = attention.draft_block_attention
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
        # (ids, routed, max_routed): the ranked expert list the router's launch left with the ids it
        # returned and its host bound, for the expert launch those ids go to next (`_routed_for`)
        self._routed: tuple[torch.Tensor, torch.Tensor, int | None] | None = None

    def unfused(self) -> "TritonStepOps":
        """New ops with the head and tail fusions as their parts (module docstring): the same bits,
        more launches."""
        ops = TritonStepOps()
        ops.embed_rms_norm = functools.partial(unfused_embed_rms_norm, ops)
        ops.embed_rms_norm_1p = functools.partial(unfused_embed_rms_norm_1p, ops)
        ops.lm_head_argmax = functools.partial(unfused_lm_head_argmax, ops)
        ops.qkv_rope_kv_write = functools.partial(unfused_qkv_rope_kv_write, ops)
        ops.linear_add_rms_norm = functools.partial(unfused_linear_add_rms_norm, ops)
        ops.linear_rms_norm = functools.partial(unfused_linear_rms_norm, ops)
        ops.moe_swiglu_add_rms_norm = functools.partial(unfused_moe_swiglu_add_rms_norm, ops)
        ops.moe_swiglu_shared_add_rms_norm_1p = functools.partial(unfused_moe_swiglu_shared_add_rms_norm_1p, ops)
        ops.moe_gemma_add_norm = functools.partial(unfused_moe_gemma_add_norm, ops)
        ops.gemma_add_two_norms = functools.partial(unfused_gemma_add_two_norms, ops)
        ops.router_route = functools.partial(unfused_router_route, ops)
        return ops

    def linear_add_rms_norm(self, a: torch.Tensor, w, bias, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                            consumer=None, out: torch.Tensor | None = None):
        """`TorchStepOps.linear_add_rms_norm`; where `folds_norm`, one launch
        (`dense_linear.dense_linear_add_norm`) and the normed rows a `PendingNorm` the consumer
        folds in: (PendingNorm, new residual); else the projection and `add_rms_norm`. The choice
        goes by weight shapes and the row count up to MAX_ROWS, so it never splits a step's rows."""
        if self.folds_norm(a, w, bias, norm_w, consumer):
            pending = self._dense.dense_linear_add_norm(a, w, residual, norm_w, eps, out=out)
            return pending, pending.rows
        return self.add_rms_norm(self.linear(a, w, bias), residual, norm_w, eps, res_out=out)

    def linear_rms_norm(self, a: torch.Tensor, w, norm_w: torch.Tensor, eps: float, consumer=None):
        """`TorchStepOps.linear_rms_norm`; where `folds_norm` (every weight of `consumer`, a
        weight or a sequence of them, would fold it), one launch (`dense_linear.dense_linear_norm`)
        and the normed rows a `PendingNorm` those consumers fold in; else the projection and
        `rms_norm`."""
        if self.folds_norm(a, w, None, norm_w, consumer):
            return self._dense.dense_linear_norm(a, w, norm_w, eps)
        return self.rms_norm(self.linear(a, w), norm_w, eps)

    def folds_norm(self, a: torch.Tensor, w, bias, norm_w: torch.Tensor, consumer) -> bool:
        """Whether `linear_add_rms_norm` (`linear_rms_norm`) leaves its norm to `consumer`: `linear`
        takes the dense kernel for `a @ w.T` (no bias) and for the normed rows times the plain
        weight `consumer` (each of them, given a sequence), and the norm weight has the rows' dtype."""
        consumers = tuple(consumer) if isinstance(consumer, (tuple, list)) else (consumer,)
        return (bias is None and isinstance(w, torch.Tensor) and len(consumers) > 0
                and all(isinstance(c, torch.Tensor) for c in consumers)
                and self._dense.eligible(a, w) and norm_w.dtype == a.dtype
                and all(self._dense.eligible_rows(a.shape[0], w.shape[0], a.dtype, c) for c in consumers))

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
            return self._moe.moe_swiglu(x, weights, experts, w_gate_up, w_down, activation,
                                        **self._routed_for(experts))
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
                                                     activation, **self._routed_for(experts))
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
                                                w_next, eps, scalar, **self._routed_for(experts))
        return unfused_moe_gemma_add_norm(self, x, weights, experts, w_gate_up, w_down, dense, residual, norms, w_next,
                                          eps, scalar)

    def moe_swiglu_shared_add_rms_norm_1p(self, x, weights, experts, w_gate_up, w_down, shared, gate, residual,
                                          w1p, eps: float, activation: str = "silu"
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_swiglu_shared_add_rms_norm_1p` with the gated shared expert, the
        residual add and the zero-centred norm in the MoE combine's launch (`moe.shared_eligible`);
        the unfused ops otherwise. The choice depends on shapes and dtypes only."""
        if self._moe.eligible(x, w_gate_up, w_down) and self._moe.shared_eligible(x, shared, gate, residual, w1p):
            return self._moe.moe_swiglu_shared_add_rms_norm_1p(x, weights, experts, w_gate_up, w_down, shared, gate,
                                                               residual, w1p, eps, activation,
                                                               **self._routed_for(experts))
        return unfused_moe_swiglu_shared_add_rms_norm_1p(self, x, weights, experts, w_gate_up, w_down, shared, gate,
                                                         residual, w1p, eps, activation)

    def router_route(self, x: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                     live: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None, pre_norm=None, bound: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.router_route` in one launch for a step's rows (`moe_route.router_eligible`:
        up to 64 rows, a router of up to 1024 experts), the router's matmul and the picks
        together (and Gemma 4's router norm, `pre_norm`); `linear` then `moe_route` otherwise (a
        prefill chunk). The choice depends on the row count only past a step's rows, so every
        fixed-width step routes a row alike. The launch also ranks the live rows' experts
        (`routed`), which the expert launch handed these ids takes (`_routed_for`); with the host
        `bound` (rows from it on padding too: `reading_rows`) there are at most `bound * k` of them,
        and the expert grid is sized so."""
        if self._moe_route.router_eligible(x, router):
            routed = torch.empty(router.shape[0], dtype=torch.int32, device=x.device)
            weights, ids = self._moe_route.router_route(x, router, k, normalize, live, counts, scale, pre_norm,
                                                        routed=routed, bound=bound)
            self._routed = (ids, routed, None if bound is None else bound * k)
            return weights, ids
        return unfused_router_route(self, x, router, k, normalize, live, counts, scale, pre_norm, bound)

    def _routed_for(self, experts: torch.Tensor) -> dict:
        """The expert launch's `routed` and `max_routed`: the ranked expert list `router_route`
        left with `experts` (the very ids tensor it returned) and its host bound, or neither (ids
        from elsewhere: the grid over every expert). Handed over once: the expert kernels put the
        routed experts' programs first with it (memra_kernels.moe), which changes no bit."""
        held, self._routed = self._routed, None
        if held is None or held[0] is not experts:
            return {}
        return {"routed": held[1], "max_routed": held[2]}

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool, live: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None, scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.moe_route` in one launch (`memra_kernels.moe_route`), for every router
        the kernel's tile holds (`moe_route.eligible`: up to 1024 experts); the twin otherwise."""
        if self._moe_route.eligible(logits):
            return self._moe_route.moe_route(logits, k, normalize, live, counts, scale)
        return moe_route_ref(logits, k, normalize, live, counts, scale)

    def markov_chain(self, logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     dtype: torch.dtype, host_loop: bool = False, with_anchor: bool = False) -> torch.Tensor:
        """The chain kernel; for a small vocabulary through its bias table (one launch, which also
        writes the anchor `with_anchor`), built on first use and kept with references to its
        weights (so their addresses, its key, stay theirs). The first use is outside any capture:
        graphs warm their body up first. `host_loop` is the torch seam's CPU choice, unused here."""
        return self._markov.markov_chain(logits, anchor, w1, w2, dtype, table=self._markov_table(w1, w2, dtype),
                                         with_anchor=with_anchor)

    def markov_chain_confidence(self, logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                                w2: torch.Tensor, dtype: torch.dtype, hidden, conf_w: torch.Tensor,
                                conf_b: torch.Tensor, conf_w1: torch.Tensor | None = None,
                                host_loop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchStepOps.markov_chain_confidence`; over a bias table one launch for both (the chain
        scores its slots after its walk: `markov.markov_chain_confidence`), else that op's
        composition of this seam's chain and head."""
        table = self._markov_table(w1, w2, dtype)
        if table is None:
            return TorchStepOps.markov_chain_confidence(self, logits, anchor, w1, w2, dtype, hidden, conf_w, conf_b,
                                                        conf_w1)
        return self._markov.markov_chain_confidence(logits, anchor, w1, w2, dtype, table, hidden, conf_w, conf_b,
                                                    conf_w1)

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
