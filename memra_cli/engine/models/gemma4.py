"""Gemma 4 dense text model (HF `model_type: gemma4_text`, and `gemma4`'s language model) for
inference: prefill, verify, taps. The switches and what is covered: docs/gemma4.md.

Per layer, as `transformers.Gemma4TextDecoderLayer` (5.25) computes it:

    h = attn(norm_in(x));            x = x + norm_post_attn(h)
    h = mlp(norm_pre_ff(x));         x = x + norm_post_ff(h)       (GELU-tanh MLP)
        with enable_moe_block, h = norm_ff_1(mlp(..)) + norm_ff_2(experts(norm_pre_ff_2(x)))
        before that post norm (models/gemma4_moe.py)
    [per-layer input]                x = x + norm_ple(proj(gelu(gate(x)) * ple_i))
    x = x * layer_scalar

Attention: q/k RMSNorm (weighted), v RMSNorm without weight, rope per layer type (sliding:
default; full: proportional), scaling 1.0; sliding layers see the last `sliding_window` positions
(query p attends keys j with p - window < j <= p), full layers every earlier one. Full layers may
have their own head dim and KV heads, and with `attention_k_eq_v` take V from the key projection
(before its norm and rope). The last `num_kv_shared_layers` layers project only q and attend over
the K/V of the last earlier layer of their type. Norms are Gemma 4's: `x * (ms + eps)^-0.5 * w`
all in float32, then cast (no `1 + w`). The embedding is scaled by sqrt(hidden) (the scale cast to
the model dtype first, as transformers does); the lm_head is the embedding when tied, and the
logits are soft-capped by `final_logit_softcapping`.

The fixed-width step (`static_step`) takes from the step-op seam the weight matmuls (`linear`),
the embedding gather, Gemma's q/k norm + rope + v norm + K/V write (`gemma_qk_norm_rope_kv_write`),
the attention with its sliding window (`attention(..., window)`), each sandwich norm's residual
add with the norm after it (`gemma_add_norm`, `layer_scalar` included), the MLP's
`gelu_tanh_mul` and the logits' `softcap`; the first input norm and the per-layer inputs are torch
on every device. The eager forward (prefill) takes the seam's matmuls, GELU and softcap too, and
the other ops' torch bodies, with the whole prompt's attention under one mask (see
docs/gemma4.md, "Kernels and CUDA").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from memra_cli.engine.errors import CheckpointError, UnsupportedError
from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.gemma4_config import FULL, SLIDING, Gemma4Config, Gemma4Rope, load_gemma4_config
from memra_cli.engine.layers.ops import sdpa
from memra_cli.engine.layers.rope import RopeTables, cos_sin
from memra_cli.engine.layers.torch_step_ops import TorchStepOps, ring_view
from memra_cli.engine.models.common import TargetBase, batch_taps
from memra_cli.engine.models.kv_cache import LayerKVCache, ring_rows
from memra_cli.engine.models.loading import WeightLoader
from memra_kernels.gemma4_ref import gemma_add_norm_ref, gemma_qk_norm_rope_kv_write_ref, gemma_rms_norm_ref

log = logging.getLogger(__name__)

TEXT_PREFIXES = ("model.language_model.", "model.")
# the multimodal checkpoint's towers and their projections into the text model: recognized, skipped
SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# the MoE block's: the experts' input norm, then one after each of the dense MLP and the experts
MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


# --------------------------------------------------------------------------- pieces


# Gemma 4's RMSNorm `x * (mean(x^2) + eps)^-0.5 [* w]` in float32, then cast (weight None: the
# v norm): the one torch body, beside the fused kernels' other twins
gemma_rms_norm = gemma_rms_norm_ref


def rope_inv_freq(rope: Gemma4Rope, head_dim: int) -> torch.Tensor:
    """inv_freq `[head_dim/2]` float32 of one layer type. `proportional`: the first
    `int(partial * head_dim // 2)` frequencies `theta^(-2i/head_dim)` (exponents over the FULL
    head dim), the rest 0 (cos 1, sin 0: those dim pairs pass through), all divided by `factor`."""
    if rope.type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)])
    return inv / rope.factor


@dataclass
class LayerWeights:
    """One decoder layer. `wqkv` `[(nh + 2*nkv)*hd, hidden]` ([q; k] with k_eq_v, [q] on a
    KV-shared layer); `w_gate_up` `[2*inter, hidden]`; the per-layer-input tensors are None
    without `hidden_size_per_layer_input`; `layer_scalar` `[1]`."""

    wqkv: torch.Tensor
    wo: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor | None
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # in, post-attn, pre-ff, post-ff
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    layer_scalar: torch.Tensor
    ple_gate: torch.Tensor | None
    ple_proj: torch.Tensor | None
    ple_norm: torch.Tensor | None


def expected_shapes(cfg: Gemma4Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, for every tensor the forward needs (lm_head only when untied)."""
    h, nh, ple = cfg.hidden_size, cfg.num_attention_heads, cfg.hidden_size_per_layer_input
    shapes: dict[str, tuple[int, ...]] = {prefix + "embed_tokens.weight": (cfg.vocab_size, h),
                                          prefix + "norm.weight": (h,)}
    src = cfg.kv_source
    for i in range(cfg.num_hidden_layers):
        p, hd, kv, inter = f"{prefix}layers.{i}.", cfg.head_dims[i], cfg.kv_heads[i], cfg.intermediate(i)
        shapes.update({p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "layer_scalar": (1,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        for norm in LAYER_NORMS:
            shapes[p + norm + ".weight"] = (h,)
        if src[i] == i:
            shapes[p + "self_attn.k_proj.weight"] = (kv * hd, h)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
            if not cfg.k_eq_v(i):
                shapes[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        if ple:
            shapes.update({p + "per_layer_input_gate.weight": (ple, h), p + "per_layer_projection.weight": (h, ple),
                           p + "post_per_layer_input_norm.weight": (h,)})
    if cfg.moe is not None:
        shapes.update(moe_block_shapes(cfg, prefix))
    if ple:
        n = cfg.num_hidden_layers * ple
        shapes.update({prefix + "embed_tokens_per_layer.weight": (cfg.vocab_size_per_layer_input, n),
                       prefix + "per_layer_model_projection.weight": (n, h),
                       prefix + "per_layer_projection_norm.weight": (ple,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def moe_block_shapes(cfg: Gemma4Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every layer's MoE block tensors but its experts (whose layout the MoE reader finds): the
    router (`proj [E, h]`, `scale [h]`, `per_expert_scale [E]`) and the block's three norms."""
    h, e = cfg.hidden_size, cfg.moe.num_experts
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"{prefix}layers.{i}."
        shapes.update({p + "router.proj.weight": (e, h), p + "router.scale": (h,), p + "router.per_expert_scale": (e,)})
        for norm in MOE_NORMS:
            shapes[p + norm + ".weight"] = (h,)
    return shapes


class _Loader(WeightLoader):
    """The Gemma 4 layout of `WeightLoader`: names under the text model's prefix (the multimodal
    checkpoint's `model.language_model.` or the text-only `model.`)."""

    def __init__(self, ckpt: Checkpoint, cfg: Gemma4Config, dtype: torch.dtype, device: torch.device):
        names = set(ckpt.tensors)
        self.prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in names), None)
        if self.prefix is None:
            raise CheckpointError(f"{ckpt.root}: tensor 'model.language_model.embed_tokens.weight' (multimodal "
                                  "layout) or 'model.embed_tokens.weight' (text-only layout) is missing")
        super().__init__(ckpt, cfg, dtype, device, expected_shapes(cfg, self.prefix))

    def describe(self) -> str:
        """What this reader adds to the load note (the MoE reader: its experts)."""
        return ""

    def get(self, name: str, prefixed: bool = True) -> torch.Tensor:
        return self.ckpt.load((self.prefix if prefixed else "") + name, self.dtype, self.device)

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.prefix + name in self.shapes else None

    def layer(self, i: int) -> LayerWeights:
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [self.get(a + "q_proj.weight")] + [t for t in (self.opt(a + "k_proj.weight"),
                                                             self.opt(a + "v_proj.weight")) if t is not None]
        return LayerWeights(
            wqkv=torch.cat(qkv), wo=self.get(a + "o_proj.weight"), q_norm=self.get(a + "q_norm.weight"),
            k_norm=self.opt(a + "k_norm.weight"),
            norms=tuple(self.get(p + n + ".weight") for n in LAYER_NORMS),
            w_gate_up=torch.cat([self.get(m + "gate_proj.weight"), self.get(m + "up_proj.weight")]),
            w_down=self.get(m + "down_proj.weight"), layer_scalar=self.get(p + "layer_scalar"),
            ple_gate=self.opt(p + "per_layer_input_gate.weight"), ple_proj=self.opt(p + "per_layer_projection.weight"),
            ple_norm=self.opt(p + "post_per_layer_input_norm.weight"),
        )


@dataclass
class PerLayerInputs:
    """The small variants' per-layer input tables: `embed [V_ple, L*ple]`, `proj [L*ple, hidden]`,
    `norm [ple]`."""

    embed: torch.Tensor
    proj: torch.Tensor
    norm: torch.Tensor


# --------------------------------------------------------------------------- the model


class Gemma4Target(TargetBase):
    """Gemma4ForCausalLM inference over a `LayerKVCache`. Tap id `i` is the raw output of layer
    `i` (after its `layer_scalar`: HF `hidden_states[i+1]`), `-1` the scaled embedding."""

    supports_cuda_graphs = True
    state_class = LayerKVCache
    # The most rows one write adds to a sliding layer's ring: the runner's prefill chunk (a test
    # checks they agree); a fixed-width step of more rows is refused over a ring.
    RING_SPAN = 512
    # what the step takes from the seam, said in the engine's step-ops note when the Triton ops
    # are selected (docs/gemma4.md, "Kernels and CUDA")
    step_ops_used = ("linear, embed, gemma_qk_norm_rope_kv_write, windowed attention, gemma_add_norm, "
                     "gelu_tanh_mul and softcap; Gemma 4's per-layer inputs run in torch")
    loader_class = _Loader  # the weights' reader (the MoE block's adds its experts)
    routes_experts = False  # the config this class loads: without (cfg.moe None) or with enable_moe_block

    def __init__(self, cfg: Gemma4Config, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor,
                 lm_head: torch.Tensor, ple: PerLayerInputs | None = None, note: str = ""):
        self.cfg, self.embed_weight, self.layers, self.norm, self._lm_head = cfg, embed, layers, norm, lm_head
        self.ple, self.load_note = ple, note
        self.dtype, self.device = embed.dtype, embed.device
        self.n_heads = cfg.num_attention_heads
        self.kv_source = cfg.kv_source
        # transformers keeps the scale as a float32 buffer and casts it to the weights' dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5).to(self.dtype))
        # 0-dim scales in the model dtype (host scalars: a captured graph keeps them as constants)
        self._scale_t = torch.tensor(cfg.hidden_size ** 0.5).to(self.dtype)
        self._ple_scale_t = torch.tensor(cfg.hidden_size_per_layer_input ** 0.5).to(self.dtype)
        self._rope = {kind: RopeTables(rope_inv_freq(cfg.rope[kind], self._type_head_dim(kind)), 1.0)
                      for kind in cfg.rope}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.step_ops = TorchStepOps()

    def _type_head_dim(self, kind: str) -> int:
        return next(self.cfg.head_dims[i] for i, t in enumerate(self.cfg.layer_types) if t == kind)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", checkpoint: Checkpoint | None = None) -> "Gemma4Target":
        """Load a Gemma 4 directory (text or multimodal layout; single or sharded safetensors).
        The multimodal towers are recognized and skipped (counted in `load_note`). `checkpoint`:
        its headers when the caller opened them already (`Engine.load`)."""
        path = Path(path)
        cfg = load_gemma4_config(path)
        if (cfg.moe is not None) != cls.routes_experts:
            raise UnsupportedError(f"{cfg.source}: enable_moe_block={json.dumps(cfg.moe is not None)} is not a "
                                   f"{cls.__name__} target (load it through the registry: models/base.py)")
        loader = cls.loader_class(open_checkpoint(path) if checkpoint is None else checkpoint, cfg, dtype,
                                  torch.device(device))
        loader.check_all()
        embed = loader.get("embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_hidden_layers)]
        lm_head = embed if cfg.tie_word_embeddings else loader.get("lm_head.weight", prefixed=False)
        ple = None
        if cfg.hidden_size_per_layer_input:
            ple = PerLayerInputs(loader.get("embed_tokens_per_layer.weight"),
                                 loader.get("per_layer_model_projection.weight"),
                                 loader.get("per_layer_projection_norm.weight"))
        return cls(cfg, embed, layers, loader.get("norm.weight"), lm_head, ple, _load_note(path, cfg, loader))

    # ----------------------------------------------------------------------- state and tables

    def new_state(self, rows: int) -> LayerKVCache:
        """K/V storage of `rows` positions for every layer that owns its K/V: a full layer's holds
        every position, a sliding layer's a ring of `ring_rows(window, RING_SPAN)` rows when that
        is fewer (the window and one write; docs/gemma4.md, "Sliding layers' storage")."""
        shapes = [(self.cfg.kv_heads[i], self.cfg.head_dims[i]) if src == i else None
                  for i, src in enumerate(self.kv_source)]
        ring = ring_rows(self.cfg.sliding_window, self.RING_SPAN)
        rows_of = [ring if kind == SLIDING else None for kind in self.cfg.layer_types]
        # an MoE family's state has live rows too
        return self.state_class(shapes, rows, self.dtype, self.device, rows_of)

    def ensure_positions(self, rows: int) -> None:
        """cos/sin tables per layer type reaching `rows` positions (grown, never shrunk)."""
        for kind, tables in self._rope.items():
            have = self._tables.get(kind)
            if have is None or have[0].shape[0] < rows:
                self._tables[kind] = cos_sin(tables, torch.arange(rows, device=self.device), self.dtype)

    # ----------------------------------------------------------------------- forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The RAW embedding rows `[t, hidden]` (unscaled: what a z-lab drafter's block takes by
        default; `embed_scale` is the factor the model itself multiplies in)."""
        return self.step_ops.embed(ids, self.embed_weight)

    def forward(self, ids: torch.Tensor, start: int, cache: LayerKVCache,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ids [t]` at positions `start..start+t-1`: final-normed hidden `[t, hidden]` and taps
        `[t, n_taps*hidden]`; writes K/V there and sets `cache.length = start + t`. Over a state
        with ring storages, in chunks of RING_SPAN rows (a longer write would overwrite keys its
        own earlier rows read)."""
        t = ids.shape[0]
        self.check_span(start, t, cache)
        self.ensure_positions(start + t)
        chunk = self.RING_SPAN if t > self.RING_SPAN and self._has_ring(cache) else t
        parts = []
        for c0 in range(0, t, chunk):  # t >= 1 (check_span)
            end = start + min(c0 + chunk, t)
            parts.append(self._run(ids[c0:end - start], torch.arange(start + c0, end, device=self.device), cache,
                                   end, taps))
        cache.length = start + t
        if len(parts) == 1:
            return parts[0]
        return torch.cat([h for h, _ in parts]), (torch.cat([tp for _, tp in parts]) if taps else None)

    batched_taps = True
    batched_taps_limit = f"a batch longer than the sliding window + {RING_SPAN} tokens runs one sequence at a time"

    @torch.no_grad()
    def forward_taps(self, ids: torch.Tensor, taps: Sequence[int],
                     lengths: Sequence[int] | None = None) -> torch.Tensor:
        """`TargetBase.forward_taps` with the batch's `B*L` rows in every matmul but the
        attention's: the embedding, per-layer inputs, o projections, norms and feed-forward (the
        MoE block's experts read once for the batch) at once; each sequence's q/k/v, K/V write
        and attention (`_mix`) on a fresh storage of its own, as `forward` runs it from position
        0; stops after the deepest tap. A batch long enough for sliding-layer rings runs
        `forward` per sequence instead (its chunked writes). Padding rows past a sequence's
        length run too and are zeroed after: the attention is causal."""
        self.check_tap_batch(ids, taps)
        B, L = ids.shape
        states = [self.new_state(L) for _ in range(B)]
        if self._has_ring(states[0]):
            return super().forward_taps(ids, taps, lengths)
        self.ensure_positions(L)
        flat = ids.reshape(-1).to(self.device)
        positions = torch.arange(L, device=self.device)
        x = self.embed(flat) * self._scale_t
        ple = self._per_layer_inputs(flat, x)
        masks = {kind: self._mask(positions, L, kind) for kind in self.cfg.rope}
        wanted = set(taps)
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        h = gemma_rms_norm(x, self.layers[0].norms[0], self.cfg.rms_norm_eps)
        for li in range(max(taps) + 1):
            w, kind = self.layers[li], self.cfg.layer_types[li]
            w_next = self.layers[li + 1].norms[0] if li + 1 < len(self.layers) else self.norm
            core = torch.cat([self._mix(li, h[b * L:(b + 1) * L], w, st, positions, L, self._tables[kind], masks[kind])
                              for b, st in enumerate(states)])
            x, h = self._layer_end(li, x, core, w, w_next, None if ple is None else ple[:, li], gemma_add_norm_ref,
                                   False)
            if li in wanted:
                tapped[li] = x
        return batch_taps(tapped, taps, B, L, ids.device, lengths)

    def padding_rows_limit(self, state: LayerKVCache) -> int | None:
        """RING_SPAN over sliding-layer rings: a padding row at position p overwrites the ring row
        of p - (window + RING_SPAN), a key the next live row still reads once p runs more than
        RING_SPAN past the live rows (docs/gemma4.md, "Sliding layers' storage")."""
        return self.RING_SPAN if self._has_ring(state) else None

    @staticmethod
    def _has_ring(cache: LayerKVCache) -> bool:
        """Whether a layer of `cache` stores fewer rows than positions (a sliding layer's ring)."""
        return any(kv is not None and kv.shape[2] < cache.max_len for kv in cache.kv)

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, cache: LayerKVCache,
                    taps: Sequence[int] | None = None, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-width step: attention over the whole storage under a position mask (keys
        past a row's position, or before its window, are masked and leave it unchanged), so a
        row's result depends neither on the rows beside it nor on the storage size."""
        if ids.shape[0] > self.RING_SPAN and self._has_ring(cache):
            raise ValueError(f"a step of {ids.shape[0]} rows over a sliding-window ring of {self.RING_SPAN}-row "
                             "writes: it would overwrite keys its own rows read")
        self.ensure_positions(cache.max_len)
        hidden, tapped = self._run(ids, positions, cache, cache.max_len, taps, step=True)
        return (self.logits(hidden) if widen else self.lm_head(hidden)), tapped

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, cache: LayerKVCache, n_keys: int,
             taps: Sequence[int] | None, step: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over `ids [t]` at `positions [t]`, attending the first `n_keys` storage rows:
        through the step-op seam (`step`, the fixed-width step) or the forward's torch bodies."""
        if taps:
            self.check_taps(taps)
        x = self.embed(ids) * self._scale_t
        ple = self._per_layer_inputs(ids, x)
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        # the step's attention masks by position on the device; the forward's takes one mask
        masks = {kind: None if step else self._mask(positions, n_keys, kind) for kind in self.cfg.rope}
        add_norm = self.step_ops.gemma_add_norm if step else gemma_add_norm_ref
        h = gemma_rms_norm(x, self.layers[0].norms[0], self.cfg.rms_norm_eps)
        for li, w in enumerate(self.layers):
            kind = self.cfg.layer_types[li]
            # the norm after the layer: the next layer's input norm, or the final norm
            w_next = self.layers[li + 1].norms[0] if li + 1 < len(self.layers) else self.norm
            x, h = self._layer(li, x, h, w, w_next, cache, positions, n_keys, self._tables[kind], masks[kind],
                               None if ple is None else ple[:, li], add_norm)
            if li in wanted:
                tapped[li] = x
        return h, (torch.cat([tapped[i] for i in taps], dim=-1) if taps else None)

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """`[t, L, ple]`: (norm(proj(x) / sqrt(hidden)) + table[ids] * sqrt(ple)) / sqrt(2)."""
        if self.ple is None:
            return None
        t, n, d = ids.shape[0], self.cfg.num_hidden_layers, self.cfg.hidden_size_per_layer_input
        token = self.step_ops.embed(ids, self.ple.embed) * self._ple_scale_t
        context = self.step_ops.linear(x, self.ple.proj) * self.cfg.hidden_size ** -0.5
        context = gemma_rms_norm(context.view(t, n, d), self.ple.norm, self.cfg.rms_norm_eps)
        return (context + token.view(t, n, d)) * 2.0 ** -0.5

    def _mask(self, positions: torch.Tensor, n_keys: int, kind: str) -> torch.Tensor:
        """Boolean `[t, n_keys]` (True = attend): causal, and within the window on sliding layers."""
        keys = torch.arange(n_keys, device=self.device)
        mask = keys[None, :] <= positions[:, None]
        if kind == SLIDING:
            mask &= keys[None, :] > positions[:, None] - self.cfg.sliding_window
        return mask

    def _layer(self, li: int, x: torch.Tensor, h: torch.Tensor, w: LayerWeights, w_next: torch.Tensor,
               cache: LayerKVCache, positions: torch.Tensor, n_keys: int, tables: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor | None, ple: torch.Tensor | None, add_norm) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer (module docstring) on the residual `x [t, hidden]` and its input-normed
        `h`; K/V written at `positions`. Returns the layer's output and its norm by `w_next` (the
        next layer's input norm or the final norm). `tables`: the layer type's cos/sin
        `[S_tab, hd]`; `mask` `[t, n_keys]` for the forward, None in the step (whose attention
        masks by position and window itself); `add_norm`: `gemma_add_norm`, the seam's or its body."""
        core = self._mix(li, h, w, cache, positions, n_keys, tables, mask)
        return self._layer_end(li, x, core, w, w_next, ple, add_norm, mask is None)

    def _mix(self, li: int, h: torch.Tensor, w: LayerWeights, cache: LayerKVCache, positions: torch.Tensor,
             n_keys: int, tables: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """A layer's attention over its input-normed `h [t, hidden]`: q/k/v (K/V written at
        `positions`) and the attention over the first `n_keys` positions -> `[t, nh*hd]`, before
        the o projection (`_layer`'s arguments)."""
        ops = self.step_ops
        q = self._qkv_write(li, h, w, cache, positions, tables, step=mask is None)
        kv = cache.kv[self.kv_source[li]]
        window = self.cfg.sliding_window if self.cfg.layer_types[li] == SLIDING else 0
        ring = kv.shape[2] < cache.max_len  # a sliding layer's ring: position j at row j % rows
        if mask is None:
            return ops.attention(q, kv[0], kv[1], positions, 1.0, window, span=cache.max_len if ring else None)
        if ring and n_keys > kv.shape[2]:
            return self._attend(q, ring_view(kv[0], n_keys, window), ring_view(kv[1], n_keys, window), mask)
        return self._attend(q, kv[0, :, :n_keys], kv[1, :, :n_keys], mask)

    def _layer_end(self, li: int, x: torch.Tensor, core: torch.Tensor, w: LayerWeights, w_next: torch.Tensor,
                   ple: torch.Tensor | None, add_norm, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of a layer after `_mix`, row by row: the o projection of `core [t, nh*hd]`,
        the sandwich norms, residual adds, feed-forward, per-layer input and layer scalar ->
        (the layer's output, its norm by `w_next`)."""
        eps, ops = self.cfg.rms_norm_eps, self.step_ops
        _, n_post_attn, n_pre_ff, n_post_ff = w.norms
        if ple is None:
            x, *h = self._attention_add_norm(x, ops.linear(core, w.wo), w, add_norm, step)
            return self._ffn_add_norm(x, h, w, w_next, add_norm, step)
        x, h = add_norm(x, ops.linear(core, w.wo), n_post_attn, n_pre_ff, eps)
        ff = self._feed_forward(x, h, w)
        x = x + gemma_rms_norm(ff, n_post_ff, eps)
        gated = F.gelu(ops.linear(x, w.ple_gate), approximate="tanh") * ple
        x = (x + gemma_rms_norm(ops.linear(gated, w.ple_proj), w.ple_norm, eps)) * w.layer_scalar
        return x, gemma_rms_norm(x, w_next, eps)

    def _attention_add_norm(self, x: torch.Tensor, o: torch.Tensor, w: LayerWeights, add_norm, step: bool) -> tuple:
        """The attention's residual add (its post norm) and the pre-feed-forward norm -> (new
        residual, normed, ...): the feed-forward's inputs after it (the MoE block's step adds
        its experts' input norm in the same op: gemma4_moe.py)."""
        return add_norm(x, o, w.norms[1], w.norms[2], self.cfg.rms_norm_eps)

    def _ffn_add_norm(self, x: torch.Tensor, h: list, w: LayerWeights, w_next: torch.Tensor, add_norm,
                      step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's end without per-layer inputs: the feed-forward of `_attention_add_norm`'s
        norms `h` (the first: the MLP's input), its post norm, the residual add, the layer scalar
        and the next norm (`add_norm`) -> (new residual, normed); `step`: the fixed step, where the
        MoE block runs it as one step op (gemma4_moe.py)."""
        return add_norm(x, self._feed_forward(x, h[0], w), w.norms[3], w_next, self.cfg.rms_norm_eps, w.layer_scalar)

    def _feed_forward(self, x: torch.Tensor, h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The layer's feed-forward on the residual stream `x [t, hidden]`, before its post norm:
        the GELU-tanh MLP of `h`, x pre-feed-forward-normed (the MoE block adds its experts of x:
        gemma4_moe.py)."""
        ops = self.step_ops
        return ops.linear(ops.gelu_tanh_mul(ops.linear(h, w.w_gate_up)), w.w_down)

    def _qkv_write(self, li: int, h: torch.Tensor, w: LayerWeights, cache: LayerKVCache, positions: torch.Tensor,
                   tables: tuple[torch.Tensor, torch.Tensor], step: bool) -> torch.Tensor:
        """q `[t, nh, hd]` (normed, roped); a layer owning its K/V also writes normed, roped k and
        the unweighted-normed v (k_eq_v: v is the raw key projection) at `positions`. One op
        (`gemma_qk_norm_rope_kv_write`): the seam's in the step, its torch body in the forward."""
        proj = self.step_ops.linear(h, w.wqkv)
        owns = self.kv_source[li] == li
        k_cache, v_cache = (cache.kv[li][0], cache.kv[li][1]) if owns else (None, None)
        op = self.step_ops.gemma_qk_norm_rope_kv_write if step else gemma_qk_norm_rope_kv_write_ref
        return op(proj, w.q_norm, w.k_norm, *tables, positions, k_cache, v_cache, self.n_heads,
                  self.cfg.kv_heads[li] if owns else 0, self.cfg.rms_norm_eps, self.cfg.k_eq_v(li))

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """GQA attention (scaling 1.0) of `q [t, nh, hd]` over `keys/values [nkv, n, hd]` under
        `mask [t, n]`; the g query heads of a KV head are folded into rows. `[t, nh*hd]`."""
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        g = nh // nkv
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = sdpa(qf, keys, values, mask.repeat(g, 1), 1.0)
        return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    # ----------------------------------------------------------------------- heads

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[t, vocab]` float32: the soft-capped model-dtype logits, widened (exact; with a cap,
        in the softcap's own pass)."""
        z = self.step_ops.linear(hidden, self._lm_head)
        cap = self.cfg.final_logit_softcapping
        return z.float() if cap is None else self.step_ops.softcap(z, cap, torch.float32)

    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`[t, vocab]` in the model dtype, soft-capped (`cap * tanh(z / cap)`) when configured
        (`weight`: rows of the lm_head instead, a draft vocabulary's: `[t, rows]`)."""
        z = self.step_ops.linear(hidden, self._lm_head if weight is None else weight)
        cap = self.cfg.final_logit_softcapping
        return z if cap is None else self.step_ops.softcap(z, cap)


def _load_note(path: Path, cfg: Gemma4Config, loader: _Loader) -> str:
    """What was loaded and what was applied, for receipts (logged)."""
    names = set(loader.ckpt.tensors)
    towers = {n for n in names if n.startswith(SKIPPED_PREFIXES)}
    extra = sorted(names - set(loader.shapes) - {"lm_head.weight"} - towers)
    n_full = sum(1 for t in cfg.layer_types if t == FULL)
    note = (f"Gemma 4 target {path}: {cfg.layout} layout (model_type {cfg.model_type}, text weights under "
            f"{loader.prefix}), {cfg.num_hidden_layers} layers = {cfg.num_hidden_layers - n_full} sliding "
            f"(window {cfg.sliding_window}) + {n_full} full, full-layer heads from {cfg.head_layout}, "
            f"{'tied' if cfg.tie_word_embeddings else 'untied'} lm_head"
            + (f", softcap {cfg.final_logit_softcapping}" if cfg.final_logit_softcapping else "")
            + (f", {cfg.num_kv_shared_layers} KV-shared layers" if cfg.num_kv_shared_layers else "")
            + (f", per-layer inputs of {cfg.hidden_size_per_layer_input}" if cfg.hidden_size_per_layer_input else "")
            + loader.describe() + f"; skipped {len(towers)} vision/audio tensor(s)")
    if cfg.notes:
        note += "; defaults applied: " + "; ".join(cfg.notes)
    log.info("%s", note)
    if extra:
        log.warning("%s: %d tensor(s) not used by the Gemma 4 target, e.g. %s", path, len(extra), extra[0])
    return note
