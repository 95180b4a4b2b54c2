"""`layers/ops.sdpa`: SDPA's math backend written out for float32 on the CPU must give SDPA's
own bits, in every form the engine calls it (the fixed-width step's attention over the whole
storage under a position mask, a prefill chunk's causal mask, the drafter's unmasked and
windowed layers), or a speculative stream could leave the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memra_cli.engine.layers.ops import sdpa

SHAPES = [(2, 32, 64), (2, 1, 64), (4, 8, 128), (1, 60, 32), (8, 4, 80)]  # (batch, rows, head_dim)


def _case(seed: int, b: int, m: int, hd: int, n: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, r, hd, generator=g) for r in (m, n, n))
    return q, k, v, g


@pytest.mark.parametrize("b,m,hd", SHAPES)
@pytest.mark.parametrize("scale", [None, 0.125, 0.07])
@pytest.mark.parametrize("masked", ["none", "causal", "window"])
def test_sdpa_is_torch_sdpa_bit_for_bit(b, m, hd, scale, masked):
    for seed, n in enumerate((m, m + 1, m + 37, m + 300)):
        q, k, v, g = _case(seed, b, m, hd, n)
        mask = None
        if masked != "none":
            start = n - m  # rows at the last m positions, causal over every key before them
            diff = torch.arange(start, n)[:, None] - torch.arange(n)[None, :]
            mask = diff >= 0
            if masked == "window":
                mask &= diff < 5
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        assert torch.equal(sdpa(q, k, v, mask, scale), want), (seed, n)


def test_sdpa_with_a_position_mask_over_padded_storage():
    """The step's form: 16 rows at positions 200..215 over a 320-row storage, rows past the
    last position masked (stale keys there, as after a rollback)."""
    q, k, v, _ = _case(3, 2, 32, 64, 320)
    positions = torch.arange(200, 216).repeat(2)  # the g = 2 query heads folded into rows
    mask = torch.arange(320)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    assert torch.equal(sdpa(q, k, v, mask, 0.125), want)


def test_sdpa_leaves_other_dtypes_to_torch():
    q, k, v, _ = _case(4, 2, 8, 64, 40)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    mask = torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None]
    assert torch.equal(sdpa(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
