"""DeepSpec's `Gemma4DSparkModel` drafter: the DSpark drafter with Gemma 4 layers as its backbone.

The block forward is the one `drafter.py` describes (ctx rows from the target's taps are keys and
values only; block rows attend over [ctx ; block], non-causal, full attention on every layer), with
each layer a Gemma 4 full-attention layer (semantics: DeepSpec `deepspec/modeling/dspark/gemma4/
modeling.py`; docs/gemma4.md, "The DSpark drafter"):

    ctx = gnorm(fc(taps), hidden_norm)                     taps [t, n_taps*hidden] -> [t, hidden]
    per layer, x [b, hidden]:
        h = gnorm(x, input_layernorm)
        q = rope(gnorm(q_proj(h), q_norm))                 per head, global_head_dim
        k = rope(gnorm(k_proj([ctx ; h]), k_norm))
        v = gnorm(v_proj([ctx ; h]))  (no weight; k_eq_v: the raw k projection)
        x = x + gnorm(o_proj(softmax(q k^T) v), post_attention_layernorm)     scaling 1.0
        x = x + gnorm(mlp(gnorm(x, pre_feedforward_layernorm)), post_feedforward_layernorm)
        x = x * layer_scalar                               GELU-tanh MLP
    out = gnorm(x, norm)

`gnorm` is Gemma 4's RMSNorm (`models/gemma4.py` `gemma_rms_norm`: float32, weight applied before
the cast); the rope is the target config's `full_attention` one (proportional, partial) over
`global_head_dim`, shared by every layer. The block input is the drafter's own embedding scaled by
√hidden (in the engine: the target's rows times its `embed_scale`, the arm's block embedding) and
its logits are soft-capped by `final_logit_softcapping` (`logit_softcap`).

Only the weight matmuls go through the step-ops seam (`step_ops.linear`): the fused norm / rope /
attention kernels are Qwen-shaped (norm order, no v norm, scaling), as for the Gemma 4 target. The
static path (what CUDA graphs replay) is torch over the whole storage under a position mask.
The markov and confidence heads are the DSpark ones `Drafter` has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from memra_cli.engine.formats.census import Census, take_census
from memra_cli.engine.formats.gemma4_config import Gemma4Rope
from memra_cli.engine.layers.ops import gqa_attention
from memra_cli.engine.layers.rope import RopeTables, apply_rope
from memra_cli.engine.models.drafter import BlockPositions, Drafter, _TensorLoader
from memra_cli.engine.models.gemma4 import LAYER_NORMS, gemma_rms_norm, rope_inv_freq


@dataclass
class Gemma4DraftLayer:
    """One Gemma 4 drafter layer. Projections `[out, in]` (or quantized linears); `wv` None with
    `attention_k_eq_v`; norms in, post-attention, pre-ff, post-ff `[hidden]`; `layer_scalar [1]`."""

    wq: object
    wk: object
    wv: object | None
    wo: object
    w_gate: object
    w_up: object
    w_down: object
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    layer_scalar: torch.Tensor

    def matmuls(self) -> list[object]:
        return [w for w in (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down) if w is not None]


class Gemma4Drafter(Drafter):
    """A loaded `Gemma4DSparkModel` on one device in one compute dtype (the `Drafter` interface)."""

    fuses_block_embedding = False  # its static round takes the block's rows (Gemma's own norms)

    def __init__(self, census: Census, layers: list[Gemma4DraftLayer], fc: object, hidden_norm: torch.Tensor,
                 norm: torch.Tensor, extras: dict[str, object], dtype: torch.dtype, device: torch.device):
        super().__init__(census, layers, fc, hidden_norm, norm, extras, dtype, device)  # type: ignore[arg-type]
        self.scale = 1.0  # Gemma 4 attention: q/k are RMS-normed, no 1/sqrt(head_dim)
        self.logit_softcap = self.cfg.gemma4.final_logit_softcapping

    def _rope_tables(self) -> RopeTables:
        r = self.cfg.rope
        rope = Gemma4Rope(r.type, r.theta, r.partial_rotary_factor or 1.0, r.factor or 1.0)
        return RopeTables(rope_inv_freq(rope, self.cfg.head_dim), 1.0)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             census: Census | None = None, weight_fn=None) -> "Gemma4Drafter":
        """Load a Gemma4DSparkModel checkpoint (after its census passes): its directory or a memra
        GGUF of it (loads as written). `weight_fn` as `Drafter.load` (a policy's matmul weights)."""
        census = census or take_census(Path(path))
        load = _TensorLoader.open(Path(path), dtype, torch.device(device), weight_fn)
        k_eq_v = census.config.gemma4.attention_k_eq_v
        layers = [_load_layer(load, i, k_eq_v) for i in range(census.config.num_hidden_layers)]
        return cls(census, layers, load.matmul("fc.weight"), load.plain("hidden_norm.weight"),
                   load.plain("norm.weight"), load.extras(), dtype, torch.device(device))

    @property
    def quantized(self) -> bool:
        weights = [self.fc, self.markov_w2] + [w for layer in self.layers for w in layer.matmuls()]
        return any(hasattr(w, "qtype") for w in weights if w is not None)

    # ------------------------------------------------------------------- layer pieces

    def ctx_features(self, taps: torch.Tensor) -> torch.Tensor:
        """`[t, n_taps*hidden]` raw target taps -> `[t, hidden]` = gnorm(fc(taps), hidden_norm)."""
        fused = self.step_ops.linear(taps.to(self.dtype), self.fc)
        return gemma_rms_norm(fused, self.hidden_norm, self.cfg.rms_norm_eps)

    def _project_kv(self, rows: torch.Tensor, w: Gemma4DraftLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `[t, hidden]` -> k (per-head normed, not yet roped) and v (unweighted-normed)
        `[t, nkv, hd]`. With k_eq_v v is the raw key projection, normed without a weight."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        k = self.step_ops.linear(rows, w.wk).view(-1, cfg.num_key_value_heads, cfg.head_dim)
        v = k if w.wv is None else self.step_ops.linear(rows, w.wv).view(-1, cfg.num_key_value_heads, cfg.head_dim)
        return gemma_rms_norm(k, w.k_norm, eps), gemma_rms_norm(v, None, eps)

    def _project_qkv(self, xn: torch.Tensor, w: Gemma4DraftLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input-normed block rows -> q, k (per-head normed, not yet roped) and v `[t, heads, hd]`."""
        cfg = self.cfg
        q = self.step_ops.linear(xn, w.wq).view(-1, cfg.num_attention_heads, cfg.head_dim)
        return (gemma_rms_norm(q, w.q_norm, cfg.rms_norm_eps), *self._project_kv(xn, w))

    def _layers(self, x: torch.Tensor, attend, keep_layers: bool, heads=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The Gemma 4 layer stack on block rows `x [b, hidden]` (module docstring); `attend(li, h)
        -> [b, nh*hd]` is a layer's attention of its input-normed rows. Returns the final-normed
        hidden `[b, hidden]` and, when kept, the residual after each layer (after its scalar).
        `heads` is unused: Gemma's norms are its own ops, so the final norm is never left pending."""
        ops, eps, outs = self.step_ops, self.cfg.rms_norm_eps, []
        for li, w in enumerate(self.layers):
            n_in, n_post_attn, n_pre_ff, n_post_ff = w.norms
            x = x + gemma_rms_norm(ops.linear(attend(li, gemma_rms_norm(x, n_in, eps)), w.wo), n_post_attn, eps)
            h = gemma_rms_norm(x, n_pre_ff, eps)
            mlp = ops.linear(F.gelu(ops.linear(h, w.w_gate), approximate="tanh") * ops.linear(h, w.w_up), w.w_down)
            x = (x + gemma_rms_norm(mlp, n_post_ff, eps)) * w.layer_scalar
            if keep_layers:
                outs.append(x)
        return gemma_rms_norm(x, self.norm, eps), outs

    # ------------------------------------------------------------------- static path (CUDA graphs)

    def _write_rows(self, kv, li: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Roped k and v `[t, nkv, hd]` into storage rows `positions` (row index == position)."""
        kv.k[li].index_copy_(1, positions, apply_rope(k, kv.cos[positions], kv.sin[positions]).transpose(0, 1))
        kv.v[li].index_copy_(1, positions, v.transpose(0, 1))

    def static_ingest(self, kv, taps: torch.Tensor, start: torch.Tensor,
                      positions: torch.Tensor | None = None) -> None:
        """`ingest` of exactly `b` rows at positions `start..start+b-1` (`start` a 0-d device
        tensor), without touching `kv.length` (padding rows land where the next block writes).
        `positions`: those positions when the caller has them already (`Drafter.static_ingest`).
        `kv.positions` already holds them (row index == position: `DraftKV`)."""
        positions = self._ingest_positions(taps, start, positions)
        ctx = self.ctx_features(taps)
        for li, w in enumerate(self.layers):
            self._write_rows(kv, li, *self._project_kv(ctx, w), positions)

    def static_round(self, kv, noise: torch.Tensor, start: torch.Tensor,
                     at: BlockPositions | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
        """`forward_round` with static shapes: block `noise [b, hidden]` at `start..start+b-1`,
        attending over the whole storage under `_static_mask` (ctx rows before `start`, the block,
        nothing later). Returns the final-normed hidden `[b, hidden]`. `at`: the block's
        `block_positions(start, b)` when the caller made them (`Drafter.static_round`); `heads` is
        unused (Gemma's final norm stays its own op: the result is always a tensor)."""
        positions = at.rows if at is not None else start + self._offsets(noise.shape[0])
        cos, sin = kv.cos[positions], kv.sin[positions]

        def attend(li, xn):
            q, kb, vb = self._project_qkv(xn, self.layers[li])
            self._write_rows(kv, li, kb, vb, positions)
            mask = self._static_mask(self.layouts[li], positions, self._offsets(kv.rows), start)
            return gqa_attention(apply_rope(q, cos, sin), kv.k[li], kv.v[li], mask, self.scale)

        return self._layers(noise.to(self.dtype), attend, keep_layers=False)[0]


def _load_layer(load: _TensorLoader, i: int, k_eq_v: bool) -> Gemma4DraftLayer:
    p = f"layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    return Gemma4DraftLayer(
        wq=load.matmul(a + "q_proj.weight"), wk=load.matmul(a + "k_proj.weight"),
        wv=None if k_eq_v else load.matmul(a + "v_proj.weight"), wo=load.matmul(a + "o_proj.weight"),
        w_gate=load.matmul(m + "gate_proj.weight"), w_up=load.matmul(m + "up_proj.weight"),
        w_down=load.matmul(m + "down_proj.weight"),
        q_norm=load.plain(a + "q_norm.weight"), k_norm=load.plain(a + "k_norm.weight"),
        norms=tuple(load.plain(p + name + ".weight") for name in LAYER_NORMS),
        layer_scalar=load.plain(p + "layer_scalar"),
    )
