"""The trainable twin of DeepSpec's `Gemma4DSparkModel` (engine: models/drafter_gemma4.py): the
DSpark drafter with Gemma 4 full-attention layers as its backbone, whose `state_dict` carries the
checkpoint's tensor names, so exporting is writing the dict (export.py).

Per layer (block rows x `[B, Q, hidden]`, ctx = gnorm(fc(taps), hidden_norm) `[B, L, hidden]`):
    h = gnorm(x, input_layernorm); q from h, k/v from [ctx ; h]; q/k per-head gnorm, v unweighted
    gnorm (k_eq_v: v is the raw key projection); rope over `global_head_dim` (the target's
    full-attention rope); attention scaling 1.0; x += gnorm(o_proj(.), post_attention_layernorm);
    x += gnorm(GELU-tanh MLP(gnorm(x, pre_feedforward_layernorm)), post_feedforward_layernorm);
    x *= layer_scalar. Output gnorm(x, norm).
`gnorm` is Gemma 4's RMSNorm (float32, no `1 + w`). The block embedding's √hidden scale and the
logit softcap are applied by the loss (losses.py `draft_logits`), as the engine's arm does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memra_cli.engine.formats.gemma4_config import Gemma4Rope
from memra_cli.engine.models.gemma4 import LAYER_NORMS, gemma_rms_norm, rope_inv_freq
from memra_cli.train.drafter import _Confidence, _Markov, add_attention_and_mlp

def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, D]`, pos `[B, T]`, inv_freq `[D/2]` (zeros: pairs that pass through)."""
    ang = pos.float()[..., None] * inv_freq.to(x.device)
    full = torch.cat([ang, ang], -1)[:, None]
    half = x.shape[-1] // 2
    return x * full.cos().to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * full.sin().to(x.dtype)


class TrainGemma4Drafter(nn.Module):
    """Trainable Gemma4DSparkModel; `forward` has `TrainDrafter`'s signature and shapes."""

    def __init__(self, hidden: int, layers: int, heads: int, kv: int, head_dim: int, ffn: int, n_taps: int,
                 vocab: int, *, k_eq_v: bool, rope: Gemma4Rope, eps: float, markov_rank: int = 0,
                 confidence: bool = False):
        super().__init__()
        self.hidden, self.heads, self.kv, self.hd, self.eps = hidden, heads, kv, head_dim, eps
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)
        self.fc = nn.Linear(n_taps * hidden, hidden, bias=False)
        self.hidden_norm, self.norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.layers = nn.ModuleList([_Gemma4TrainLayer(hidden, heads, kv, head_dim, ffn, k_eq_v) for _ in range(layers)])
        self.markov_head = _Markov(vocab, markov_rank) if markov_rank else None
        self.confidence_head = _Confidence(hidden + markov_rank) if confidence else None

    def forward(self, taps: torch.Tensor, noise: torch.Tensor, ctx_pos: torch.Tensor, blk_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """taps `[B, L, n_taps*h]`, noise `[B, Q, h]` (already √hidden-scaled), positions `[B, L]` /
        `[B, Q]`, mask `[B, 1, Q, L+Q]` (True = attend). Returns the final-normed hidden `[B, Q, h]`."""
        ctx = gemma_rms_norm(self.fc(taps), self.hidden_norm.weight, self.eps)
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, blk_pos, mask, self)
        return gemma_rms_norm(x, self.norm.weight, self.eps)


class _Gemma4TrainLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int, hd: int, ffn: int, k_eq_v: bool):
        super().__init__()
        for name in LAYER_NORMS:
            setattr(self, name, nn.RMSNorm(hidden))
        add_attention_and_mlp(self, hidden, heads, kv, hd, ffn, v_proj=not k_eq_v)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def _attend(self, xn, ctx, ctx_pos, blk_pos, mask, d: TrainGemma4Drafter) -> torch.Tensor:
        """Input-normed block rows `[B, Q, h]` -> attention output `[B, Q, heads*hd]` (scaling 1.0)."""
        a, (B, Q), L = self.self_attn, xn.shape[:2], ctx.shape[1]
        q = gemma_rms_norm(a.q_proj(xn).view(B, Q, d.heads, d.hd), a.q_norm.weight, d.eps).transpose(1, 2)
        kin = torch.cat([ctx, xn], 1)  # ctx rows are not input-layernormed
        k_raw = a.k_proj(kin).view(B, L + Q, d.kv, d.hd)
        v_raw = k_raw if a.v_proj is None else a.v_proj(kin).view(B, L + Q, d.kv, d.hd)
        k = gemma_rms_norm(k_raw, a.k_norm.weight, d.eps).transpose(1, 2)
        v = gemma_rms_norm(v_raw, None, d.eps).transpose(1, 2)
        q, k = _rope(q, blk_pos, d.inv_freq), _rope(k, torch.cat([ctx_pos, blk_pos], 1), d.inv_freq)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, Q, -1)

    def forward(self, x, ctx, ctx_pos, blk_pos, mask, d: TrainGemma4Drafter):
        n_in, n_post_attn, n_pre_ff, n_post_ff = (getattr(self, n).weight for n in LAYER_NORMS)
        attn = self._attend(gemma_rms_norm(x, n_in, d.eps), ctx, ctx_pos, blk_pos, mask, d)
        x = x + gemma_rms_norm(self.self_attn.o_proj(attn), n_post_attn, d.eps)
        h = gemma_rms_norm(x, n_pre_ff, d.eps)
        mlp = self.mlp.down_proj(F.gelu(self.mlp.gate_proj(h), approximate="tanh") * self.mlp.up_proj(h))
        return (x + gemma_rms_norm(mlp, n_post_ff, d.eps)) * self.layer_scalar
