"""The CPU step ops' shortcuts give the bits of what they stand for (layers/torch_step_ops.py):
oneDNN over a packed weight is oneDNN over the plain one, the q/k norm + rope in one pass is the
op's torch body, numpy's argmax picks torch's, and what they keep between calls (packed weights,
a step's attention mask) follows a tensor that changed in place or died."""

from __future__ import annotations

import gc

import pytest
import torch

from memra_cli.engine.layers import torch_step_ops as tso
from memra_kernels.rope_ref import qk_norm_rope_kv_write_ref

WIDTH = 16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.skipif(not tso.ONEDNN_PACK, reason="this torch has no oneDNN weight packing")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not tso.ONEDNN_BF16, reason="this CPU's oneDNN has no bfloat16 matmul (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"))],
    ids=["f32", "bf16"])
def test_packed_weights_give_the_unpacked_bits_and_follow_their_weight(dtype):
    """And in bfloat16 they are F.linear's bits (torch's bfloat16 CPU matmul is oneDNN's)."""
    g = _gen(0)
    w = (torch.randn(384, 256, generator=g) * 0.05).to(dtype)
    cache = tso.PackedWeights()
    for rows in (2, tso.ONEDNN_MIN_ROWS, 15, WIDTH, 40):
        x = torch.randn(rows, 256, generator=g).to(dtype)
        plain = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        if dtype == torch.bfloat16:
            assert torch.equal(torch.nn.functional.linear(x, w), plain), rows
        packed = cache.get(w)
        assert packed is not w and packed is cache.get(w)  # made once
        assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), plain), rows
    assert cache.nbytes == w.numel() * w.element_size()
    x = torch.randn(WIDTH, 256, generator=g).to(dtype)
    w.mul_(2)  # changed in place: a new packed copy, of the new values
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, cache.get(w), None, "none", [], ""),
                       torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    assert cache.nbytes == w.numel() * w.element_size()
    del w, packed
    gc.collect()
    assert cache.nbytes == 0 and not cache._by_id  # dropped with its weight
    small = tso.PackedWeights(max_bytes=1000)  # past the budget: the weight itself (unpacked, the same bits)
    w = torch.randn(64, 64, generator=g)
    assert small.get(w) is w and small.nbytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, tso.ONEDNN_MIN_ROWS, WIDTH])
def test_a_cpu_step_matmul_runs_on_any_cpu_in_either_dtype(dtype, rows):
    """The step ops' CPU matmul gives F.linear's products to float32 rounding in both dtypes on
    any x86 CPU: oneDNN takes bfloat16 only where this CPU has its bf16 instructions (on an
    AVX2-only CPU oneDNN refuses the bf16 matmul outright), F.linear otherwise."""
    g = _gen(4)
    w = (torch.randn(384, 256, generator=g) * 0.05).to(dtype)
    x = torch.randn(rows, 256, generator=g).to(dtype)
    assert tso.onednn_applies(x, w, None) == (dtype in tso.ONEDNN_DTYPES)
    got = tso.TorchStepOps.linear(x, w)
    ref = x.float() @ w.float().T
    assert got.dtype == dtype and got.shape == (rows, 384)
    # float32: only the summation order differs (K = 256 terms, each sum within K * 2^-24 of the
    # exact one); bfloat16: one rounding of the output (2^-9), the float32 accumulation as above
    tol = 256 * 2.0**-24 if dtype == torch.float32 else 2 * 2.0**-9
    assert ((got.float() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, WIDTH])
def test_qk_norm_rope_in_one_pass_is_the_ops_torch_body(dtype, rows):
    """q returned and k, v written: every bit the reference's (the embedded target's shape: 4 q
    heads, 2 kv heads of 64)."""
    g = _gen(1)
    nh, nkv, hd, storage = 4, 2, 64, 200
    qkv = torch.randn(rows, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q_norm, k_norm = (1 + 0.1 * torch.randn(hd, generator=g)).to(dtype), (1 + 0.1 * torch.randn(hd, generator=g)).to(dtype)
    cos, sin = torch.randn(storage, hd, generator=g).to(dtype), torch.randn(storage, hd, generator=g).to(dtype)
    positions = torch.arange(150, 150 + rows)
    caches = [torch.zeros(nkv, storage, hd, dtype=dtype) for _ in range(4)]
    want = qk_norm_rope_kv_write_ref(qkv, q_norm, k_norm, cos, sin, positions, caches[0], caches[1], nh, nkv, 1e-6)
    got = tso.qk_norm_rope_kv_write_cpu(qkv, q_norm, k_norm, cos, sin, positions, caches[2], caches[3], nh, nkv, 1e-6)
    assert torch.equal(got, want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    k_norm.mul_(2)  # a norm weight changed in place: its side-by-side copy is made again
    want = qk_norm_rope_kv_write_ref(qkv, q_norm, k_norm, cos, sin, positions, caches[0], caches[1], nh, nkv, 1e-6)
    got = tso.qk_norm_rope_kv_write_cpu(qkv, q_norm, k_norm, cos, sin, positions, caches[2], caches[3], nh, nkv, 1e-6)
    assert torch.equal(got, want) and torch.equal(caches[2], caches[0])


def test_numpy_argmax_picks_torchs():
    """Ties go to the first index and a NaN counts as the maximum, in both."""
    x = torch.randn(WIDTH, 4096, generator=_gen(2))
    x[3, [7, 900]] = 50.0  # a tie
    x[5, 11] = float("nan")
    x[6, [20, 30]] = float("nan")
    x[8] = float("-inf")
    got = tso.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert got[3] == 7 and got[5] == 11 and got[6] == 20


@pytest.mark.parametrize("inference", [False, True])
def test_a_steps_attention_mask_is_kept_for_equal_positions_and_remade_for_changed_ones(inference):
    """The mask made at a step's first layer is the one its later layers get (equal positions,
    under inference_mode too, as bench and generate run), and is not reused once the positions
    change in place or another step's arrive: each call equals a fresh one."""
    g = _gen(3)
    q = torch.randn(WIDTH, 4, 64, generator=g)
    k, v = (torch.randn(2, 256, 64, generator=g) for _ in range(2))
    with torch.inference_mode(inference):
        positions = torch.arange(190, 190 + WIDTH)
        mask = tso._hidden_keys(positions, 4, 2, 0)
        assert tso._hidden_keys(positions.clone(), 4, 2, 0) is mask  # kept: the same values
        assert tso._hidden_keys(positions, 4, 2, 48) is not mask  # other settings: another mask
        first = tso.blocked_attention(q, k, v, positions, 0.125)
        assert torch.equal(tso.blocked_attention(q, k, v, positions, 0.125), first)  # the kept mask
        positions.sub_(60)
        again = tso.blocked_attention(q, k, v, positions, 0.125)
        assert torch.equal(again, tso.blocked_attention(q, k, v, torch.arange(130, 130 + WIDTH), 0.125))
        assert not torch.equal(again, first)
