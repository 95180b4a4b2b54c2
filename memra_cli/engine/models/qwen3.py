"""Qwen3 dense causal LM (HF `model_type: qwen3`) for inference: prefill, verify, taps.

The same decoder serves LLaMA (models/llama.py): the families differ only in switches read
from the config (`cfg.qk_norm`: Qwen3's per-head q/k RMSNorm; LLaMA has none, and its
`llama3` rope scaling lives in the rope tables), so the Qwen3 path is the same code either way.

Built for the speculative round loop and GPU-ready from the start:

- state is a static KV cache (models/kv_cache.py) preallocated at its full length; its
  `rollback(n)` after a partially accepted verify only moves `length`;
- `forward` takes the start position as a python int, so slicing, masks and cache writes never
  read a device value back (no host sync inside a forward);
- q/k/v and gate/up projections are fused at load (one matmul each instead of three / two);
- `static_step` is the fixed-width step with static shapes and device positions; the step
  runner (runtime/steps.py) owns step width, padding, chunking and CUDA graphs around it.

This file holds the math only: no allocation policy, no scheduling, no sampling.

Numerics follow `transformers.Qwen3ForCausalLM`: RMSNorm in float32 then `weight * x.to(dtype)`,
per-head q/k RMSNorm before RoPE, cos/sin formed in float32 then cast to the model dtype,
lm_head in the model dtype (so bf16 logits round exactly where HF's do).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.config import TargetConfig, load_target_config
from memra_cli.engine.errors import ConfigError
from memra_cli.engine.models.common import TargetBase, batch_taps
from memra_cli.engine.models.loading import WeightLoader
from memra_cli.engine.models.kv_cache import KVCache
from memra_cli.engine.layers.ops import rms_norm
from memra_cli.engine.layers.rope import apply_rope, cos_sin, rope_tables
from memra_cli.engine.layers.torch_step_ops import TorchStepOps, key_extent

log = logging.getLogger(__name__)

# The eager forward's weight matmuls (the prefill's): F.linear, except that a CPU call of 8+ rows
# runs on oneDNN over its packed weight, as the fixed step's do; ~2.4x faster than MKL at a
# 130-row prefill on the dev CPU (docs/perf.md, "The DSpark round on the CPU").
_linear = TorchStepOps.linear


# --------------------------------------------------------------------------- pieces


@dataclass
class LayerWeights:
    """One decoder layer's tensors, fused where that saves a matmul.

    wqkv `[(n_heads + 2*n_kv)*head_dim, hidden]`, wo `[hidden, n_heads*head_dim]`,
    w_gate_up `[2*intermediate, hidden]`, w_down `[hidden, intermediate]`, norms `[hidden]`
    or `[head_dim]` (q_norm, k_norm: None for a family without q/k norm); biases only when
    `attention_bias` is true.
    """

    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


# --------------------------------------------------------------------------- loading


def expected_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the forward needs (lm_head only when untied)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if cfg.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.bias": (h,),
            })
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class _Loader(WeightLoader):
    """Qwen3's weights: every layer's tensors under `model.layers.{i}.`."""

    def __init__(self, ckpt: Checkpoint, cfg: TargetConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(ckpt, cfg, dtype, device, expected_shapes(cfg))

    def layer(self, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = self.cfg.attention_bias
        return LayerWeights(
            wqkv=self.cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            bqkv=self.cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if bias else None,
            wo=self.get(a + "o_proj.weight"),
            bo=self.get(a + "o_proj.bias") if bias else None,
            q_norm=self.get(a + "q_norm.weight") if self.cfg.qk_norm else None,
            k_norm=self.get(a + "k_norm.weight") if self.cfg.qk_norm else None,
            attn_norm=self.get(p + "input_layernorm.weight"),
            mlp_norm=self.get(p + "post_attention_layernorm.weight"),
            w_gate_up=self.cat(m + "gate_proj.weight", m + "up_proj.weight"),
            w_down=self.get(m + "down_proj.weight"),
        )


# --------------------------------------------------------------------------- the model


class Qwen3Target(TargetBase):
    """Qwen3ForCausalLM inference: `forward` over a static KV cache, with optional layer taps.

    A tap id `i` is the OUTPUT of decoder layer `i` (HF `hidden_states[i+1]`, raw residual
    stream, never final-normed); `-1` is the embedding output (HF `hidden_states[0]`).
    """

    supports_cuda_graphs = True
    model_type = "qwen3"  # the config.json `model_type` this class loads
    state_class = KVCache

    def __init__(self, cfg: TargetConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor):
        self.cfg = cfg
        self.embed_weight = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self._lm_head = lm_head  # [vocab, hidden]; the same tensor as embed when tied
        self.dtype, self.device = embed.dtype, embed.device
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self._rope = rope_tables(cfg.rope, cfg.head_dim)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)  # what SDPA uses by default
        self.step_ops = TorchStepOps()  # the fixed-width step's fused ops (Engine.load may pick kernels)
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=self.dtype, device=self.device)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", checkpoint: Checkpoint | None = None) -> "Qwen3Target":
        """Load an HF Qwen3 directory (config.json + single or sharded safetensors); `checkpoint`:
        its headers when the caller opened them already (`Engine.load`)."""
        path = Path(path)
        cfg = load_target_config(path)
        if cfg.model_type != cls.model_type:
            raise ConfigError(f"{cfg.source}: model_type {cfg.model_type!r} is not a {cls.model_type} target")
        loader = _Loader(open_checkpoint(path) if checkpoint is None else checkpoint, cfg, dtype, torch.device(device))
        loader.check_all()
        embed = loader.get("model.embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_hidden_layers)]
        # HF ties lm_head to the embedding whenever tie_word_embeddings is set, even if the
        # checkpoint also carries an lm_head.weight.
        lm_head = embed if cfg.tie_word_embeddings else loader.get("lm_head.weight")
        extra = sorted(set(loader.ckpt.tensors) - set(loader.shapes) - {"lm_head.weight"})
        if extra:
            log.warning("%s: %d tensor(s) not used by the %s target, e.g. %s", path, len(extra), cfg.model_type,
                        extra[0])
        return cls(cfg, embed, layers, loader.get("model.norm.weight"), lm_head)

    def ensure_positions(self, rows: int) -> None:
        """cos/sin tables reaching at least `rows` positions (grown, never shrunk; the step
        runner makes them once at full length before capturing CUDA graphs)."""
        if self._cos.shape[0] < rows:
            # Same float32 product as transformers (position * inv_freq), then cast: slicing the
            # table later gives exactly the values a per-call computation would.
            positions = torch.arange(rows, device=self.device)
            self._cos, self._sin = cos_sin(self._rope, positions, self.dtype)

    def new_state(self, rows: int) -> KVCache:
        """A session's state: a static KV cache of `rows` positions (the runner sizes it)."""
        # the family's state class: an MoE family's also holds its fixed steps' live rows
        return self.state_class(self.n_layers, self.n_kv, rows, self.head_dim, self.dtype, self.device)

    # ----------------------------------------------------------------------- forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows `[t, hidden]` (model dtype) for ids `[t]` (the step ops' gather: a
        copy of the rows either way)."""
        return self.step_ops.embed(ids, self.embed_weight)

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids [t]` at positions `start..start+t-1` over the cached prefix.

        Writes the new K/V at `[start, start+t)` and sets `cache.length = start+t`; `start` may be
        below `cache.length` (an implicit truncate). Returns the final-normed hidden `[t, hidden]`
        and, when `taps` is given, the tapped layer outputs `[t, len(taps)*hidden]` in `taps` order.
        """
        t = ids.shape[0]
        end = start + t
        self.check_span(start, t, cache)
        self.ensure_positions(end)
        if taps:
            self.check_taps(taps)
        x = self.embed(ids)
        cos, sin = self._cos[start:end], self._sin[start:end]
        mask = self._mask(start, t) if self.step_ops.prefill_mask else None
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        for li, w in enumerate(self.layers):
            x = self._layer(x, w, cache.kv[li], start, cos, sin, mask)
            if li in wanted:
                tapped[li] = x
        cache.length = end
        hidden = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return hidden, taps_out

    batched_taps = True

    @torch.no_grad()
    def forward_taps(self, ids: torch.Tensor, taps: Sequence[int],
                     lengths: Sequence[int] | None = None) -> torch.Tensor:
        """`TargetBase.forward_taps` with the batch's `B*L` rows in each layer's matmuls at once
        (a training batch's taps: one pass instead of B), attention per sequence (causal, from
        position 0, no cache written), stopping after the deepest tap. Padding rows past a
        sequence's length run too and are zeroed after: causal attention keeps them out of the
        earlier positions. The rows agree with `forward`'s to rounding (matmuls of another row
        count may sum in another order)."""
        self.check_tap_batch(ids, taps)
        B, L = ids.shape
        self.ensure_positions(L)
        flat = ids.reshape(-1).to(self.device)
        x = self.embed(flat)  # [B*L, hidden]
        cos, sin = self._cos[:L].repeat(B, 1), self._sin[:L].repeat(B, 1)  # each sequence's positions 0..L-1
        mask = self._mask(0, L) if self.step_ops.prefill_mask else None
        wanted = set(taps)
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        for li in range(max(taps) + 1):
            x = self._batch_layer(x, self.layers[li], B, L, cos, sin, mask)
            if li in wanted:
                tapped[li] = x
        return batch_taps(tapped, taps, B, L, ids.device, lengths)

    def _batch_layer(self, x: torch.Tensor, w: LayerWeights, B: int, L: int, cos: torch.Tensor,
                     sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`_layer` over B sequences' rows `x [B*L, hidden]` with no cache: the projections and
        the MLP over every row, the attention one sequence at a time over its own keys."""
        q, k, v = self._qkv(rms_norm(x, w.attn_norm, self.cfg.rms_norm_eps), w, cos, sin)
        q, k, v = q.view(B, L, *q.shape[1:]), k.view(B, L, *k.shape[1:]), v.view(B, L, *v.shape[1:])
        attn = torch.cat([self.step_ops.prefill_attention(q[b], k[b].transpose(0, 1), v[b].transpose(0, 1), mask)
                          for b in range(B)])
        return self._mlp(x + _linear(attn, w.wo, w.bo), w)

    def _mask(self, start: int, t: int) -> torch.Tensor | None:
        """Boolean `[g*t, start+t]` (True = attend): full over the cache, causal within the rows.

        Rows are repeated per query group because `_attend` folds the g query heads that share
        a KV head into the row axis. None for one row (it sees every cached position).
        """
        if t == 1:
            return None
        keys = torch.arange(start + t, device=self.device)
        queries = torch.arange(start, start + t, device=self.device)
        mask = keys[None, :] <= queries[:, None]
        return mask.repeat(self.n_heads // self.n_kv, 1)

    def _layer(self, x: torch.Tensor, w: LayerWeights, kv: torch.Tensor, start: int,
               cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One pre-norm decoder layer on `x [t, hidden]`; `kv [2, n_kv, max_len, head_dim]`."""
        end = start + x.shape[0]
        q, k, v = self._qkv(rms_norm(x, w.attn_norm, self.cfg.rms_norm_eps), w, cos, sin)
        kv[0, :, start:end] = k.transpose(0, 1)
        kv[1, :, start:end] = v.transpose(0, 1)
        x = x + self._attend_over(q, w, kv[0, :, :end], kv[1, :, :end], mask)
        return self._mlp(x, w)

    def _qkv(self, h: torch.Tensor, w: LayerWeights, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused q/k/v projection of `h [t, hidden]`, per-head q/k RMSNorm (where the family has
        it), rope: q `[t, n_heads, hd]`, k and v `[t, n_kv, hd]`."""
        t, nh, nkv, hd = h.shape[0], self.n_heads, self.n_kv, self.head_dim
        q, k, v = _linear(h, w.wqkv, w.bqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = q.view(t, nh, hd), k.view(t, nkv, hd)
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, self.cfg.rms_norm_eps), rms_norm(k, w.k_norm, self.cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(t, nkv, hd)

    def _attend_over(self, q: torch.Tensor, w: LayerWeights, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention of `q [t, n_heads, hd]` over `keys/values [n_kv, n, hd]`, then o_proj.

        The g query heads of each KV head are folded into rows: `[nkv, g*t, hd]` attends to
        `[nkv, n, hd]` directly, so K/V are never repeated (HF's repeat_kv copies them)."""
        return _linear(self.step_ops.prefill_attention(q, keys, values, mask), w.wo, w.bo)

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The residual MLP half of a layer: `x + down(silu(gate) * up)` of the normed `x`."""
        gate, up = _linear(rms_norm(x, w.mlp_norm, self.cfg.rms_norm_eps), w.w_gate_up).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, w.w_down)

    def _step_mlp(self, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `w`'s dense MLP weights `(w_gate_up, w_down)`, which the fixed step runs as
        `swiglu` then `linear_add_rms_norm` (the down projection with the next norm); None where
        the feed-forward is `_step_ffn`'s other kind (a family's override says which)."""
        return w.w_gate_up, w.w_down

    def _step_ffn(self, h: torch.Tensor, li: int, w: LayerWeights) -> torch.Tensor:
        """The fixed-width step's feed-forward of layer `li` on the normed `h [W, hidden]`
        (before the residual add): a family with another feed-forward overrides this."""
        ops = self.step_ops
        return ops.linear(ops.swiglu(h, w.w_gate_up), w.w_down)

    def _step_ffn_add_norm(self, h: torch.Tensor, x: torch.Tensor, li: int, w: LayerWeights,
                           next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_step_ffn`, the residual add onto `x [W, hidden]` and the norm after it ->
        (normed, new residual): a family whose feed-forward can end in that add and norm (the
        MoE combine's launch) overrides this."""
        return self.step_ops.add_rms_norm(self._step_ffn(h, li, w), x, next_norm, self.cfg.rms_norm_eps)

    # ----------------------------------------------------------------------- heads

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[t, vocab]` float32 logits of final-normed `hidden [t, hidden]`.

        The matmul runs in the model dtype (as HF's lm_head) and is widened afterwards, so bf16
        logits, and hence argmax ties, are exactly HF's.
        """
        return self.lm_head(hidden).float()

    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` before the widening: `[t, vocab]` in the model dtype (widening it to float32
        is exact, so a consumer that widens as it reads sees the same numbers). `weight`: rows
        of the lm_head to use instead (a draft vocabulary's, spec/draft_vocab.py): `[t, rows]`."""
        return self.step_ops.linear(hidden, self._lm_head if weight is None else weight)

    def _step_keys(self, cache: KVCache) -> int:
        """The cache rows a step's attention reads: on the CPU, in an eager step (the runner set
        `cache.live_keys`), the live ones in whole key blocks (the blocked attention's bits do
        not depend on the cut); else the storage (a graph replays one shape; the kernels read
        the live keys themselves)."""
        if self.device.type != "cpu" or cache.live_keys is None:
            return cache.max_len
        return key_extent(cache.live_keys, cache.max_len)

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    taps: Sequence[int] | None = None, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-width step with every shape static and every position on the device.

        `ids [W]` at `positions [W]` (consecutive): each layer is a fused projection, then the
        step ops (`self.step_ops`, layers/step_ops.py: torch reference or Triton kernels) do
        q/k norm + rope + the K/V write, causal attention by position over the cache, the
        residual add fused with the next norm (`linear_add_rms_norm`: with the kernels, folded
        into the projection before it and the matmul after it), and SiLU·mul (the embedding
        gather fused with the first norm). Nothing reads a device value (an eager CPU step cuts the keys at the host int
        `cache.live_keys`, a graph body never), so
        a CUDA graph can capture it, and every op is row-count invariant, so a token's logits do
        not depend on what shares its step or on the storage size. `widen=False` returns the
        lm_head's model-dtype logits (an argmax of them is the float32 copy's: the widening is
        exact and keeps the order), without writing that copy. The weight matmuls are the step
        ops' `linear` too (cuBLAS, or the few-row kernel on the shapes it wins). The taps
        `[W, n_taps*hidden]`: each tapped residual written into its columns by the op that makes
        it (`_tap_slots`), else concatenated.
        """
        h, taps_out = self._static_hidden(ids, positions, cache, taps)
        return (self.logits(h) if widen else self.lm_head(h)), taps_out

    def static_step_picks(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                          taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A greedy round's step: `static_step(widen=False)` and the argmax of its logits ->
        (picks int64 `[W]`, model-dtype logits `[W, vocab]`, taps), the lm_head and its argmax
        one step op (`lm_head_argmax`: one launch with the kernels)."""
        h, taps_out = self._static_hidden(ids, positions, cache, taps)
        logits, picks = self.step_ops.lm_head_argmax(h, self._lm_head)
        return picks, logits, taps_out

    def _static_hidden(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       taps: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`static_step` up to the final norm: (normed hidden `[W, hidden]`, taps); with the
        kernels the hidden may be a `PendingNorm` that the lm_head's matmul norms (step_ops.py)."""
        ops, eps = self.step_ops, self.cfg.rms_norm_eps
        self.ensure_positions(cache.max_len)
        taps_out, slots = self._tap_slots(taps, ids.shape[0])
        h, x = ops.embed_rms_norm(ids, self.embed_weight, self.layers[0].attn_norm, eps,
                                  rows_out=slots.get(-1))  # = rms_norm(embed(ids))
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        keys = self._step_keys(cache)
        last = len(self.layers) - 1
        for li, w in enumerate(self.layers):
            kv = cache.kv[li]
            q = ops.qkv_rope_kv_write(h, w.wqkv, w.bqkv, w.q_norm, w.k_norm, self._cos, self._sin, positions, kv[0],
                                      kv[1], self.n_heads, self.n_kv, eps)
            attn = ops.attention(q, kv[0, :, :keys], kv[1, :, :keys], positions, self.scale)
            mlp = self._step_mlp(w)
            # each norm names the weight that multiplies its output next, which may fold it (step_ops.py)
            h, x = ops.linear_add_rms_norm(attn, w.wo, w.bo, x, w.mlp_norm, eps, mlp[0] if mlp else None)
            next_norm, next_w = (self.norm, self._lm_head) if li == last else \
                (self.layers[li + 1].attn_norm, self.layers[li + 1].wqkv)
            if mlp:
                h, x = ops.linear_add_rms_norm(ops.swiglu(h, mlp[0]), mlp[1], None, x, next_norm, eps, next_w,
                                               out=slots.get(li))
            else:  # a family's own feed-forward, the add and the norm (the MoE combine's launch)
                h, x = self._step_ffn_add_norm(h, x, li, w, next_norm)
            if li in wanted:
                tapped[li] = x
        if taps and taps_out is None:
            taps_out = torch.cat([tapped[i] for i in taps], dim=-1)
        return h, taps_out

    def _tap_slots(self, taps: Sequence[int] | None, rows: int) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """(taps `[rows, n_taps*hidden]`, {layer: its column slice}) where every tapped residual is
        written by an op that takes an output (the embedding's, a dense MLP's down projection): the
        step then writes each tap into its place, and no concatenation follows it. Else (None, {}):
        the step concatenates its taps (an MoE layer's combine writes its own rows)."""
        if not taps or len(set(taps)) != len(taps) or any(li >= 0 and not self._step_mlp(self.layers[li])
                                                          for li in taps):
            return None, {}
        d = self.cfg.hidden_size
        out = torch.empty((rows, len(taps) * d), dtype=self.dtype, device=self.device)
        return out, {li: out[:, j * d:(j + 1) * d] for j, li in enumerate(taps)}
