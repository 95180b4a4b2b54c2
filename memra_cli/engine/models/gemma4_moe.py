"""Gemma 4 with `enable_moe_block`: every layer runs routed experts beside its dense MLP.

As `transformers.Gemma4TextDecoderLayer` (5.25) combines them, on the residual stream `x` after
the attention's add (models/gemma4.py holds the rest of the layer):

    dense   = norm_post_ff_1(mlp(norm_pre_ff(x)))
    routed  = norm_post_ff_2(Σ_j w_j · expert_{e_j}(norm_pre_ff_2(x)))      GELU-tanh GLU experts
    x       = x + norm_post_ff(dense + routed)

The router reads `x` itself: `r = rms(x) · scale · hidden^-0.5` (an unweighted norm, then a
learned per-channel scale), logits `r @ proj.T`, softmax in float32, top-k (ties to the lower
index, layers/moe.py), renormalised over the k, each weight then multiplied by its expert's
`per_expert_scale`, in float32, and cast to the model dtype for the combine (transformers
multiplies the model-dtype expert output by the float32 weight and rounds the product: in
bfloat16 the two differ by one rounding of the weight; in float32 they are the same).

Experts load from the stacked layout (`experts.gate_up_proj [E, 2I, h]`, `experts.down_proj
[E, h, I]`, what transformers writes for Gemma 4) or the per-expert one (models/experts.py), and
run through the step ops (`step_ops.moe_swiglu` with `activation="gelu_tanh"`; in the fixed step,
a layer without per-layer inputs ends in `step_ops.moe_gemma_add_norm`: the experts, both post
norms, their sum, the residual add, the layer scalar and the next norm, with the MoE kernels in
the combine's launch; or the torch twin, which runs every expert while a capture is under way), so
the step reads nothing on the host and stays capturable as the dense Gemma 4 step is. The router's
norm runs in the router's launch (`router_route`'s pre-norm), the experts' input norm in the
attention's add + norm (`step_ops.gemma_add_two_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memra_cli.engine.layers.moe import ExpertReads
from memra_cli.engine.models.experts import (LiveRouting, RoutingRecorder, expert_shapes, load_experts,
                                             step_weight_elements)
from memra_cli.engine.models.gemma4 import MOE_NORMS, Gemma4Target, LayerWeights, _Loader, gemma_rms_norm
from memra_cli.engine.models.kv_cache import LiveLayerKVCache
from memra_cli.engine.models.qwen3_moe import MoeSettings, MoeWeights


@dataclass
class Gemma4MoeLayerWeights(LayerWeights):
    """A Gemma 4 layer plus its MoE block: `experts` (router `proj [E, h]`, stacked experts),
    `router_scale [h]`, `expert_scale [E]` and `moe_norms` (pre-ff 2, post-ff 1, post-ff 2)."""

    experts: MoeWeights | None = None
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    moe_norms: tuple[torch.Tensor, ...] = ()


def gemma_route(x: torch.Tensor, w: Gemma4MoeLayerWeights, top_k: int, eps: float, ops,
                live: torch.Tensor | None = None, counts: torch.Tensor | None = None, bound: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights `[t, k]` (model dtype) and expert ids `[t, k]` for the residual `x [t, h]`
    (module docstring): the step ops' `router_route` with the scaled norm as its pre-norm
    (`moe_route_ref.router_pre_norm_ref`: the same roundings as `gemma_rms_norm(x, None, eps) *
    router_scale * h**-0.5`; with the kernels, in the router's launch), the per-expert scale,
    and the live rows (and their host `bound`) and the count, as every MoE family's (layers/moe.py)."""
    return ops.router_route(x, w.experts.router, top_k, True, live, counts, w.expert_scale,
                            pre_norm=(w.router_scale, x.shape[-1] ** -0.5, eps), bound=bound)


class _MoeLoader(_Loader):
    """Gemma 4's reader with every layer's MoE block, its experts in either layout."""

    def __init__(self, ckpt, cfg, dtype, device):
        super().__init__(ckpt, cfg, dtype, device)
        self.stacked: dict[int, bool] = {}

    def check_all(self) -> None:
        super().check_all()
        moe, h = self.cfg.moe, self.cfg.hidden_size
        for i in range(self.cfg.num_hidden_layers):
            need, self.stacked[i] = expert_shapes(self.ckpt.tensors, f"{self.prefix}layers.{i}.experts.",
                                                  moe.num_experts, h, moe.moe_intermediate_size)
            self.check(need)
            self.shapes.update(need)

    def layer(self, i: int) -> Gemma4MoeLayerWeights:
        p = f"layers.{i}."
        gate_up, down = load_experts(lambda n: self.get(n, prefixed=False), f"{self.prefix}{p}experts.",
                                     self.cfg.moe.num_experts, self.stacked[i])
        return Gemma4MoeLayerWeights(
            **vars(super().layer(i)), experts=MoeWeights(self.get(p + "router.proj.weight"), gate_up, down),
            router_scale=self.get(p + "router.scale"), expert_scale=self.get(p + "router.per_expert_scale"),
            moe_norms=tuple(self.get(p + n + ".weight") for n in MOE_NORMS))

    def describe(self) -> str:
        moe = self.cfg.moe
        layouts = sorted({"stacked" if s else "per-expert" for s in self.stacked.values()})
        return (f", an MoE block on every layer ({moe.num_experts} experts of intermediate "
                f"{moe.moe_intermediate_size}, top {moe.top_k_experts}, read from the {' and '.join(layouts)} layout)")


class Gemma4MoeTarget(RoutingRecorder, LiveRouting, Gemma4Target):
    """Gemma 4 with its MoE block. `expert_reads`: (sparse-layer calls, experts run in them)
    over every forward and step, for the bench (layers/moe.py `ExpertReads`). Capturable in a
    CUDA graph (`supports_cuda_graphs`, the dense Gemma 4's): routing, the expert op and the
    counter read nothing on the host. A fixed step's padding rows run no experts
    (`LiveRouting`; the state's live rows: `LiveLayerKVCache`)."""

    state_class = LiveLayerKVCache

    step_ops_used = ("linear, embed, gemma_qk_norm_rope_kv_write, windowed attention, gemma_add_norm, "
                     "gemma_add_two_norms, "
                     "gelu_tanh_mul, softcap, router_route (with the router's norm), moe_swiglu and moe_gemma_add_norm "
                     "(the routed experts; a step's layer end with them); Gemma 4's per-layer inputs run in torch")
    loader_class = _MoeLoader
    routes_experts = True

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        fixed = step_weight_elements(self.layers, self._lm_head, cfg.hidden_size, self.norm)
        if self.ple is not None:  # one row of the per-layer table, and its projection
            fixed += self.ple.embed.shape[1] + self.ple.proj.numel() + self.ple.norm.numel()
        self.moe = MoeSettings(cfg.moe.num_experts, cfg.moe.top_k_experts, cfg.moe.moe_intermediate_size, True,
                               frozenset(range(cfg.num_hidden_layers)), fixed)
        self.reads = ExpertReads(cfg.moe.num_experts, self.device)

    @property
    def expert_reads(self) -> tuple[int, int]:
        """(sparse-layer calls, distinct experts they ran) so far, for the bench (a host read)."""
        return self.reads.snapshot()

    def _route(self, x: torch.Tensor, w: Gemma4MoeLayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's routing of the residual `x` (weights, ids `[t, k]`), counted and recorded."""
        weights, ids = gemma_route(x, w, self.moe.top_k, self.cfg.rms_norm_eps, self.step_ops, self._live_rows,
                                   self.reads.sink(), self._live_bound)
        self._record_routing(id(w.experts), ids)
        return weights, ids

    def _attention_add_norm(self, x: torch.Tensor, o: torch.Tensor, w: Gemma4MoeLayerWeights, add_norm,
                            step: bool) -> tuple:
        """The step's: the MLP's and the experts' input norms of the new residual in one step op
        (`gemma_add_two_norms`: with the kernels, `gemma_add_norm`'s launch) -> (x, h, experts' h)."""
        if not step:
            return super()._attention_add_norm(x, o, w, add_norm, step)
        return self.step_ops.gemma_add_two_norms(x, o, w.norms[1], w.norms[2], w.moe_norms[0], self.cfg.rms_norm_eps)

    def _ffn_add_norm(self, x: torch.Tensor, h: list, w: Gemma4MoeLayerWeights, w_next: torch.Tensor,
                      add_norm, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed step's layer end as one step op (`moe_gemma_add_norm`: with the kernels, the
        block's and the MLP's post norms, their sum, the residual add, the scalar and the next norm
        in the MoE combine's launch; the torch ops compute `_feed_forward` then `gemma_add_norm`'s
        values). The eager forward's: `_feed_forward`, then `add_norm`."""
        if not step:
            return super()._ffn_add_norm(x, h, w, w_next, add_norm, step)
        _, post_1, post_2 = w.moe_norms
        dense = super()._feed_forward(x, h[0], w)
        weights, ids = self._route(x, w)
        return self.step_ops.moe_gemma_add_norm(h[1], weights, ids, w.experts.w_gate_up,
                                                w.experts.w_down, dense, x, (post_1, post_2, w.norms[3]), w_next,
                                                self.cfg.rms_norm_eps, w.layer_scalar)

    def _feed_forward(self, x: torch.Tensor, h: torch.Tensor, w: Gemma4MoeLayerWeights) -> torch.Tensor:
        """The dense MLP's (of the pre-normed `h`) and the experts' outputs (of `x`, by their own
        norm), each normed, summed (before the post norm)."""
        eps = self.cfg.rms_norm_eps
        pre_2, post_1, post_2 = w.moe_norms
        dense = gemma_rms_norm(super()._feed_forward(x, h, w), post_1, eps)
        weights, ids = self._route(x, w)
        routed = self.step_ops.moe_swiglu(gemma_rms_norm(x, pre_2, eps), weights, ids, w.experts.w_gate_up,
                                          w.experts.w_down, "gelu_tanh")
        return dense + gemma_rms_norm(routed, post_2, eps)
