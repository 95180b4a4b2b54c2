"""The DFlash / DSpark drafter: fresh full-context forward, cached round forward, heads.

One non-causal (per layer: see census' attention layout) transformer pass drafts a whole block
`[anchor, MASK x (b-1)]` conditioned on the target's tapped hidden states:

    ctx = hidden_norm(fc(taps))                     taps [t, n_taps*hidden] -> ctx [t, hidden]
    per layer: q from the normed block rows; k, v from [ctx ; normed block rows]
               (ctx rows are NOT input-layernormed), q/k per-head RMS norm, rope at absolute
               positions, attention of block rows over [ctx ; block], SwiGLU
    out = norm(x)                                   [b, hidden] -> target lm_head -> logits

Two paths compute it. `forward_full` recomputes everything from raw taps (the oracle contract).
`ingest` + `forward_round` cache the ctx K/V (projected, k-normed, roped) in a preallocated
`DraftKV`, so a round only projects the b block rows; block K/V are written transiently past the
committed length and never committed. Both paths must agree (tests: f32 rel err < 1e-5).

Block-level norms (input, post-attention and final, fused with the residual adds), the ctx
`hidden_norm` and SiLU·mul go through the step-ops seam (`self.step_ops`, layers/step_ops.py:
the torch reference, or the Triton kernels on CUDA, set by `Engine.arm`), as the target's step
does. The static path (`static_ingest` / `static_round`, what CUDA graphs replay) also takes
q/k norm + rope + the K/V write from the seam, and, on layers that attend to every ctx and block
key (full attention, not causal in the block), the seam's attention with every block row at the
block's last position: causal-by-position attention then sees exactly ctx + the whole block.
The eager paths keep per-head norms, rope and attention in plain torch: their positions need not
equal storage rows (forward_full, ingest at given positions), which the fused kernels assume.
With the torch ops every path computes exactly what it did before the seam (bit for bit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from memra_cli.engine.formats.names import CONF_B, CONF_W, MARKOV_W1, MARKOV_W2, OWN_EMBED, OWN_LM_HEAD
from memra_cli.engine.formats.census import Census, LayerLayout, take_census
from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.errors import CheckpointError, MemraError
from memra_cli.engine.layers.ops import gqa_attention, linear, rms_norm
from memra_cli.engine.layers.quantized import for_device, out_rows, stack_out
from memra_cli.engine.layers.rope import RopeTables, apply_rope, cos_sin, rope_tables
from memra_cli.engine.layers.torch_step_ops import TorchStepOps

log = logging.getLogger(__name__)


class DraftCapacityError(MemraError):
    """The draft KV cache is full (a session was sized too small)."""


@dataclass
class DraftLayer:
    """One drafter layer's weights. Projections `[out, in]` (or quantized linears)."""

    wq: object
    wk: object
    wv: object
    wo: object
    w_gate: object
    w_up: object
    w_down: object
    ln_in: torch.Tensor
    ln_post: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    # Fused at load (one GEMM instead of three / two) when the parts are one kind of weight:
    # plain tensors of one dtype, or quantized linears of one qtype (layers/quantized.py
    # `stack_out`). wqkv `[(nh + 2*nkv)*hd, hidden]`, wkv its k/v rows, w_gate_up `[2*ff, hidden]`;
    # the separate projections (and wkv) become views of the fused rows, so the bytes live once.
    wqkv: object | None = None
    wkv: object | None = None
    w_gate_up: object | None = None

    def fuse(self) -> "DraftLayer":
        """Concatenate the projections that share an input along out, when they can stack
        (a layer whose q has another qtype than k/v, say, keeps them separate)."""
        nq, nk = _out_features(self.wq), _out_features(self.wk)
        wqkv = stack_out([self.wq, self.wk, self.wv])
        if wqkv is not None:
            self.wqkv, self.wkv = wqkv, out_rows(wqkv, nq, _out_features(wqkv))
            self.wq = out_rows(wqkv, 0, nq)
            self.wk, self.wv = out_rows(self.wkv, 0, nk), out_rows(self.wkv, nk, _out_features(self.wkv))
        ff = _out_features(self.w_gate)
        w_gate_up = stack_out([self.w_gate, self.w_up])
        if w_gate_up is not None:
            self.w_gate_up = w_gate_up
            self.w_gate, self.w_up = out_rows(w_gate_up, 0, ff), out_rows(w_gate_up, ff, _out_features(w_gate_up))
        return self


def _out_features(w: object) -> int:
    """Rows of a plain `[out, in]` weight or a quantized linear's `shape[0]`."""
    return int(w.shape[0])  # type: ignore[attr-defined]


@dataclass
class DraftStages:
    """Per-stage outputs of one block forward (the parity stages)."""

    hidden_out: torch.Tensor  # [b, hidden] final-normed
    layer_out: torch.Tensor | None = None  # [n_layer, b, hidden] residual after each layer
    ctx_features: torch.Tensor | None = None  # [ctx, hidden]


class BlockPositions(NamedTuple):
    """A static block's positions (`Drafter.block_positions`): `rows [b]` = start..start+b-1,
    `last [b]` = start+b-1 on every row (a plain layer's attention: every block row sees the
    whole block; the kernel reads one position a row, contiguous), and `span [n]` =
    start..start+n-1, n >= b (an ingest's positions: a round ingests a verify step's rows)."""

    rows: torch.Tensor
    last: torch.Tensor
    span: torch.Tensor


class BlockTokens(NamedTuple):
    """A static block's input as token ids, for a drafter that embeds and norms it in its first
    launch (`Drafter.fuses_block_embedding`): the target's embedding `table [V, hidden]`, the
    block's ids `ids [b]` (the mask token's; element 0 stands for the anchor) and the anchor
    `first` (one element on the device, row 0's id). Rows `table[[first, ids[1:]...]]`."""

    table: torch.Tensor
    ids: torch.Tensor
    first: torch.Tensor


class DraftKV:
    """Preallocated draft K/V: per layer `[cap + block, n_kv, head_dim]`, append-only.

    Rows `[0, length)` are committed ctx rows (k normed and roped); a round writes its block K/V
    transiently at `[length, length + b)`. `positions [cap + block]` holds each row's absolute
    position (sliding-window and causal masks are computed from positions, not indices): the
    eager path writes the positions it is given; it starts as the row indices, which is what the
    static path's rows hold (row index == position), so that path writes nothing there.
    `cos`, `sin [cap + block, head_dim]` are the rope tables of every storage row (the static
    path, where row index == position, reads them by position); they belong to the storage, so
    the CUDA graphs captured over it never read a table that was replaced.
    """

    def __init__(self, n_layers: int, cap: int, block: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, rope: RopeTables | None = None):
        self.cap, self.block, self.length = cap, block, 0
        # zeros, not empty: the static round attends over the whole storage under a mask, and a
        # masked key must be finite (NaN + -inf is NaN)
        self.k = torch.zeros(n_layers, n_kv, cap + block, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.arange(cap + block, dtype=torch.long, device=device)
        self.cos = self.sin = None
        if rope is not None:  # the same float32 product as a per-call `cos_sin`, then cast
            self.cos, self.sin = cos_sin(rope, torch.arange(cap + block, device=device), dtype)
        self.graphs: dict = {}  # CUDA graphs captured over this storage (runtime/draft_graphs.py)

    @property
    def rows(self) -> int:
        """Storage rows: `cap` committed rows plus the block's transient rows."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        tables = 0 if self.cos is None else 2 * self.cos.numel() * self.cos.element_size()
        return 2 * self.k.numel() * self.k.element_size() + self.positions.numel() * 8 + tables

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.length
        self.length = n


class Drafter:
    """A loaded drafter on one device in one compute dtype."""

    # `static_round` takes a `BlockTokens` (its first launch embeds and norms the block)
    fuses_block_embedding = True

    def __init__(self, census: Census, layers: list[DraftLayer], fc: object, hidden_norm: torch.Tensor,
                 norm: torch.Tensor, extras: dict[str, object], dtype: torch.dtype, device: torch.device):
        self.census, self.cfg = census, census.config
        self.layers, self.fc, self.hidden_norm, self.norm = layers, fc, hidden_norm, norm
        self.dtype, self.device = dtype, device
        self.markov_w1 = extras.get(MARKOV_W1)  # [V, r] gathered table, kept as stored
        self.markov_w2 = extras.get(MARKOV_W2)  # [V, r] (Linear(r, V).weight), or a quantized linear
        self._markov_w2_dense: torch.Tensor | None = None  # a quantized w2's values, made on first use
        self.conf_w = extras.get(CONF_W)  # [1, in_dim], float32 (the head stays f32)
        self.conf_b = extras.get(CONF_B)  # [1]
        self.own_embed = extras.get(OWN_EMBED)
        self.own_lm_head = extras.get(OWN_LM_HEAD)
        rope = self._rope_tables()
        # inv_freq lives on the device: no host-to-device copy per call (none is allowed while a
        # CUDA graph captures the static round)
        self.rope: RopeTables = RopeTables(rope.inv_freq.to(device), rope.attention_scaling)
        self.layouts: tuple[LayerLayout, ...] = census.layers
        self.scale = self.cfg.head_dim ** -0.5
        # the fused norms / rope / SiLU·mul / attention (layers/step_ops.py); Engine.arm hands
        # the drafter the engine's, so it runs the kernels its target runs
        self.step_ops = TorchStepOps()
        self._offset_rows: dict[int, torch.Tensor] = {}  # `_offsets(n)`: arange(n), made once per n
        self._block_offsets: dict[tuple, torch.Tensor] = {}  # `block_positions`' and `round_positions`' constants
        # the draft logits' softcap (`cap * tanh(z / cap)`): a Gemma 4 drafter's (drafter_gemma4.py)
        self.logit_softcap: float | None = None

    def _rope_tables(self) -> RopeTables:
        """The rope of every layer (one table: a drafter's layers share it), float32 on the CPU."""
        return rope_tables(self.cfg.rope, self.cfg.head_dim)

    # ------------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             census: Census | None = None, weight_fn=None) -> "Drafter":
        """Load a drafter checkpoint (after its census passes).

        `weight_fn(name, ckpt, dtype, device) -> weight` may replace matmul weights (attention,
        MLP, fc and markov w2; e.g. quantize at load: quant/precision.py); by default weights
        are plain tensors in `dtype`. `path` may be a memra GGUF (formats/gguf.py), which
        loads as written: its quantized tensors become reference quantized linears built from
        the stored blocks, its float tensors load as above; a `weight_fn` of another precision
        policy than the file's is refused (one of the same policy has nothing left to do).
        """
        census = census or take_census(Path(path))
        device = torch.device(device)
        load = _TensorLoader.open(Path(path), dtype, device, weight_fn)
        layers = [load.layer(i) for i in range(census.config.num_hidden_layers)]
        return cls(census, layers, load.matmul("fc.weight"), load.plain("hidden_norm.weight"),
                   load.plain("norm.weight"), load.extras(), dtype, device)

    # ------------------------------------------------------------------- shared pieces

    def ctx_features(self, taps: torch.Tensor) -> torch.Tensor:
        """`[t, n_taps*hidden]` raw target taps -> `[t, hidden]` = hidden_norm(fc(taps))."""
        return self.step_ops.rms_norm(self.step_ops.linear(taps.to(self.dtype), self.fc), self.hidden_norm, self.cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, w: torch.Tensor | object, norm: torch.Tensor, n_heads: int) -> torch.Tensor:
        t = x.shape[0]
        return rms_norm(self.step_ops.linear(x, w).view(t, n_heads, self.cfg.head_dim), norm, self.cfg.rms_norm_eps)

    def _normed_heads(self, y: torch.Tensor, norm: torch.Tensor, n_heads: int) -> torch.Tensor:
        return rms_norm(y.view(y.shape[0], n_heads, self.cfg.head_dim), norm, self.cfg.rms_norm_eps)

    def _project_qkv(self, xn: torch.Tensor, w: DraftLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block rows -> q, k (per-head normed, not yet roped) and v `[t, heads, hd]`."""
        cfg = self.cfg
        if w.wqkv is None:
            return (self._heads(xn, w.wq, w.q_norm, cfg.num_attention_heads),
                    self._heads(xn, w.wk, w.k_norm, cfg.num_key_value_heads),
                    self.step_ops.linear(xn, w.wv).view(-1, cfg.num_key_value_heads, cfg.head_dim))
        kv_out = cfg.num_key_value_heads * cfg.head_dim
        q, k, v = self.step_ops.linear(xn, w.wqkv).split([cfg.num_attention_heads * cfg.head_dim, kv_out, kv_out], dim=-1)
        return (self._normed_heads(q, w.q_norm, cfg.num_attention_heads),
                self._normed_heads(k, w.k_norm, cfg.num_key_value_heads),
                v.reshape(-1, cfg.num_key_value_heads, cfg.head_dim))

    def _project_kv(self, ctx: torch.Tensor, w: DraftLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """Context rows -> k (per-head normed, not yet roped) and v `[t, nkv, hd]` (no q: ctx rows
        are keys and values only)."""
        cfg = self.cfg
        if w.wkv is None:
            return (self._heads(ctx, w.wk, w.k_norm, cfg.num_key_value_heads),
                    self.step_ops.linear(ctx, w.wv).view(-1, cfg.num_key_value_heads, cfg.head_dim))
        k, v = self.step_ops.linear(ctx, w.wkv).chunk(2, dim=-1)
        return self._normed_heads(k, w.k_norm, cfg.num_key_value_heads), v.reshape(-1, cfg.num_key_value_heads, cfg.head_dim)

    def _project_rope_write(self, x: torch.Tensor, w: DraftLayer, li: int, kv: "DraftKV", positions: torch.Tensor,
                            n_heads: int) -> torch.Tensor:
        """Rows `x [t, hidden]` -> their q/k/v projection (`n_heads` 0: k/v only, context rows),
        q/k norm + rope, and K/V written into layer `li`'s storage at `positions`; returns q
        `[t, n_heads, hd]`. The fused weight goes through the step ops' `qkv_rope_kv_write` (one
        launch where the dense kernel takes it); parts that could not fuse (DraftLayer.fuse) are
        multiplied side by side, then `qk_norm_rope_kv_write`."""
        cfg, ops = self.cfg, self.step_ops
        fused, parts = (w.wqkv, (w.wq, w.wk, w.wv)) if n_heads else (w.wkv, (w.wk, w.wv))
        args = (w.q_norm, w.k_norm, kv.cos, kv.sin, positions, kv.k[li], kv.v[li], n_heads, cfg.num_key_value_heads,
                cfg.rms_norm_eps)
        if fused is not None:
            return ops.qkv_rope_kv_write(x, fused, None, *args)
        return ops.qk_norm_rope_kv_write(torch.cat([ops.linear(x, part) for part in parts], dim=-1), *args)

    def _mlp(self, h: torch.Tensor, w: DraftLayer) -> torch.Tensor:
        """SwiGLU of normed rows `h [t, hidden]` through the step ops: `swiglu` for a fused
        gate/up weight (one launch where the dense kernel takes it), else the two projections
        side by side into `silu_mul`."""
        if w.w_gate_up is None:
            gate_up = torch.cat([self.step_ops.linear(h, w.w_gate), self.step_ops.linear(h, w.w_up)], dim=-1)
            return self.step_ops.linear(self.step_ops.silu_mul(gate_up), w.w_down)
        return self.step_ops.linear(self.step_ops.swiglu(h, w.w_gate_up), w.w_down)

    def _plain(self, layout: LayerLayout) -> bool:
        """A layer whose block rows attend every ctx and block key (no mask at all)."""
        return layout.window is None and not layout.causal_in_block

    def _layers(self, x: torch.Tensor, attend, keep_layers: bool, heads=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer stack on block rows `x [b, hidden]`: `attend(li, h) -> [b, nh*hd]` is a
        layer's attention of its input-normed rows `h`. Each residual add is fused with the
        norm after it (the next layer's input norm, the final norm last), as the target's step;
        the one after the attention names the fused gate/up weight that multiplies its output,
        which may fold it (`linear_add_rms_norm`). Returns the final-normed hidden `[b, hidden]`
        and, when kept, the residual after each layer. `heads`: the weight the final-normed rows
        are multiplied by next (the draft logits' lm_head rows), which may fold the final norm:
        the hidden is then a `PendingNorm` (the step ops' `linear_add_rms_norm`)."""
        ops, eps, outs = self.step_ops, self.cfg.rms_norm_eps, []
        if isinstance(x, BlockTokens):  # the block's embedding and first norm: one step op
            h, x = ops.embed_rms_norm(x.ids, x.table, self.layers[0].ln_in, eps, first=x.first)
        else:
            h = ops.rms_norm(x, self.layers[0].ln_in, eps)
        for li, w in enumerate(self.layers):
            h, x = ops.linear_add_rms_norm(attend(li, h), w.wo, None, x, w.ln_post, eps, w.w_gate_up)
            nxt = self.layers[li + 1] if li + 1 < len(self.layers) else None
            # the next layer's q/k/v, or the heads, may fold the norm after this layer's MLP
            h, x = self._mlp_add_norm(h, w, x, nxt.ln_in if nxt else self.norm, nxt.wqkv if nxt else heads)
            if keep_layers:
                outs.append(x)
        return h, outs

    def _mlp_add_norm(self, h, w: DraftLayer, x: torch.Tensor, norm_w: torch.Tensor, consumer):
        """The MLP of normed rows `h`, the residual add and the norm after it -> (normed, new
        residual): `linear_add_rms_norm` on the down projection (one launch with the kernels where
        it and `consumer`, the weight that multiplies the normed rows next, take the dense
        kernel), else `_mlp` then `add_rms_norm`. The same bits as `_mlp` + `add_rms_norm` on the
        torch ops; with the kernels the folded norm's statistic is summed in another order."""
        eps = self.cfg.rms_norm_eps
        if w.w_gate_up is None:
            return self.step_ops.add_rms_norm(self._mlp(h, w), x, norm_w, eps)
        return self.step_ops.linear_add_rms_norm(self.step_ops.swiglu(h, w.w_gate_up), w.w_down, None, x, norm_w,
                                                 eps, consumer)

    def _mask(self, layout: LayerLayout, q_pos: torch.Tensor, k_pos: torch.Tensor, n_ctx: int) -> torch.Tensor | None:
        """`[b, n]` True = attend. Sliding layers drop keys `window` or more positions back;
        a layer causal in the block hides later block rows. None when nothing is masked."""
        if layout.attention == "full" and not layout.causal_in_block:
            return None
        diff = q_pos[:, None] - k_pos[None, :]
        mask = torch.ones_like(diff, dtype=torch.bool)
        if layout.window is not None:
            mask &= diff < layout.window
        if layout.causal_in_block:
            mask[:, n_ctx:] &= diff[:, n_ctx:] >= 0
        return mask

    def _attend_eager(self, li: int, xn: torch.Tensor, q_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_pos: torch.Tensor, n_ctx: int, write_kv) -> torch.Tensor:
        """One layer's attention of input-normed block rows `xn [b, hidden]` at `q_pos [b]`
        (plain torch: positions need not equal storage rows). `write_kv(k_block, v_block)`
        returns all keys/values `[n_kv, n_ctx + b, head_dim]` (ctx rows, then the block's) whose
        positions are `k_pos [n_ctx + b]`."""
        w = self.layers[li]
        q, kb, vb = self._project_qkv(xn, w)
        q, kb = apply_rope(q, cos, sin), apply_rope(kb, cos, sin)
        keys, values = write_kv(kb, vb)
        return gqa_attention(q, keys, values, self._mask(self.layouts[li], q_pos, k_pos, n_ctx), self.scale)

    # ------------------------------------------------------------------- full path (oracle)

    def forward_full(self, target_hidden: torch.Tensor, noise: torch.Tensor, positions: torch.Tensor) -> DraftStages:
        """Fresh forward: `target_hidden [ctx, n_taps*hidden]`, `noise [b, hidden]` (embedding
        rows of [anchor, MASK x (b-1)]), `positions [ctx + b]` (ctx rows, then block rows)."""
        n_ctx = target_hidden.shape[0]
        ctx = self.ctx_features(target_hidden)
        positions = positions.to(self.device)
        q_pos, k_pos = positions[n_ctx:], positions
        cos_all, sin_all = cos_sin(self.rope, positions, self.dtype)
        cos, sin = cos_all[n_ctx:], sin_all[n_ctx:]

        def attend(li, xn):
            kc, vc = self._project_kv(ctx, self.layers[li])
            kc = apply_rope(kc, cos_all[:n_ctx], sin_all[:n_ctx])

            def concat(kb, vb):
                return torch.cat([kc, kb]).transpose(0, 1), torch.cat([vc, vb]).transpose(0, 1)

            return self._attend_eager(li, xn, q_pos, cos, sin, k_pos, n_ctx, concat)

        out, outs = self._layers(noise.to(self.dtype), attend, keep_layers=True)
        return DraftStages(out, torch.stack(outs), ctx)

    # ------------------------------------------------------------------- cached path

    def new_cache(self, cap: int) -> DraftKV:
        """A draft KV cache of `cap` committed rows (plus the block's transient rows)."""
        cfg = self.cfg
        return DraftKV(cfg.num_hidden_layers, cap, cfg.block_size, cfg.num_key_value_heads, cfg.head_dim,
                       self.dtype, self.device, self.rope)

    def ingest(self, kv: DraftKV, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append committed rows: taps `[t, n_taps*hidden]` at `positions [t]`. Returns the ctx
        features `[t, hidden]` (for parity)."""
        t = taps.shape[0]
        if kv.length + t > kv.cap:
            raise DraftCapacityError(f"draft KV cache full: {kv.length} + {t} rows > capacity {kv.cap}")
        ctx = self.ctx_features(taps)
        positions = positions.to(self.device)
        cos, sin = cos_sin(self.rope, positions, self.dtype)
        lo, hi = kv.length, kv.length + t
        for li, w in enumerate(self.layers):
            k, v = self._project_kv(ctx, w)
            kv.k[li, :, lo:hi] = apply_rope(k, cos, sin).transpose(0, 1)
            kv.v[li, :, lo:hi] = v.transpose(0, 1)
        kv.positions[lo:hi] = positions
        kv.length = hi
        return ctx

    def forward_round(self, kv: DraftKV, noise: torch.Tensor, positions: torch.Tensor, keep_layers: bool = False) -> DraftStages:
        """Block forward over the cached ctx: `noise [b, hidden]` at `positions [b]`. Block K/V
        land transiently at `[length, length+b)`; `kv.length` is unchanged."""
        b, lo = noise.shape[0], kv.length
        hi = lo + b
        positions = positions.to(self.device)
        kv.positions[lo:hi] = positions
        cos, sin = cos_sin(self.rope, positions, self.dtype)
        k_pos = kv.positions[:hi]

        def attend(li, xn):
            def write(kb, vb):
                kv.k[li, :, lo:hi] = kb.transpose(0, 1)
                kv.v[li, :, lo:hi] = vb.transpose(0, 1)
                return kv.k[li, :, :hi], kv.v[li, :, :hi]

            return self._attend_eager(li, xn, positions, cos, sin, k_pos, lo, write)

        out, outs = self._layers(noise.to(self.dtype), attend, keep_layers)
        return DraftStages(out, torch.stack(outs) if keep_layers else None)

    # ------------------------------------------------------------------- static path (CUDA graphs)

    def _static_mask(self, layout: LayerLayout, q_pos: torch.Tensor, keys: torch.Tensor,
                     start: torch.Tensor) -> torch.Tensor:
        """`[b, rows]` True = attend, over the whole storage where row index == position: ctx
        keys `< start`, block keys `[start, start+b)`, nothing later (stale rows). The same rules
        as `_mask`: sliding layers drop keys `window` or more back, causal layers hide later
        block rows."""
        b = q_pos.shape[0]
        diff = q_pos[:, None] - keys[None, :]
        mask = (keys < start + b)[None, :].expand(b, -1)
        if layout.window is not None:
            mask = mask & (diff < layout.window)
        if layout.causal_in_block:
            mask = mask & ((keys < start)[None, :] | (diff >= 0))
        return mask

    def _offsets(self, n: int) -> torch.Tensor:
        """`arange(n)` on the drafter's device, made once per n and kept here: a round's graph
        reads it as a constant (one launch less each time it is used), and it outlives the
        graphs that read it. Read only."""
        rows = self._offset_rows.get(n)
        if rows is None:
            rows = self._offset_rows[n] = torch.arange(n, device=self.device)
        return rows

    def block_positions(self, start: torch.Tensor, b: int, n: int = 0) -> BlockPositions:
        """A static block of `b` rows' positions from `start` (a 0-d device tensor), with a span
        of max(b, n) positions, in one launch: one add of a kept constant (0..max(b, n)-1, then
        b-1 repeated b times) gives every part of `BlockPositions`."""
        n = max(b, n)
        both = start + self._block_offsets_of(b, n)
        return BlockPositions(both[:b], both[n:], both[:n])

    def _block_offsets_of(self, b: int, n: int) -> torch.Tensor:
        """`[n + b]`: 0..n-1, then b-1 repeated b times (a block's span, then its last row's
        offset for each of its rows), kept like `_offsets`: a graph reads it as a constant."""
        offsets = self._block_offsets.get((b, n))
        if offsets is None:
            offsets = self._block_offsets[b, n] = torch.cat([self._offsets(n), self._offsets(b)[-1:].repeat(b)])
        return offsets

    def round_positions(self, starts: torch.Tensor, b: int, width: int) -> tuple[torch.Tensor, BlockPositions]:
        """A round's positions in one launch: `starts [2]` (the target's committed length, the
        draft cache's; 0-d-able device values, e.g. a round graph's `inputs[0:2]`) plus a kept
        constant `[2, n + b]` (n = max(b, width)). Returns the verify step's `[width]` rows,
        `starts[0]..starts[0]+width-1`, and `block_positions(starts[1], b, width)`: one add where
        the round made two."""
        n = max(b, width)
        offsets = self._block_offsets.get((b, n, width))
        if offsets is None:  # kept like `_offsets`: a graph reads it as a constant
            block = self._block_offsets_of(b, n)
            verify = torch.cat([self._offsets(width), block.new_zeros(n + b - width)])
            offsets = self._block_offsets[b, n, width] = torch.stack([verify, block])
        both = starts.reshape(2, 1) + offsets
        return both[0, :width], BlockPositions(both[1, :b], both[1, n:], both[1, :n])

    def _ingest_positions(self, taps: torch.Tensor, start: torch.Tensor,
                          positions: torch.Tensor | None) -> torch.Tensor:
        """A static ingest's positions `[t]` for `taps [t, ...]`: `start..start+t-1`, or the
        caller's (a round's span, which must hold exactly t)."""
        if positions is None:
            return start + self._offsets(taps.shape[0])
        if positions.shape != (taps.shape[0],):
            raise ValueError(f"positions {tuple(positions.shape)} for {taps.shape[0]} tap rows")
        return positions

    def static_ingest(self, kv: DraftKV, taps: torch.Tensor, start: torch.Tensor,
                      positions: torch.Tensor | None = None) -> None:
        """`ingest` of exactly `b` rows `taps [b, n_taps*hidden]` at positions `start..start+b-1`
        (`start` a 0-d device tensor; row index == position), without touching `kv.length`.
        Rows past the real ones are padding: they land where the next round writes its block.
        `positions`: those positions when the caller has them already (a round's
        `block_positions(...).span`), saving their add. The context features through
        `linear_rms_norm` (with the kernels one launch, its norm folded into the k/v projections
        that read it); per layer, the k/v projection with the k norm + rope + K/V write
        (`_project_rope_write`, a qkv with no q heads). `kv.positions` already holds these rows'
        positions (row index == position: `DraftKV`)."""
        positions = self._ingest_positions(taps, start, positions)
        ctx = self.step_ops.linear_rms_norm(taps.to(self.dtype), self.fc, self.hidden_norm, self.cfg.rms_norm_eps,
                                            [w.wkv for w in self.layers])
        for li, w in enumerate(self.layers):
            self._project_rope_write(ctx, w, li, kv, positions, 0)

    def static_round(self, kv: DraftKV, noise: torch.Tensor | BlockTokens, start: torch.Tensor,
                     at: BlockPositions | None = None, heads: torch.Tensor | None = None):
        """`forward_round` with static shapes for a CUDA graph: block `noise [b, hidden]` (or its
        `BlockTokens`, embedded in the first norm's launch) at positions `start..start+b-1`
        (`start` a 0-d device tensor equal to the committed length; row index == position),
        attending over the whole storage. Returns the final-normed hidden `[b, hidden]`. `at`:
        `block_positions(start, b)` when the caller made them. `heads`: the lm_head rows the
        caller's heads multiply the hidden by, which may fold the final norm (`_layers`): the
        result is then a `PendingNorm`, which the step ops' `linear` and `confidence_raw` take.

        Per layer: the q/k/v projection with the q/k norm + rope + block K/V write
        (`_project_rope_write`), then attention. A plain layer (every ctx and block key visible)
        is the step ops' causal attention (`draft_attention`) with every block row at the block's
        last position `start+b-1`: it then sees keys `0..start+b-1`, i.e. the committed ctx and
        the whole block, never the stale rows after it. Sliding and block-causal layers keep
        `_static_mask` (torch attention)."""
        b = noise.ids.shape[0] if isinstance(noise, BlockTokens) else noise.shape[0]
        cfg, ops = self.cfg, self.step_ops
        positions, last, _ = at if at is not None else self.block_positions(start, b)

        def attend(li, xn):
            w, layout = self.layers[li], self.layouts[li]
            q = self._project_rope_write(xn, w, li, kv, positions, cfg.num_attention_heads)
            if self._plain(layout):
                return ops.draft_attention(q, kv.k[li], kv.v[li], last, self.scale)
            keys = self._offsets(kv.rows)  # (only masked layers need every key's position)
            return gqa_attention(q, kv.k[li], kv.v[li], self._static_mask(layout, positions, keys, start), self.scale)

        return self._layers(noise if isinstance(noise, BlockTokens) else noise.to(self.dtype), attend,
                            keep_layers=False, heads=heads)[0]

    # ------------------------------------------------------------------- heads

    @property
    def has_markov(self) -> bool:
        return self.markov_w1 is not None

    @property
    def quantized(self) -> bool:
        """Whether any matmul weight is q8_0 / q4_0 (a GGUF drafter's blocks or a `--prec` policy's)."""
        weights = [self.fc, self.markov_w2]
        for w in self.layers:
            weights += [w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down]
        return any(hasattr(w, "qtype") for w in weights if w is not None)

    @property
    def has_confidence(self) -> bool:
        return self.conf_w is not None

    def markov_chain(self, logits: torch.Tensor, anchor: torch.Tensor, pick=None, host_loop: bool = False,
                     with_anchor: bool = False) -> torch.Tensor:
        """Greedy semi-autoregressive chain over `logits [n, V]` (float32, or the model dtype:
        widened exactly where they are added to the bias): slot k's logits get
        `w2 · w1[prev]`, prev starting at `anchor` (0-d or [1] long) and then each chosen token.
        Returns tokens `[n]` on the device (no host sync). `pick(k, scores [1, V]) -> [1]`
        chooses instead of argmax (a sampler's drafting: spec/keyed.py `Drafting.pick`).
        `host_loop`: the caller is never captured as a graph (step_ops `markov_chain`).
        `with_anchor`: `[1 + n]`, the anchor first (a round's candidates [last, drafts]; the
        greedy chain's one launch writes it with the kernels)."""
        assert self.markov_w1 is not None and self.markov_w2 is not None
        if pick is None:  # greedy: the seam's chain (one launch with the kernels)
            return self.step_ops.markov_chain(logits, anchor, self.markov_w1, self._markov_w2_values(), self.dtype,
                                              host_loop=host_loop, with_anchor=with_anchor)
        prev = anchor.reshape(1)
        out = [prev] if with_anchor else []
        for k in range(logits.shape[0]):
            bias = linear(self.markov_w1[prev].to(self.dtype), self.markov_w2).float()  # [1, V]
            prev = torch.argmax(logits[k : k + 1] + bias, dim=-1) if pick is None else pick(k, logits[k : k + 1] + bias)
            out.append(prev)
        return torch.cat(out)

    def prepare_markov(self) -> bool:
        """Build the greedy chain's bias table at load (step_ops `prepare_markov`), so the first
        round does not pay for it; whether the seam keeps one (a small vocabulary)."""
        if self.markov_w1 is None or self.markov_w2 is None:
            return False
        return self.step_ops.prepare_markov(self.markov_w1, self._markov_w2_values(), self.dtype)

    def _markov_w2_values(self) -> torch.Tensor:
        """w2 as a `[V, r]` tensor of the compute dtype for the seam's chain. A quantized w2 (a
        precision policy's, a GGUF's) is dequantized once: the chain then runs on exactly its
        q8_0 / q4_0 values, in one launch, where a per-slot loop through the quantized linear
        cost most of the quantized DSpark arm's speedup (docs/tuning.md#markov-w2). w2 is small
        (V x rank), so the copy is too; the first call comes outside any graph capture."""
        w2 = self.markov_w2
        if isinstance(w2, torch.Tensor):
            return w2
        if self._markov_w2_dense is None:
            from memra_cli.engine.quant.blocks import dequantize_torch

            self._markov_w2_dense = dequantize_torch(w2.raw, w2.qtype, w2.shape, dtype=self.dtype, device=self.device)
        return self._markov_w2_dense

    def markov_chain_confidence(self, logits: torch.Tensor, anchor: torch.Tensor, hidden,
                                host_loop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy chain's candidates `[1 + n]` (`markov_chain(..., with_anchor=True)`) and the
        confidence raws `[n]` of draft rows `hidden` (or their `PendingNorm`), each slot's previous
        token from the chain (`confidence_raw(hidden, candidates[:-1])`): one step op, one launch
        with the kernels over a small vocabulary's bias table."""
        assert self.markov_w1 is not None and self.markov_w2 is not None
        assert self.conf_w is not None and self.conf_b is not None
        with_markov = self.census.confidence is not None and self.census.confidence.with_markov
        return self.step_ops.markov_chain_confidence(logits, anchor, self.markov_w1, self._markov_w2_values(),
                                                     self.dtype, hidden, self.conf_w[0], self.conf_b,
                                                     self.markov_w1 if with_markov else None, host_loop=host_loop)

    def confidence_raw(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid accept-rate scores `[n]` for draft rows `hidden [n, hidden]`;
        `prev_ids [n]` = each slot's previous chain token ([anchor, chain[:-1]])."""
        assert self.conf_w is not None and self.conf_b is not None
        if self.census.confidence is not None and self.census.confidence.with_markov:
            assert self.markov_w1 is not None
            return self.step_ops.confidence_raw(hidden, self.conf_w[0], self.conf_b, prev_ids, self.markov_w1)
        return self.step_ops.confidence_raw(hidden, self.conf_w[0], self.conf_b)


class _TensorLoader:
    """Reads drafter tensors in the compute dtype; matmul weights may go through `weight_fn`."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, weight_fn):
        self.ckpt, self.dtype, self.device, self.weight_fn = ckpt, dtype, device, weight_fn

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype, device: torch.device, weight_fn) -> "_TensorLoader":
        """A loader over `path`'s checkpoint. A GGUF loads as written: a `weight_fn` of another
        precision policy than the file's is refused (one of the same policy has nothing to do)."""
        ckpt = open_checkpoint(path)
        if ckpt.format == "gguf" and weight_fn is not None:
            written, wanted = getattr(ckpt, "policy", None), getattr(weight_fn, "policy", None)
            if wanted != written:
                raise CheckpointError(f"{path}: a GGUF written under precision policy {written} loads as written; "
                                      f"precision {wanted or 'of the given weight_fn'} cannot apply to it")
            weight_fn = None
        return cls(ckpt, dtype, device, weight_fn)

    def extras(self) -> dict[str, object]:
        """The DSpark heads and the table copies the checkpoint has, by name (formats/names.py)."""
        out: dict[str, object] = {}
        for name in (MARKOV_W1, OWN_EMBED, OWN_LM_HEAD):  # w1 is a gathered table: as stored
            if name in self.ckpt:
                out[name] = self.plain(name)
        if MARKOV_W2 in self.ckpt:  # a matmul: follows the precision policy (docs/quantize.md)
            out[MARKOV_W2] = self.matmul(MARKOV_W2)
        if CONF_W in self.ckpt:  # the confidence head stays float32
            out[CONF_W] = self.plain(CONF_W, torch.float32)
            out[CONF_B] = self.plain(CONF_B, torch.float32)
        return out

    def plain(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.ckpt.load(name, dtype or self.dtype, self.device)

    def matmul(self, name: str) -> object:
        """A matmul weight: plain, or quantized (GGUF blocks, or a precision policy's) and then
        packed for the device at the layer seam (Triton kernels on CUDA)."""
        if self.ckpt.format == "gguf" and self.ckpt.tensors[name].dtype in ("Q8_0", "Q4_0"):
            from memra_cli.engine.quant.blocks import QuantLinearRef

            qtype, raw, shape = self.ckpt.raw(name)  # type: ignore[attr-defined]  # GGUFCheckpoint
            return for_device(QuantLinearRef(raw, qtype, shape), self.device)
        if self.weight_fn is not None:
            return for_device(self.weight_fn(name, self.ckpt, self.dtype, self.device), self.device)
        return self.plain(name)

    def layer(self, i: int) -> DraftLayer:
        p = f"layers.{i}."
        m, n = self.matmul, self.plain
        return DraftLayer(
            wq=m(p + "self_attn.q_proj.weight"), wk=m(p + "self_attn.k_proj.weight"),
            wv=m(p + "self_attn.v_proj.weight"), wo=m(p + "self_attn.o_proj.weight"),
            w_gate=m(p + "mlp.gate_proj.weight"), w_up=m(p + "mlp.up_proj.weight"),
            w_down=m(p + "mlp.down_proj.weight"),
            ln_in=n(p + "input_layernorm.weight"), ln_post=n(p + "post_attention_layernorm.weight"),
            q_norm=n(p + "self_attn.q_norm.weight"), k_norm=n(p + "self_attn.k_norm.weight"),
        ).fuse()
