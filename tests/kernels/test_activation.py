"""silu(gate) * up kernel vs its torch twin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.activation import BLOCK_I, silu_mul, silu_mul_ref  # noqa: E402

# The kernel rounds silu(gate) to the model dtype before the multiply and the product once, as
# torch does; what differs is exp/divide (Triton's fast exp on the GPU vs torch's): a float32
# ulp or so of silu, ~1e-7 relative in float32, and in bf16 an occasional one-ulp flip of the
# rounded silu, which the multiply can turn into two ulps (2^-6 relative).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 0.0}  # silu(g) ~ g/2 near 0: keep a float32 floor
MAX_MISMATCH_FRACTION = 0.02  # bf16: flips must stay rare (dropping the rounding would not be)
DTYPES = [torch.float32, torch.bfloat16]


def _gate_up(t, inter, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,inter", [(1, 64), (3, 100), (16, BLOCK_I + 37), (17, 300)])
def test_matches_ref(t, inter, dtype, device):
    gu = _gate_up(t, inter, dtype, device)
    got, want = silu_mul(gu), silu_mul_ref(gu)
    assert got.shape == (t, inter) and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=RTOL[dtype], atol=ATOL[dtype])
    if dtype != torch.float32:
        assert (got != want).float().mean().item() <= MAX_MISMATCH_FRACTION


def test_strided_rows(device):
    wide = _gate_up(4, 160, torch.bfloat16, device, seed=1)
    gu = wide[:, 40:280]  # [4, 240]: rows of a wider buffer
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), rtol=RTOL[torch.bfloat16], atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_independent(dtype, device):
    gu, other = _gate_up(16, 200, dtype, device, seed=2), _gate_up(16, 200, dtype, device, seed=3)
    full = silu_mul(gu)
    for i in (0, 11):
        assert torch.equal(silu_mul(gu[i:i + 1])[0], full[i])
        mixed = other.clone()
        mixed[i] = gu[i]
        assert torch.equal(silu_mul(mixed)[i], full[i])


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("shape", [(3, 7), (6,)], ids=["odd width", "1-D"])
def test_gated_activations_refuse_a_gate_up_that_does_not_split(op, shape, device):
    """Both gated activations share one check of the fused gate/up shape (kernels/_common.py)."""
    from memra_kernels import gemma4
    fn = silu_mul if op == "silu_mul" else gemma4.gelu_tanh_mul
    with pytest.raises(ValueError, match=r"gate_up must be \[t, 2\*I\]"):
        fn(torch.zeros(shape).to(device))
