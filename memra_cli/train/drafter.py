"""The trainable drafter: a twin of the engine's drafter whose `state_dict` carries exactly the
checkpoint's tensor names (z-lab DFlash / DeepSpec DSpark), so exporting is writing the dict."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[B, H, T, D]`, pos `[B, T]` (rotate-half layout, float32 angles)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None].to(x.dtype), torch.cat([ang, ang], -1).sin()[:, None].to(x.dtype)
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TrainDrafter(nn.Module):
    """Trainable drafter whose `state_dict` has exactly the checkpoint's tensor names."""

    def __init__(self, hidden: int, layers: int, heads: int, kv: int, ffn: int, n_taps: int, vocab: int,
                 markov_rank: int = 0, confidence: bool = False, head_dim: int | None = None):
        super().__init__()
        self.hidden, self.heads, self.kv, self.hd = hidden, heads, kv, head_dim or hidden // heads
        self.fc = nn.Linear(n_taps * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden)
        self.norm = nn.RMSNorm(hidden)
        self.layers = nn.ModuleList([_TrainLayer(hidden, heads, kv, ffn, self.hd) for _ in range(layers)])
        self.markov_head = _Markov(vocab, markov_rank) if markov_rank else None
        self.confidence_head = _Confidence(hidden + markov_rank) if confidence else None

    def forward(self, taps: torch.Tensor, noise: torch.Tensor, ctx_pos: torch.Tensor, blk_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """taps `[B, L, n_taps*h]`, noise `[B, Q, h]`, positions `[B, L]` / `[B, Q]`, mask
        `[B, 1, Q, L+Q]` (True = attend). Returns final-normed hidden `[B, Q, h]`."""
        ctx = _rms(self.fc(taps), self.hidden_norm.weight)
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, blk_pos, mask, self)
        return _rms(x, self.norm.weight)



def add_attention_and_mlp(layer: nn.Module, hidden: int, heads: int, kv: int, hd: int, ffn: int,
                          v_proj: bool) -> None:
    """Give `layer` the checkpoint-named `self_attn` (q/k/v/o projections, q/k norms over `hd`;
    no `v_proj` when v is the key projection) and gated `mlp` of width `ffn`, no biases: the
    modules every drafter backbone trained here shares, so its `state_dict` has the file's names."""
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(hidden, heads * hd, bias=False)
    layer.self_attn.k_proj = nn.Linear(hidden, kv * hd, bias=False)
    layer.self_attn.v_proj = nn.Linear(hidden, kv * hd, bias=False) if v_proj else None
    layer.self_attn.o_proj = nn.Linear(heads * hd, hidden, bias=False)
    layer.self_attn.q_norm, layer.self_attn.k_norm = nn.RMSNorm(hd), nn.RMSNorm(hd)
    layer.mlp = nn.Module()
    layer.mlp.gate_proj = nn.Linear(hidden, ffn, bias=False)
    layer.mlp.up_proj = nn.Linear(hidden, ffn, bias=False)
    layer.mlp.down_proj = nn.Linear(ffn, hidden, bias=False)


class _TrainLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int, ffn: int, hd: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        add_attention_and_mlp(self, hidden, heads, kv, hd, ffn, v_proj=True)

    def forward(self, x, ctx, ctx_pos, blk_pos, mask, d: TrainDrafter):
        a, B, Q = self.self_attn, x.shape[0], x.shape[1]
        L = ctx.shape[1]
        xn = _rms(x, self.input_layernorm.weight)
        q = _rms(a.q_proj(xn).view(B, Q, d.heads, d.hd), a.q_norm.weight).transpose(1, 2)
        kin = torch.cat([ctx, xn], 1)  # ctx rows are not input-layernormed
        k = _rms(a.k_proj(kin).view(B, L + Q, d.kv, d.hd), a.k_norm.weight).transpose(1, 2)
        v = a.v_proj(kin).view(B, L + Q, d.kv, d.hd).transpose(1, 2)
        pos = torch.cat([ctx_pos, blk_pos], 1)
        q, k = _rope(q, blk_pos, 10000.0), _rope(k, pos, 10000.0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
        h = _rms(x, self.post_attention_layernorm.weight)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class _Markov(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as a no-op on the backbone's logits


class _Confidence(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
