"""YaRN's scalars from a rope config, in plain float math (no torch): the cos/sin scaling, the
ramp's dimension range, and the reference engine's per-dimension divisors. `census` reports them
without loading torch; layers/rope.py builds its tables from the same functions."""

from __future__ import annotations

import math

from memra_cli.engine.formats.config import RopeConfig


def yarn_mscale(rope: RopeConfig) -> float:
    """The cos/sin scaling YaRN applies (`attention_factor`, else 0.1*ln(factor)+1)."""
    if rope.attention_factor is not None:
        return rope.attention_factor

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    assert rope.factor is not None
    if rope.mscale and rope.mscale_all_dim:
        return float(get(rope.factor, rope.mscale) / get(rope.factor, rope.mscale_all_dim))
    return get(rope.factor)


def yarn_correction_range(rope: RopeConfig, head_dim: int) -> tuple[float, float]:
    """Dimension range [low, high] over which YaRN ramps from extrapolation to interpolation."""
    base = rope.theta
    original = rope.original_max_position_embeddings
    assert original is not None

    def dim_for(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(rope.beta_fast or 32.0), dim_for(rope.beta_slow or 1.0)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def yarn_divisors(rope: RopeConfig, head_dim: int) -> list[float]:
    """The reference engine's form of YaRN: `inv_freq_j = plain_j / ff[j]` (computed in float64)."""
    low, high = yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001
    assert rope.factor is not None
    out = []
    for j in range(head_dim // 2):
        plain = rope.theta ** (-2.0 * j / head_dim)
        extrapolation = 1.0 - min(max((j - low) / (high - low), 0.0), 1.0)
        yarn = (plain / rope.factor) * (1.0 - extrapolation) + plain * extrapolation
        out.append(plain / yarn)
    return out
