"""Rotary position embedding: default, YaRN and LLaMA-3.1's `llama3` scaling, in the NeoX
(rotate-half) layout Qwen3 and LLaMA use.

Frequencies are computed the way HF transformers computes them (float32 torch arithmetic), so the
target matches `Qwen3ForCausalLM` bit for bit in rope. YaRN is also expressed the reference engine's way, as
per-dimension divisors of the plain frequencies plus an mscale applied to cos/sin; `census`
reports those and tests check both forms against transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memra_cli.engine.formats.config import RopeConfig
from memra_cli.engine.formats.yarn import yarn_correction_range, yarn_mscale
from memra_kernels.rope_ref import rope_ref as apply_rope  # noqa: F401  rotate-half: the op's one torch body


@dataclass(frozen=True)
class RopeTables:
    """inv_freq `[head_dim/2]` (float32) and the scaling applied to cos and sin."""

    inv_freq: torch.Tensor
    attention_scaling: float


def _plain_inv_freq(theta: float, head_dim: int) -> "torch.Tensor":
    import torch

    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_tables(rope: RopeConfig, head_dim: int) -> RopeTables:
    """inv_freq and attention scaling for `rope`, as transformers computes them."""
    import torch

    plain = _plain_inv_freq(rope.theta, head_dim)
    if rope.type == "default":
        return RopeTables(plain, 1.0)
    if rope.type == "llama3":
        return RopeTables(llama3_inv_freq(rope, plain), 1.0)
    assert rope.type == "yarn" and rope.factor is not None, rope.type
    low, high = yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = plain / rope.factor
    inv_freq = interpolated * (1 - extrapolation) + plain * extrapolation
    return RopeTables(inv_freq, yarn_mscale(rope))


def llama3_inv_freq(rope: RopeConfig, plain: "torch.Tensor") -> "torch.Tensor":
    """LLaMA-3.1's frequencies from the plain ones `[head_dim/2]` (float32, no cos/sin scaling).

    By wavelength `2π/f` against the original context L: shorter than L/high_freq_factor kept,
    longer than L/low_freq_factor divided by `factor`, and in between a blend whose weight
    `s = (L/wavelength - low) / (high - low)` goes from 0 (divided) to 1 (kept). Every step is a
    float32 tensor op in the order transformers uses, so the table is bit-identical to its table.
    """
    import torch

    assert rope.factor is not None and rope.original_max_position_embeddings is not None
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    original, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelength = 2 * math.pi / plain
    long_wave = wavelength > original / low
    short_wave = wavelength < original / high
    divided = torch.where(long_wave, plain / rope.factor, plain)
    weight = (original / wavelength - low) / (high - low)
    blended = (1 - weight) * divided / rope.factor + weight * divided
    return torch.where(~short_wave & ~long_wave, blended, divided)


def cos_sin(tables: RopeTables, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[*positions.shape, head_dim]` for integer `positions`, cast to `dtype`.

    The product is formed in float32 as transformers does (positions.float() * inv_freq).
    """
    import torch

    inv = tables.inv_freq.to(positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * tables.attention_scaling).to(dtype), (emb.sin() * tables.attention_scaling).to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first `cos.shape[-1]` dims of each head of `x [t, heads, hd]`; the rest pass
    through (partial rotary, e.g. Qwen3.5's `partial_rotary_factor`)."""
    import torch

    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
