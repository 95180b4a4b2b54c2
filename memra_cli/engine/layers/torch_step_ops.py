"""The step ops' torch reference (`TorchStepOps`, any device) and its CPU paths.

The seam's contract (every op's signature and rule) is layers/step_ops.py's docstring. On the
CPU the step's attention is `blocked_attention` (64-key blocks at absolute positions, so a row's
bits depend on its own keys only; `key_extent` is the storage cut a caller that knows the live
length passes), float32 weight matmuls of `ONEDNN_MIN_ROWS`+ rows run on oneDNN
(`onednn_linear`), and an eager caller's markov chain loops in numpy (`markov_chain_host`).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from memra_cli.engine.layers.deltanet import (conv_silu_update, gated_delta_replay, gated_delta_replay_dev,
                                              gated_delta_restore, gated_delta_step, ring_window, rms_norm_1p,
                                              stash_restore)
from memra_cli.engine.layers.ops import sdpa
from memra_cli.engine.layers.rope import apply_partial_rope
from memra_cli.engine.layers.unfused import (unfused_lm_head_argmax, unfused_qkv_rope_kv_write, unfused_router_route,
                                             unfused_swiglu)
from memra_kernels.activation_ref import silu_mul_ref
from memra_kernels.argmax_ref import row_argmax_ref
from memra_kernels.moe_route_ref import moe_route_ref
from memra_kernels.gather_ref import confidence_raw_ref, embed_rows_ref, pack_round_ref
from memra_kernels.gemma4_ref import (gelu_tanh_mul_ref, gemma_add_norm_ref, gemma_add_two_norms_ref,
                                      gemma_qk_norm_rope_kv_write_ref,
                                      softcap_ref)
from memra_kernels.markov_ref import markov_bias_ref, markov_chain_body
from memra_kernels.moe_ref import (moe_gemma_add_norm_ref, moe_swiglu_add_rms_norm_ref, moe_swiglu_ref,
                                   moe_swiglu_shared_add_rms_norm_1p_ref)
from memra_kernels.norm_ref import (add_rms_norm_1p_ref, add_rms_norm_ref, embed_rms_norm_1p_ref, embed_rms_norm_ref,
                                    gated_rms_norm_heads, rms_norm_ref)
from memra_kernels.qwen35_ref import gdn_gates_body, window_after
from memra_kernels.rope_ref import qk_norm_rope_kv_write_ref, rope_kv_write_ref, rope_ref
from memra_kernels.settle_ref import settle_round


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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (int64 `[rows]` for `x [rows, V]`); a float32 CPU matrix through numpy. The
    same picks: both return each row's first index of its maximum, a NaN counting as the
    maximum. Why: torch's CPU argmax took ~39 µs over a 16-row verify's `[16, 4096]` logits on
    the dev CPU and numpy's ~5 (docs/perf.md, "The DSpark round on the CPU")."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.requires_grad:
        return x.argmax(dim=-1)
    return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))


# A float32 weight matmul of a few rows on the CPU: torch's F.linear goes to MKL's sgemm, which
# on the dev CPU (AMD EPYC, AVX-512) runs 8-16 rows at ~1.6x oneDNN's time; at 1-4 rows MKL is
# faster (docs/perf.md, "The DSpark round on the CPU"). The choice depends on the row count and
# dtype only, so a fixed-width step's rows always take the same kernel: the step-width rule holds.
ONEDNN_MIN_ROWS = 8
ONEDNN_F32 = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()
ONEDNN_PACK = ONEDNN_F32 and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# bfloat16 through oneDNN needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on a CPU without them
# (an AVX2-only one) oneDNN refuses the bf16 matmul, and F.linear serves it
ONEDNN_BF16 = ONEDNN_PACK and bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if ONEDNN_BF16 else (torch.float32,)


def onednn_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `onednn_linear` takes this call: float32 or bfloat16 CPU tensors, `x [t, in]`, a
    contiguous weight (and bias) of x's dtype. (torch's bfloat16 F.linear is oneDNN's matmul
    already, which reorders the weight every call; over the packed weight, the same bits.)"""
    return (x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES and w.dtype == x.dtype and x.dim() == 2
            and not x.requires_grad and not w.requires_grad and w.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` through oneDNN's matmul (`x [t, in]`, `w [out, in]` -> `[t, out]`):
    the same products, summed in oneDNN's order (float32 rounding differences only). The weight
    goes in as oneDNN's own packed copy (`PACKED_WEIGHTS`) where one is kept: the same bits."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), PACKED_WEIGHTS.get(w), bias, "none", [], "")


ONEDNN_PACK_ROWS = 16  # the row count a packed layout is made for (oneDNN's hint; 2+ rows took the same bits at 16 and 64)
ONEDNN_PACK_MAX_BYTES = 1 << 30  # packed copies kept at most; a weight past it runs unpacked (same bits, slower)


class PackedWeights:
    """oneDNN's packed copy of each weight `onednn_linear` takes, made on its first call and
    dropped with the weight (a weak reference; an in-place change of the weight makes a new one).

    Why: given a plain `[out, in]` weight, oneDNN reorders it into its blocked layout on every
    call; the packed copy skips that, ~30% of a 16-row float32 matmul on the dev CPU, and the
    kernel after the reorder is the same, so are the bits for 2+ rows (tests/engine/test_cpu_step_ops.py;
    docs/perf.md, "The DSpark round on the CPU"). The copy costs the weight's bytes once more,
    up to `ONEDNN_PACK_MAX_BYTES` in all."""

    def __init__(self, max_bytes: int = ONEDNN_PACK_MAX_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._by_id: dict[int, tuple] = {}  # id(w) -> (weakref to w, w's version, packed, bytes)

    def get(self, w: torch.Tensor) -> torch.Tensor:
        """The packed copy of `w` (contiguous float32 or bfloat16 on the CPU), or `w` itself where
        none is kept (no oneDNN packing in this torch, or past the byte budget)."""
        if not ONEDNN_PACK:
            return w
        key = id(w)
        entry = self._by_id.get(key)
        if entry is not None and entry[0]() is w and entry[1] == _version(w):
            return entry[2]
        if entry is not None:
            self._drop(key)
        size = w.numel() * w.element_size()
        if self.nbytes + size > self.max_bytes:
            return w
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_ROWS)
        self._by_id[key] = (weakref.ref(w, lambda _, key=key: self._drop(key)), _version(w), packed, size)
        self.nbytes += size
        return packed

    def _drop(self, key: int) -> None:
        entry = self._by_id.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[3]


PACKED_WEIGHTS = PackedWeights()


ATTN_KEY_BLOCK = 64  # keys per block of blocked_attention: at most 63 masked keys past the live ones


class _WeightMemo:
    """Values made from long-lived weights, kept while those weights are unchanged: keyed by the
    weights' identity (an entry holds them, so an id is never reused while it lives) and in-place
    version, plus plain settings. At most `size` entries (then it starts over)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict[tuple, tuple] = {}

    def get(self, tensors: tuple, settings: tuple, make):
        key = (*map(id, tensors), *settings)
        entry = self._entries.get(key)
        if entry is not None and all(a is b and v == _version(b) for a, v, b in zip(entry[0], entry[1], tensors)):
            return entry[2]
        value = make()
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[key] = (tensors, tuple(map(_version, tensors)), value)
        return value


def _version(t: torch.Tensor) -> int:
    """`t`'s in-place version; -1 for an inference tensor (which counts none: a weight made under
    `torch.inference_mode` is taken as unchanged)."""
    return -1 if t.is_inference() else t._version


# blocked_attention's last mask, keyed by the positions' values (a step's layers pass equal
# positions; under inference_mode they count no in-place versions to key by): (positions, settings, mask)
_LAST_MASK: list = [None]


def _hidden_keys(positions: torch.Tensor, blocks: int, g: int, window: int) -> torch.Tensor:
    """`[blocks, g*t, block]` bool, True where a key is hidden from a row: past the row's
    position (or `window` or more before it). Rows folded head group major, as blocked_attention's.
    Made once per step: a call with the last call's positions and settings gets its mask."""
    settings = (blocks, g, window, positions.device)
    last = _LAST_MASK[0]
    if last is not None and last[1] == settings and last[0].shape == positions.shape and torch.equal(last[0], positions):
        return last[2]
    t = positions.shape[0]
    key_pos = torch.arange(blocks * ATTN_KEY_BLOCK, device=positions.device).view(blocks, 1, ATTN_KEY_BLOCK)
    row_pos = positions.expand(g, t).reshape(1, g * t, 1)
    hidden = key_pos > row_pos
    if window:
        hidden |= key_pos <= row_pos - window
    _LAST_MASK[0] = (positions.clone(), settings, hidden)
    return hidden


def ring_view(storage: torch.Tensor, span: int, window: int) -> torch.Tensor:
    """`storage [nkv, R, hd]`, a ring holding position j at row j % R, as the plain storage
    `[nkv, span, hd]` it stands for (a gathered copy): a position the ring does not hold reads
    another position's values, finite, and lies outside the window of every row that may read
    it, so it is masked (models/kv_cache.py `ring_rows`)."""
    rows = storage.shape[1]
    if span < rows or not window or rows < window:
        raise ValueError(f"a ring of {rows} rows cannot serve {span} positions with window {window or 'none'}")
    return storage.index_select(1, torch.arange(span, device=storage.device) % rows)


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
    any order. So a row's result is a function of its own keys and position only. The mask is
    made once per step (`_hidden_keys`: every layer of a step passes the same positions)."""
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
    scores.masked_fill_(_hidden_keys(positions, blocks, g, window), -math.inf)
    weights = scores.sub_(scores.amax((1, 3), keepdim=True)).exp_()
    total = weights.sum(-1, keepdim=True).cumsum(1)[:, -1]  # [nkv, g*t, 1]
    vb = (values.float() if wide else values).view(nkv, blocks, block, hd)
    out = torch.matmul(weights, vb).cumsum(1)[:, -1] / total
    out = out.to(q.dtype) if wide else out
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)


_QK_NORM_WEIGHTS = _WeightMemo(256)  # each layer's q and k norm weights side by side


def qk_norm_rope_kv_write_cpu(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int,
                              eps: float) -> torch.Tensor:
    """`qk_norm_rope_kv_write_ref`'s bits with half its ops, on CPU tensors: the q and k heads
    (side by side in `qkv [t, (nh + 2 nkv) hd]`) go through one norm, under the two weights side by
    side, and one rope. Every element is the same operation on the same operands (a norm's
    statistic is a sum over its own head's hd values, whatever rows sit beside it:
    tests/engine/test_cpu_step_ops.py checks the bits). Why: on the CPU the op is ~25 small torch
    ops a layer and their dispatch, not their arithmetic, is most of its time (docs/perf.md,
    "The DSpark round on the CPU"). Returns q `[t, nh, hd]` (a view: rows of nh + nkv heads)."""
    if qkv.device.type != "cpu":  # another device's reductions may pick their order by shape
        return qk_norm_rope_kv_write_ref(qkv, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache,
                                         n_heads, n_kv, eps)
    t, hd = qkv.shape[0], q_norm_w.shape[0]
    heads = n_heads + n_kv
    weights = _QK_NORM_WEIGHTS.get((q_norm_w, k_norm_w), (n_heads, n_kv),
                                   lambda: torch.cat([q_norm_w.expand(n_heads, hd), k_norm_w.expand(n_kv, hd)]))
    qk = rope_ref(rms_norm_ref(qkv[:, :heads * hd].reshape(t, heads, hd), weights, eps), cos[positions], sin[positions])
    k_cache.index_copy_(1, positions, qk[:, n_heads:].transpose(0, 1))
    v_cache.index_copy_(1, positions, qkv[:, heads * hd:].reshape(t, n_kv, hd).transpose(0, 1))
    return qk[:, :n_heads]


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
                     scale: torch.Tensor | None = None, pre_norm=None, bound: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`moe_route` of the router's logits `linear(x, router)` (model dtype), through this
        instance's two ops; `pre_norm` `(weight, factor, eps)`: x through Gemma 4's router norm
        first (`moe_route_ref.router_pre_norm_ref`); rows from the host `bound` on (the state's
        `reading_rows`) padding too, whatever `live` says."""
        return unfused_router_route(self, x, router, k, normalize, live, counts, scale, pre_norm, bound)

    @staticmethod
    def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ w.T (+ bias)` for a plain weight `[out, in]`; `w(x)` for a quantized linear. A
        float32 (or, where this CPU has oneDNN's bf16 matmul, bfloat16) call of `ONEDNN_MIN_ROWS`
        rows or more on the CPU runs on oneDNN over its packed weight (`onednn_linear`)."""
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
                            consumer=None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm(linear(a, w, bias), residual, norm_w, eps)` -> (normed, new residual);
        `consumer` (the weight that multiplies the normed rows next) is the kernels' hint only;
        `out` (`[t, d]`, a contiguous last axis) receives the new residual, and is returned."""
        return cls.add_rms_norm(cls.linear(a, w, bias), residual, norm_w, eps, res_out=out)

    @classmethod
    def linear_rms_norm(cls, a: torch.Tensor, w, norm_w: torch.Tensor, eps: float, consumer=None) -> torch.Tensor:
        """`rms_norm(linear(a, w), norm_w, eps)`; `consumer` (the weight, or weights, that
        multiply the normed rows next) is the kernels' hint only."""
        return cls.rms_norm(cls.linear(a, w), norm_w, eps)

    # the op's one torch body (qk_norm_rope_kv_write_ref), in fewer ops on the CPU, bit for bit
    qk_norm_rope_kv_write = staticmethod(qk_norm_rope_kv_write_cpu)

    rope_kv_write = staticmethod(rope_kv_write_ref)  # no q/k norm (LLaMA): the op's one torch body

    gemma_qk_norm_rope_kv_write = staticmethod(gemma_qk_norm_rope_kv_write_ref)  # Gemma 4's: its one torch body
    gemma_add_norm = staticmethod(gemma_add_norm_ref)  # Gemma 4's residual add + norms: the op's one torch body
    gemma_add_two_norms = staticmethod(gemma_add_two_norms_ref)  # and a second norm: its one torch body
    gelu_tanh_mul = staticmethod(gelu_tanh_mul_ref)  # Gemma 4's MLP activation: the op's one torch body
    softcap = staticmethod(softcap_ref)  # the logits' softcap: the op's one torch body

    @classmethod
    def draft_attention(cls, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        positions: torch.Tensor, scale: float) -> torch.Tensor:
        """A drafter block's attention: `attention`, causal by position (the kernels' seam runs
        it on the drafter's own tile)."""
        return cls.attention(q, k_cache, v_cache, positions, scale)

    @staticmethod
    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  positions: torch.Tensor, scale: float, window: int = 0, span: int | None = None) -> torch.Tensor:
        """Causal by position over the cache; `window` W > 0 also masks keys j <= p - W. On the
        CPU `blocked_attention` (live key blocks only, storage-size independent); elsewhere over
        the whole storage under a position mask. K/V are never repeated: the g query heads of a
        KV head are folded into rows. `span` (a ring storage: `ring_view`): over the storage
        the ring stands for, so the same bits as a plain storage holding the same keys."""
        if span is not None and span != k_cache.shape[1]:
            k_cache, v_cache = ring_view(k_cache, span, window), ring_view(v_cache, span, window)
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
                     dtype: torch.dtype, host_loop: bool = False, with_anchor: bool = False) -> torch.Tensor:
        """Greedy chain over `logits [n, V]` (float32, or the model dtype) -> tokens `[n]`: slot k
        takes `argmax(logits[k] + linear(w1[prev], w2))` in `dtype`, prev starting at `anchor`.
        `with_anchor`: `[1 + n]`, the anchor first (a round's candidates `[last, drafts]`).

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
            chain = markov_chain_host(logits, anchor, table)
        elif table is not None:
            chain = markov_chain_body(logits, anchor, lambda prev: table[prev])
        else:
            chain = markov_chain_body(logits, anchor, lambda prev: self.markov_bias(w1, w2, prev, dtype))
        return torch.cat([anchor.reshape(1).to(chain), chain]) if with_anchor else chain

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

    def markov_chain_confidence(self, logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                                w2: torch.Tensor, dtype: torch.dtype, hidden, conf_w: torch.Tensor,
                                conf_b: torch.Tensor, conf_w1: torch.Tensor | None = None,
                                host_loop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's greedy chain with the anchor first `[1 + n]` and its slots' confidence raws
        `[n]`: `markov_chain(..., with_anchor=True)`, then `confidence_raw(hidden, conf_w, conf_b,
        prev, conf_w1)` with `prev` = the candidates' first n (each slot's previous token; none
        without `conf_w1`, a head without the markov features)."""
        chain = self.markov_chain(logits, anchor, w1, w2, dtype, host_loop=host_loop, with_anchor=True)
        prev = chain[:-1] if conf_w1 is not None else None
        return chain, self.confidence_raw(hidden, conf_w, conf_b, prev, conf_w1)

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
