"""Qwen3-MoE causal LM (HF `model_type: qwen3_moe`): the Qwen3 model with a routed feed-forward.

Attention, norms, rope, taps and the step are the Qwen3 target's (models/qwen3.py); a layer's
feed-forward is a sparse MoE block unless the layer is in `mlp_only_layers` or
`(layer + 1) % decoder_sparse_step != 0`, in which case it is the dense SwiGLU of
`intermediate_size`. Routing and the grouped expert SwiGLU are layers/moe.py's, the same
arithmetic in the eager forward and the fixed-width step. Expert weights load from the
per-expert layout (`mlp.experts.{e}.gate_proj.weight`, ...) or the stacked one transformers 5
holds (`mlp.experts.gate_up_proj [E, 2I, h]`, `mlp.experts.down_proj [E, h, I]`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from memra_cli.engine.errors import ConfigError
from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.config import _Fields, parse_target_config, read_json_object
from memra_cli.engine.layers.moe import ExpertReads, route
from memra_cli.engine.layers.ops import rms_norm
from memra_cli.engine.models.experts import LiveRouting, RoutingRecorder, expert_shapes, load_experts
from memra_cli.engine.models.kv_cache import LiveKVCache
from memra_cli.engine.models.qwen3 import LayerWeights, Qwen3Target, _Loader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoeSettings:
    """The routed feed-forward's shape: `sparse_layers` holds the layer ids with an MoE block.
    `fixed_elements`: the weight elements a one-row step reads outside the routed experts, counted
    at load by a family whose shape the Qwen3 cost formula (spec/priced.py) does not describe
    (None: that formula applies)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    fixed_elements: int | None = None


def parse_moe(raw: dict, source: str, n_layers: int) -> MoeSettings:
    """The MoE keys of a qwen3_moe config.json, refused with the key named when out of range."""
    f = _Fields(raw, source)
    # transformers 5 writes the count as num_local_experts; published configs say num_experts
    experts = f.int("num_experts" if f.has("num_experts") else "num_local_experts")
    top_k = f.int("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok {top_k} is more than num_experts {experts}")
    step = f.int("decoder_sparse_step", default=1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers
                                              for i in dense):
        raise ConfigError(f"{source}: key 'mlp_only_layers' must be a list of layer ids in [0, {n_layers}), "
                          f"got {dense!r}")
    sparse = frozenset(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    return MoeSettings(experts, top_k, f.int("moe_intermediate_size"), f.bool("norm_topk_prob", default=False), sparse)


@dataclass
class MoeWeights:
    """A sparse layer's feed-forward: `router [E, hidden]`, `w_gate_up [E, 2*I, hidden]` (gate
    rows first), `w_down [E, hidden, I]`."""

    router: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def _dense_ffn_names(i: int) -> set[str]:
    return {f"model.layers.{i}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}


class _MoeLoader(_Loader):
    """The Qwen3 loader with each sparse layer's dense MLP tensors replaced by its experts."""

    def __init__(self, ckpt, cfg, moe: MoeSettings, dtype, device):
        super().__init__(ckpt, cfg, dtype, device)
        self.moe, self.used, self.skipped = moe, set(), set()
        for i in moe.sparse_layers:
            for name in _dense_ffn_names(i):
                del self.shapes[name]
            self.shapes[f"model.layers.{i}.mlp.gate.weight"] = (moe.num_experts, cfg.hidden_size)

    def stacked(self, i: int) -> bool:
        """Whether layer `i`'s experts are in the stacked layout (checked: every tensor of the
        layout found present at its shape, or the per-expert layout's, else a named refusal)."""
        need, stacked = expert_shapes(self.ckpt.tensors, f"model.layers.{i}.mlp.experts.", self.moe.num_experts,
                                      self.cfg.hidden_size, self.moe.moe_intermediate_size)
        self.check(need)
        self.used.update(need)
        return stacked

    def experts(self, i: int) -> MoeWeights:
        p = f"model.layers.{i}.mlp."
        gate_up, down = load_experts(self.get, p + "experts.", self.moe.num_experts, self.stacked(i))
        return MoeWeights(self.get(p + "gate.weight"), gate_up, down)

    def get(self, name: str) -> torch.Tensor:
        return torch.empty(0) if name in self.skipped else super().get(name)

    def layer(self, i: int) -> "MoeLayerWeights":
        """Layer `i`'s tensors; a sparse layer's dense MLP slots are empty and `experts` set."""
        sparse = i in self.moe.sparse_layers
        self.skipped = _dense_ffn_names(i) if sparse else set()
        try:
            w = super().layer(i)
        finally:
            self.skipped = set()
        return MoeLayerWeights(**vars(w), experts=self.experts(i) if sparse else None)


@dataclass
class MoeLayerWeights(LayerWeights):
    """A Qwen3 layer's tensors plus, on a sparse layer, its experts (its w_gate_up / w_down empty)."""

    experts: MoeWeights | None = None


class Qwen3MoeTarget(RoutingRecorder, LiveRouting, Qwen3Target):
    """Qwen3MoeForCausalLM inference. Capturable in a CUDA graph (`supports_cuda_graphs`, the
    Qwen3 step's): the MoE kernels read the routed ids on the device, and the torch twin runs
    every expert while a capture is under way instead of reading them on the host. A fixed
    step's padding rows run no experts (`LiveRouting`; the state's live rows: `LiveKVCache`)."""

    supports_cuda_graphs = True
    state_class = LiveKVCache

    def __init__(self, cfg, moe: MoeSettings, *args):
        super().__init__(cfg, *args)
        self.moe = moe
        self.reads = ExpertReads(moe.num_experts, self.device)

    @property
    def expert_reads(self) -> tuple[int, int]:
        """(sparse-layer calls, distinct experts they ran) so far, for the bench (a host read)."""
        return self.reads.snapshot()

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", checkpoint: Checkpoint | None = None) -> "Qwen3MoeTarget":
        """Load an HF Qwen3-MoE directory (config.json + safetensors, either expert layout);
        `checkpoint`: its headers when the caller opened them already (`Engine.load`)."""
        path = Path(path)
        source = str(path / "config.json")
        raw = read_json_object(path / "config.json")
        cfg = parse_target_config({**raw, "model_type": "qwen3"}, source)
        moe = parse_moe(raw, source, cfg.num_hidden_layers)
        loader = _MoeLoader(open_checkpoint(path) if checkpoint is None else checkpoint, cfg, moe, dtype, torch.device(device))
        loader.check_all()
        embed = loader.get("model.embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_hidden_layers)]
        lm_head = embed if cfg.tie_word_embeddings else loader.get("lm_head.weight")
        extra = sorted(set(loader.ckpt.tensors) - set(loader.shapes) - loader.used - {"lm_head.weight"})
        if extra:
            log.warning("%s: %d tensor(s) not used by the Qwen3-MoE target, e.g. %s", path, len(extra), extra[0])
        return cls(cfg, moe, embed, layers, loader.get("model.norm.weight"), lm_head)

    def _route(self, h: torch.Tensor, ex: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of the normed `h [t, hidden]` (weights, ids `[t, k]`), counted and recorded."""
        weights, ids = route(h, ex.router, self.moe.top_k, self.moe.norm_topk_prob, self.step_ops, self._live_rows,
                             self.reads.sink(), self._live_bound)
        self._record_routing(id(ex), ids)
        return weights, ids

    def _moe(self, h: torch.Tensor, ex: MoeWeights) -> torch.Tensor:
        """A routed feed-forward on the normed `h [t, hidden]` (before the residual add)."""
        weights, ids = self._route(h, ex)
        return self.step_ops.moe_swiglu(h, weights, ids, ex.w_gate_up, ex.w_down)

    def _mlp(self, x: torch.Tensor, w: MoeLayerWeights) -> torch.Tensor:
        if w.experts is None:
            return super()._mlp(x, w)
        return x + self._moe(rms_norm(x, w.mlp_norm, self.cfg.rms_norm_eps), w.experts)

    def _step_mlp(self, w: MoeLayerWeights):
        return super()._step_mlp(w) if w.experts is None else None  # a sparse layer: `_step_ffn`'s router

    def _step_ffn(self, h: torch.Tensor, li: int, w: MoeLayerWeights) -> torch.Tensor:
        return super()._step_ffn(h, li, w) if w.experts is None else self._moe(h, w.experts)

    def _step_ffn_add_norm(self, h: torch.Tensor, x: torch.Tensor, li: int, w: MoeLayerWeights,
                           next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse layer's experts, the residual add and the next norm: one step op
        (`moe_swiglu_add_rms_norm`: with the kernels, the add and norm in the combine's launch)."""
        if w.experts is None:
            return super()._step_ffn_add_norm(h, x, li, w, next_norm)
        ex = w.experts
        weights, ids = self._route(h, ex)
        return self.step_ops.moe_swiglu_add_rms_norm(h, weights, ids, ex.w_gate_up, ex.w_down, x, next_norm,
                                                     self.cfg.rms_norm_eps)
