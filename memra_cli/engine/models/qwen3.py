"""Qwen3 dense causal LM (HF `model_type: qwen3`) for inference: prefill, verify, taps.

Built for the speculative round loop and GPU-ready from the start:

- one static KV cache per session, preallocated at its full length; `truncate(n)` is the
  rollback after a partially accepted verify (it only moves `length`, K/V past it are stale
  and get overwritten by the next write);
- `forward` takes the start position as a python int, so slicing, masks and cache writes never
  read a device value back (no host sync inside a forward);
- q/k/v and gate/up projections are fused at load (one matmul each instead of three / two);
- with `step_width` W set, every step after the prefill (plain decode and verify alike) runs at
  exactly W rows: shorter steps are padded, longer verifies go in W-row chunks. Every kernel then
  sees the same shapes whether a token is decoded alone or verified with 15 others, and since
  no kernel mixes rows, a token's logits are bit-identical either way. That is what makes
  speculative output equal plain greedy in bf16, where GEMMs pick different kernels (with
  different reduction orders) for 1 and 16 rows and near-tied argmaxes flip.

Numerics follow `transformers.Qwen3ForCausalLM`: RMSNorm in float32 then `weight * x.to(dtype)`,
per-head q/k RMSNorm before RoPE, cos/sin formed in float32 then cast to the model dtype,
lm_head in the model dtype (so bf16 logits round exactly where HF's do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.config import TargetConfig, load_target_config
from memra_cli.engine.errors import CheckpointError, ConfigError, PromptError
from memra_cli.engine.layers.ops import rms_norm
from memra_cli.engine.layers.rope import apply_rope, cos_sin, rope_tables

log = logging.getLogger(__name__)
CACHE_BUCKET = 256  # pooled cache lengths are multiples of this (CUDA graphs bind a storage)


# --------------------------------------------------------------------------- pieces


@dataclass
class LayerWeights:
    """One decoder layer's tensors, fused where that saves a matmul.

    wqkv `[(n_heads + 2*n_kv)*head_dim, hidden]`, wo `[hidden, n_heads*head_dim]`,
    w_gate_up `[2*intermediate, hidden]`, w_down `[hidden, intermediate]`, norms `[hidden]`
    or `[head_dim]` (q_norm, k_norm); biases only when `attention_bias` is true.
    """

    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


class KVCache:
    """Static K/V for one session: `kv [n_layers, 2, n_kv, max_len, head_dim]`.

    Heads before positions so each layer's `kv[l, 0, :, :end]` is what attention reads, with no
    transpose. `length` (a python int) is how many leading positions are valid.
    """

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.kv = torch.zeros(n_layers, 2, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.step_graphs: dict = {}  # taps -> StepGraph captured over this storage (graphs.py)
        self._free_list: list | None = None  # the target's pool to return to on release()

    def release(self) -> None:
        """Hand the storage (and the CUDA graphs captured over it) back to the target's pool for
        the next session; a no-op for an unpooled cache. Use the cache no more after this."""
        if self._free_list is not None:
            free, self._free_list = self._free_list, None
            free.append(self)  # `length` stays readable until the next session takes it

    def truncate(self, n: int) -> None:
        """Roll back to the first `n` positions (no copy: later rows are simply overwritten)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0


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
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
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


class _Loader:
    """Reads named tensors from a checkpoint, checking each against the config's shape."""

    def __init__(self, ckpt: Checkpoint, cfg: TargetConfig, dtype: torch.dtype, device: torch.device):
        self.ckpt, self.cfg, self.dtype, self.device = ckpt, cfg, dtype, device
        self.shapes = expected_shapes(cfg)

    def check_all(self) -> None:
        """Refuse before loading anything: a missing tensor or a wrong shape, named."""
        for name, shape in self.shapes.items():
            info = self.ckpt.tensors.get(name)
            tail = f"(expected shape {list(shape)} from {self.cfg.source})"
            if info is None:
                hint = ""
                if name == "lm_head.weight":
                    hint = " — lm_head.weight is needed because tie_word_embeddings is false"
                raise CheckpointError(f"{self.ckpt.root}: tensor '{name}' is missing {tail}{hint}")
            if tuple(info.shape) != shape:
                raise CheckpointError(
                    f"{info.file}: tensor '{name}' has shape {list(info.shape)}, {tail[1:-1]}"
                )

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.load(name, self.dtype, self.device)

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self.get(n) for n in names], dim=0)

    def layer(self, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = self.cfg.attention_bias
        return LayerWeights(
            wqkv=self.cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            bqkv=self.cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if bias else None,
            wo=self.get(a + "o_proj.weight"),
            bo=self.get(a + "o_proj.bias") if bias else None,
            q_norm=self.get(a + "q_norm.weight"),
            k_norm=self.get(a + "k_norm.weight"),
            attn_norm=self.get(p + "input_layernorm.weight"),
            mlp_norm=self.get(p + "post_attention_layernorm.weight"),
            w_gate_up=self.cat(m + "gate_proj.weight", m + "up_proj.weight"),
            w_down=self.get(m + "down_proj.weight"),
        )


# --------------------------------------------------------------------------- the model


class Qwen3Target:
    """Qwen3ForCausalLM inference: `forward` over a static KV cache, with optional layer taps.

    A tap id `i` is the OUTPUT of decoder layer `i` (HF `hidden_states[i+1]`, raw residual
    stream, never final-normed); `-1` is the embedding output (HF `hidden_states[0]`).
    """

    def __init__(self, cfg: TargetConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, step_width: int | None = None):
        self.cfg = cfg
        self.step_width = step_width  # rows per step after the prefill; None = each step's own width
        self.cuda_graphs = False  # replay fixed-width steps as CUDA graphs (set_cuda_graphs)
        self.draft_graphs = False  # and the drafter side of rounds over this target
        self._free_caches: dict[int, list[KVCache]] = {}  # pooled storages by length (graphs only)
        self.embed_weight = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self._lm_head = lm_head  # [vocab, hidden]; the same tensor as embed when tied
        self.dtype, self.device = embed.dtype, embed.device
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self._rope = rope_tables(cfg.rope, cfg.head_dim)
        self._cos = self._sin = torch.empty(0, cfg.head_dim, dtype=self.dtype, device=self.device)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", step_width: int | None = None) -> "Qwen3Target":
        """Load an HF Qwen3 directory (config.json + single or sharded safetensors).
        `step_width`: see `set_step_width`."""
        path = Path(path)
        cfg = load_target_config(path)
        loader = _Loader(open_checkpoint(path), cfg, dtype, torch.device(device))
        loader.check_all()
        embed = loader.get("model.embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_hidden_layers)]
        # HF ties lm_head to the embedding whenever tie_word_embeddings is set, even if the
        # checkpoint also carries an lm_head.weight.
        lm_head = embed if cfg.tie_word_embeddings else loader.get("lm_head.weight")
        extra = sorted(set(loader.ckpt.tensors) - set(loader.shapes) - {"lm_head.weight"})
        if extra:
            log.warning("%s: %d tensor(s) not used by the Qwen3 target, e.g. %s", path, len(extra), extra[0])
        model = cls(cfg, embed, layers, loader.get("model.norm.weight"), lm_head)
        model.set_step_width(step_width)
        return model

    def set_step_width(self, width: int | None) -> None:
        """Rows per decode / verify step (None: each step at its own width). Set it before any
        cache is made: caches carry `width` rows of slack for the padding."""
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
            raise ConfigError(f"step width must be a positive integer or None, got {width!r}")
        self.step_width = width
        self._free_caches.clear()
        if width is None:
            self.cuda_graphs = self.draft_graphs = False

    def set_cuda_graphs(self, on: bool, drafter: bool = False) -> None:
        """Replay every fixed-width step as a CUDA graph captured once per cache storage (and
        taps). Needs CUDA and a step width: a graph replays fixed shapes. Caches then come from
        a pool (`KVCache.release` returns them), so sessions reuse storages and their graphs.
        `drafter`: the proposers of sessions over this target graph their rounds too
        (engine/draft_graphs.py; experimental: see docs/perf.md)."""
        if on and (self.device.type != "cuda" or self.step_width is None):
            raise ConfigError("CUDA graphs need the target on a CUDA device and a fixed step width "
                              f"(device {self.device}, step width {self.step_width})")
        self.cuda_graphs = bool(on)
        self.draft_graphs = bool(on and drafter)
        self._free_caches.clear()
        if on:
            # Graphs read the rope tables by address: make them once at their largest (every
            # pooled length fits), so a later, longer session never replaces a captured table.
            self._ensure_rope_rows(-(-(self.cfg.max_position_embeddings + self.step_width) // CACHE_BUCKET) * CACHE_BUCKET)

    def _ensure_rope_rows(self, rows: int) -> None:
        """cos/sin tables reaching at least `rows` positions (grown, never shrunk)."""
        if self._cos.shape[0] < rows:
            # Same float32 product as transformers (position * inv_freq), then cast: slicing the
            # table later gives exactly the values a per-call computation would.
            positions = torch.arange(rows, device=self.device)
            self._cos, self._sin = cos_sin(self._rope, positions, self.dtype)

    # ----------------------------------------------------------------------- shape facts

    @property
    def n_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[vocab, hidden]` in the model dtype (the drafter projects its rows through it)."""
        return self._lm_head

    # ----------------------------------------------------------------------- validation

    def check_prompt(self, prompt_ids: Sequence[int], max_new: int, max_len: int | None = None) -> None:
        """Refuse an empty prompt, ids outside the vocabulary, or a length past the limits."""
        n, source = len(prompt_ids), self.cfg.source
        if n == 0:
            raise PromptError("the prompt is empty (need at least one token id)")
        for i, tok in enumerate(prompt_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise PromptError(
                    f"prompt token id {tok!r} at index {i} is outside the vocabulary "
                    f"[0, {self.vocab_size}) of {source}"
                )
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise PromptError(f"max_new must be an integer >= 0, got {max_new!r}")
        total = n + max_new
        if total > self.cfg.max_position_embeddings:
            raise PromptError(
                f"prompt ({n} tokens) + max_new ({max_new}) = {total} exceeds "
                f"max_position_embeddings {self.cfg.max_position_embeddings} of {source}"
            )
        if max_len is not None and total > max_len:
            raise PromptError(
                f"prompt ({n} tokens) + max_new ({max_new}) = {total} exceeds the KV cache "
                f"({max_len} positions)"
            )

    def check_taps(self, taps: Sequence[int]) -> None:
        """Tap ids must be -1 (embedding) or a layer index of this target."""
        for tap in taps:
            if isinstance(tap, bool) or not isinstance(tap, int) or not -1 <= tap < self.n_layers:
                raise ConfigError(
                    f"tap layer id {tap!r} (in target_layer_ids {list(taps)}) is outside "
                    f"[-1, {self.n_layers - 1}] for the {self.n_layers}-layer target {self.cfg.source}"
                )

    # ----------------------------------------------------------------------- cache

    def new_cache(self, max_len: int) -> KVCache:
        """A static KV cache of `max_len` positions (and rope tables that reach that far)."""
        limit = self.cfg.max_position_embeddings
        if not 1 <= max_len <= limit:
            raise PromptError(
                f"KV cache length {max_len} is outside [1, {limit}] "
                f"(max_position_embeddings of {self.cfg.source})"
            )
        # Fixed-width steps write their padding rows past the last real position: room for them
        # (their K/V are never read: later rows are causal-masked from them, then overwrite them).
        rows = max_len + (self.step_width or 0)
        if self.cuda_graphs:  # pooled, in buckets, so the next session finds a storage (and graphs)
            rows = -(-rows // CACHE_BUCKET) * CACHE_BUCKET
        self._ensure_rope_rows(rows)
        if not self.cuda_graphs:
            return KVCache(self.n_layers, self.n_kv, rows, self.head_dim, self.dtype, self.device)
        free = self._free_caches.setdefault(rows, [])
        cache = free.pop() if free else KVCache(self.n_layers, self.n_kv, rows, self.head_dim, self.dtype, self.device)
        cache.length, cache._free_list = 0, free
        return cache

    # ----------------------------------------------------------------------- forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows `[t, hidden]` (model dtype) for ids `[t]`."""
        return F.embedding(ids, self.embed_weight)

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids [t]` at positions `start..start+t-1` over the cached prefix.

        Writes the new K/V at `[start, start+t)` and sets `cache.length = start+t`; `start` may be
        below `cache.length` (an implicit truncate). Returns the final-normed hidden `[t, hidden]`
        and, when `taps` is given, the tapped layer outputs `[t, len(taps)*hidden]` in `taps` order.
        """
        t = ids.shape[0]
        end = start + t
        self._check_span(start, t, cache)
        if taps:
            self.check_taps(taps)
        x = self.embed(ids)
        cos, sin = self._cos[start:end], self._sin[start:end]
        mask = self._mask(start, t)
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

    def _check_span(self, start: int, t: int, cache: KVCache) -> None:
        if t < 1:
            raise PromptError("forward needs at least one token id")
        if not 0 <= start <= cache.length:
            # a gap would attend to stale rows: only re-writing or appending is meaningful
            raise ValueError(f"start {start} is past the cache length {cache.length}")
        if start + t > cache.max_len:
            raise PromptError(
                f"positions up to {start + t} exceed the KV cache ({cache.max_len} positions); "
                "allocate a longer cache for this prompt + max_new"
            )

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
        """Fused q/k/v projection of `h [t, hidden]`, per-head q/k RMSNorm, rope:
        q `[t, n_heads, hd]`, k and v `[t, n_kv, hd]`."""
        t, nh, nkv, hd = h.shape[0], self.n_heads, self.n_kv, self.head_dim
        q, k, v = F.linear(h, w.wqkv, w.bqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(rms_norm(q.view(t, nh, hd), w.q_norm, self.cfg.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(k.view(t, nkv, hd), w.k_norm, self.cfg.rms_norm_eps), cos, sin)
        return q, k, v.view(t, nkv, hd)

    def _attend_over(self, q: torch.Tensor, w: LayerWeights, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention of `q [t, n_heads, hd]` over `keys/values [n_kv, n, hd]`, then o_proj.

        The g query heads of each KV head are folded into rows: `[nkv, g*t, hd]` attends to
        `[nkv, n, hd]` directly, so K/V are never repeated (HF's repeat_kv copies them)."""
        t, nh, nkv, hd = q.shape[0], self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
        out = out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)
        return F.linear(out, w.wo, w.bo)

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The residual MLP half of a layer: `x + down(silu(gate) * up)` of the normed `x`."""
        gate, up = F.linear(rms_norm(x, w.mlp_norm, self.cfg.rms_norm_eps), w.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.w_down)

    # ----------------------------------------------------------------------- heads

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[t, vocab]` float32 logits of final-normed `hidden [t, hidden]`.

        The matmul runs in the model dtype (as HF's lm_head) and is widened afterwards, so bf16
        logits, and hence argmax ties, are exactly HF's.
        """
        return F.linear(hidden, self._lm_head).float()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy token per row `[t]` (LongTensor on the device; ties -> lowest id)."""
        return torch.argmax(self.logits(hidden), dim=-1)

    def prefill(self, ids: torch.Tensor, cache: KVCache,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt `ids [t]` from position 0: the next token `[1]` and taps `[t, n_taps*hidden]`.

        Only the last row goes through lm_head (a 512-row prompt would otherwise cost 512 rows
        of a vocab-wide matmul for one token).
        """
        cache.reset()
        hidden, tapped = self.forward(ids, 0, cache, taps)
        return self.argmax(hidden[-1:]), tapped

    def verify(self, ids: torch.Tensor, start: int, cache: KVCache,
               taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows `ids [t]` at `start..`: argmax per row `[t]` and taps `[t, n_taps*hidden]`.

        Plain decode is a verify of one row. With `step_width` W, runs as W-row steps (below)."""
        logits, tapped = self.step_logits(ids, start, cache, taps)
        return torch.argmax(logits, dim=-1), tapped

    def step_logits(self, ids: torch.Tensor, start: int, cache: KVCache,
                    taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`verify`'s float32 logits `[t, vocab]` (and taps), under the step-width rule.

        With `step_width` W the rows run in steps of exactly W (`fixed_step`): chunks of W, the
        last padded by repeating its final id. Padding rows come after the real ones, so
        causality keeps them out of every real row; their K/V land past `cache.length` and are
        overwritten later."""
        width = self.step_width
        if width is None:
            hidden, tapped = self.forward(ids, start, cache, taps)
            return self.logits(hidden), tapped
        if taps:
            self.check_taps(taps)
        t = ids.shape[0]
        logits, tapped = [], []
        for lo in range(0, t, width):
            chunk = ids[lo:lo + width]
            n = chunk.shape[0]
            if n < width:
                chunk = torch.cat([chunk, chunk[-1:].expand(width - n)])
            lg, tp = self.fixed_step(chunk, start + lo, cache, taps)
            cache.length = start + lo + n
            logits.append(lg[:n])
            if tp is not None:
                tapped.append(tp[:n])
        if len(logits) == 1:
            return logits[0], (tapped[0] if tapped else None)
        return torch.cat(logits), (torch.cat(tapped) if tapped else None)

    def fixed_step(self, ids: torch.Tensor, start: int, cache: KVCache,
                   taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step of exactly `step_width` rows `ids [W]` at positions `start..start+W-1`:
        float32 logits `[W, vocab]` and taps `[W, n_taps*hidden]`. Does not move `cache.length`.

        Replayed from a CUDA graph when `cuda_graphs` is on (captured on first use per cache
        storage and taps; outputs are copies, safe to keep), else run eagerly — the same ops
        either way (`static_step`)."""
        width = self.step_width
        assert width is not None and ids.shape[0] == width
        self._check_span(start, width, cache)
        if self.cuda_graphs:
            from memra_cli.engine.runtime.graphs import StepGraph

            key = tuple(taps or ())
            graph = cache.step_graphs.get(key)
            if graph is None:
                graph = cache.step_graphs[key] = StepGraph(self, cache, key)
            return graph.run(ids, start)
        positions = torch.arange(start, start + width, device=self.device)
        return self.static_step(ids, positions, cache, taps)

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-width step with every shape static and every position on the device.

        `ids [W]` at `positions [W]` (consecutive): K/V written with `index_copy_`, rope rows
        gathered, and attention over the whole cache storage `[0, max_len)` under a mask built
        from `positions` (keys after a row's position are masked: stale rows included). Nothing
        depends on a host value, so a CUDA graph can capture it; masked key blocks leave the
        softmax of a row unchanged, so the storage length does not change a row's result.
        """
        x = self.embed(ids)
        cos, sin = self._cos[positions], self._sin[positions]
        keys = torch.arange(cache.max_len, device=self.device)
        mask = (keys[None, :] <= positions[:, None]).repeat(self.n_heads // self.n_kv, 1)
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        eps = self.cfg.rms_norm_eps
        for li, w in enumerate(self.layers):
            kv = cache.kv[li]
            q, k, v = self._qkv(rms_norm(x, w.attn_norm, eps), w, cos, sin)
            kv[0].index_copy_(1, positions, k.transpose(0, 1))
            kv[1].index_copy_(1, positions, v.transpose(0, 1))
            x = x + self._attend_over(q, w, kv[0], kv[1], mask)
            x = self._mlp(x, w)
            if li in wanted:
                tapped[li] = x
        hidden = rms_norm(x, self.norm, eps)
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return self.logits(hidden), taps_out
