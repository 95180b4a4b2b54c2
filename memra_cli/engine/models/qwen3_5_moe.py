"""Qwen3.5 mixture-of-experts hybrid (HF `model_type: qwen3_5_moe` / `qwen3_5_moe_text`), text model.

The Qwen3.5 hybrid of models/qwen3_5.py (Gated DeltaNet and gated attention layers, their state,
rollback and fixed-width step, all unchanged) with a routed feed-forward on every layer, as
`transformers.Qwen3_5MoeSparseMoeBlock` (5.25) computes it on the post-attention-normed `h`:

    routed = Σ_j w_j · expert_{e_j}(h)                  router softmax in float32, top-k (ties to the
                                                        lower index), renormalised (layers/moe.py)
    shared = sigmoid(h @ shared_gate.T) · shared_expert(h)    a SwiGLU of shared_expert_intermediate_size
    out    = routed + shared                            (then the residual add, as the dense MLP's)

The shared expert is loaded where the dense hybrid keeps its MLP (`w_gate_up`, `w_down`), so the
dense feed-forward computes it. The same layer end (`_ffn_add_norm`) runs in the eager forward and
the fixed step, so a plain step and a verify step route with the same arithmetic. Experts load from the
per-expert or the stacked layout (models/experts.py). The routed experts run through the step
ops (`step_ops.moe_swiglu_shared_add_rms_norm_1p`, the layer's end: the MoE kernels, whose combine
also adds the gated shared expert and the residual and applies the next zero-centred norm, or the
torch twin, which runs every expert while a capture is under way), so the step reads nothing on
the host and is capturable as the dense hybrid's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra_cli.engine.layers.moe import ExpertReads, route
from memra_cli.engine.models.experts import (LiveRouting, RoutingRecorder, expert_shapes, load_experts,
                                             step_weight_elements)
from memra_cli.engine.models.qwen3_5 import LayerWeights, Qwen35Target, _Loader
from memra_cli.engine.models.qwen3_moe import MoeSettings, MoeWeights


@dataclass
class Qwen35MoeLayerWeights(LayerWeights):
    """A hybrid layer whose `w_gate_up` / `w_down` are the shared expert's, plus its routed
    `experts` (router `[E, hidden]`, stacked expert weights) and `shared_gate [1, hidden]`."""

    experts: MoeWeights | None = None
    shared_gate: torch.Tensor | None = None


class _MoeLoader(_Loader):
    """The hybrid's reader with every layer's routed experts, in whichever layout each layer has
    (checked with the rest before anything loads)."""

    def __init__(self, ckpt, cfg, dtype, device):
        super().__init__(ckpt, cfg, dtype, device)
        self.stacked: dict[int, bool] = {}

    def _experts_prefix(self, i: int) -> str:
        return f"{self.prefix}layers.{i}.mlp.experts."

    def check_all(self) -> None:
        super().check_all()
        moe, h = self.cfg.moe, self.cfg.hidden_size
        for i in range(self.cfg.num_hidden_layers):
            need, self.stacked[i] = expert_shapes(self.ckpt.tensors, self._experts_prefix(i), moe.num_experts, h,
                                                  moe.moe_intermediate_size)
            self.check(need)
            self.shapes.update(need)

    def layer(self, i: int) -> Qwen35MoeLayerWeights:
        m = f"{self.prefix}layers.{i}.mlp."
        gate_up, down = load_experts(self.get, self._experts_prefix(i), self.cfg.moe.num_experts, self.stacked[i])
        return Qwen35MoeLayerWeights(**vars(super().layer(i)), shared_gate=self.get(m + "shared_expert_gate.weight"),
                                     experts=MoeWeights(self.get(m + "gate.weight"), gate_up, down))

    def describe(self) -> str:
        moe = self.cfg.moe
        layouts = sorted({"stacked" if s else "per-expert" for s in self.stacked.values()})
        return (f"; experts on every layer: {moe.num_experts} of intermediate {moe.moe_intermediate_size}, top "
                f"{moe.num_experts_per_tok} renormalised, a gated shared expert of "
                f"{moe.shared_expert_intermediate_size}, experts read from the {' and '.join(layouts)} layout")


class Qwen35MoeTarget(RoutingRecorder, LiveRouting, Qwen35Target):
    """Qwen3_5MoeForCausalLM inference (models/qwen3_5.py's hybrid, routed feed-forward).
    `expert_reads`: (sparse-layer calls, experts run in them) over every forward and step, for
    the bench (layers/moe.py `ExpertReads`, as every MoE family counts them). Capturable in a
    CUDA graph (`supports_cuda_graphs`, the hybrid's): routing, the expert op and the counter
    read nothing on the host. A fixed step's padding rows run no experts (`LiveRouting`, from
    the hybrid state's live rows, which its recurrence skips too)."""

    loader_class = _MoeLoader
    routes_experts = True

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        keys = cfg.moe
        fixed = step_weight_elements(self.layers, self._lm_head, cfg.hidden_size, self.norm)
        self.moe = MoeSettings(keys.num_experts, keys.num_experts_per_tok, keys.moe_intermediate_size, True,
                               frozenset(range(cfg.num_hidden_layers)), fixed)
        self.reads = ExpertReads(keys.num_experts, self.device)

    @property
    def expert_reads(self) -> tuple[int, int]:
        """(sparse-layer calls, distinct experts they ran) so far, for the bench (a host read)."""
        return self.reads.snapshot()

    def _experts_and_shared(self, h: torch.Tensor, w: Qwen35MoeLayerWeights):
        """The layer's routing (counted, recorded), the shared expert's output and its gate's
        logit `[t, 1]` for the normed `h [t, hidden]`: the operands of its feed-forward."""
        shared = super()._feed_forward(h, w)  # the shared expert: the dense MLP's SwiGLU
        weights, ids = route(h, w.experts.router, self.moe.top_k, True, self.step_ops, self._live_rows,
                             self.reads.sink(), self._live_bound)
        self._record_routing(id(w.experts), ids)
        return weights, ids, shared, self.step_ops.linear(h, w.shared_gate)

    def _feed_forward(self, h: torch.Tensor, w: Qwen35MoeLayerWeights) -> torch.Tensor:
        """The routed experts plus the gated shared expert on the normed `h [t, hidden]` -> `[t, hidden]`."""
        weights, ids, shared, gate = self._experts_and_shared(h, w)
        routed = self.step_ops.moe_swiglu(h, weights, ids, w.experts.w_gate_up, w.experts.w_down)
        return routed + torch.sigmoid(gate) * shared

    def _ffn_add_norm(self, h: torch.Tensor, x: torch.Tensor, w: Qwen35MoeLayerWeights, next_norm: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_feed_forward`, the residual add and the next norm as one step op
        (`moe_swiglu_shared_add_rms_norm_1p`: with the kernels, the gated shared expert, the add
        and the norm in the MoE combine's launch; the torch ops compute `_feed_forward`'s values)."""
        weights, ids, shared, gate = self._experts_and_shared(h, w)
        return self.step_ops.moe_swiglu_shared_add_rms_norm_1p(h, weights, ids, w.experts.w_gate_up, w.experts.w_down,
                                                               shared, gate, x, next_norm, self.cfg.rms_norm_eps)
