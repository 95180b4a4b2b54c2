"""Fused q/k RMSNorm + RoPE + KV-cache write (and its no-norm variant) vs their torch twins."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.rope import (  # noqa: E402
    _rms_norm_ref,
    qk_norm_rope_kv_write,
    qk_norm_rope_kv_write_ref,
    rope_kv_write,
    rope_kv_write_ref,
)

EPS = 1e-6
S_TAB = 64  # rope table rows
S = 50  # cache storage positions
# The per-head RMSNorm rounds where torch does, so the normed values agree up to the float32
# sum-of-squares order (see test_norm): in bf16 that rarely flips a rounding of a normed value by
# one ulp; in float32 no coarser rounding absorbs it, so normed values differ by a float32 ulp or
# two. RoPE differs by design: the kernel rounds `x*cos - x'*sin` once from float32, the
# reference rounds each product and the sum (three half-ulp roundings of terms up to
# max|normed * table|). Bound (absolute, since the sum can cancel): ATOL_ULPS ulps-at-1 of the
# dtype times the largest term, plus one ulp of the result (rtol).
EPS_OF = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
ATOL_ULPS = {torch.float32: 8, torch.bfloat16: 2}
DTYPES = [torch.float32, torch.bfloat16]


def _tables(kind: str, hd: int, dtype: torch.dtype, device: str, g: torch.Generator):
    pos = torch.arange(S_TAB, dtype=torch.float32)[:, None]
    if kind == "default":  # HF: cat(freqs, freqs), theta 1e6
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        cos, sin = ang.cos(), ang.sin()
    elif kind == "yarn":  # non-uniform (ramped) frequencies, mscale 1.1 on cos and sin
        inv = 1.0 / (1e4 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ramp = torch.linspace(0, 1, hd // 2)
        inv = inv * (1 - ramp) + inv / 8 * ramp
        ang = torch.cat([pos * inv, pos * inv], dim=-1)
        cos, sin = 1.1 * ang.cos(), 1.1 * ang.sin()
    else:  # arbitrary tables whose halves differ: catches a kernel reading the wrong half
        cos, sin = torch.rand(S_TAB, hd, generator=g) + 0.1, torch.rand(S_TAB, hd, generator=g) - 0.5
    return cos.to(dtype).to(device), sin.to(dtype).to(device)


def _inputs(t, nh, nkv, hd, dtype, device, table="default", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 2 + 0.3).to(dtype).to(device)
    q_w = (1 + 0.3 * torch.randn(hd, generator=g)).to(dtype).to(device)
    k_w = (1 + 0.3 * torch.randn(hd, generator=g)).to(dtype).to(device)
    cos, sin = _tables(table, hd, dtype, device, g)
    positions = torch.randperm(S, generator=g)[:t].to(device)  # distinct, unordered
    return qkv, q_w, k_w, cos, sin, positions


def _poisoned_caches(nkv, hd, dtype, device):
    return (torch.full((nkv, S, hd), float("nan"), dtype=dtype, device=device),
            torch.full((nkv, S, hd), float("nan"), dtype=dtype, device=device))


def _term_max(qkv, q_w, k_w, cos, sin, nh, nkv) -> float:
    """Largest |normed * cos| or |normed * sin| rope adds: scales the absolute tolerance."""
    hd = q_w.shape[0]
    heads = qkv.reshape(qkv.shape[0], nh + 2 * nkv, hd)
    normed = torch.cat([_rms_norm_ref(heads[:, :nh], q_w, EPS).flatten(),
                        _rms_norm_ref(heads[:, nh:nh + nkv], k_w, EPS).flatten()])
    table = max(float(cos.float().abs().max()), float(sin.float().abs().max()))
    return float(normed.float().abs().max()) * table


def _assert_rope_close(got, want, term_max, dtype):
    atol = ATOL_ULPS[dtype] * EPS_OF[dtype] * term_max
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=EPS_OF[dtype], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,table", [
    (1, 4, 2, 128, "default"),
    (3, 2, 2, 64, "yarn"),
    (16, 4, 2, 128, "yarn"),
    (17, 4, 1, 64, "random"),
    (5, 2, 1, 96, "random"),  # head_dim whose half is not a power of two
])
def test_matches_ref_and_writes_only_its_positions(t, nh, nkv, hd, table, dtype, device):
    qkv, q_w, k_w, cos, sin, positions = _inputs(t, nh, nkv, hd, dtype, device, table)
    kc, vc = _poisoned_caches(nkv, hd, dtype, device)
    kc_ref, vc_ref = _poisoned_caches(nkv, hd, dtype, device)
    q = qk_norm_rope_kv_write(qkv, q_w, k_w, cos, sin, positions, kc, vc, nh, nkv, EPS)
    q_ref = qk_norm_rope_kv_write_ref(qkv, q_w, k_w, cos, sin, positions, kc_ref, vc_ref, nh, nkv, EPS)
    assert q.shape == (t, nh, hd) and q.dtype == dtype
    bound = _term_max(qkv, q_w, k_w, cos, sin, nh, nkv)
    _assert_rope_close(q, q_ref, bound, dtype)
    written = torch.zeros(S, dtype=torch.bool, device=device)
    written[positions] = True
    _assert_rope_close(kc[:, written], kc_ref[:, written], bound, dtype)
    assert torch.equal(vc[:, written], vc_ref[:, written])  # v is copied, not computed
    # Every element of the written rows was stored; nothing else was touched.
    assert torch.isnan(kc[:, ~written]).all() and torch.isnan(vc[:, ~written]).all()


def test_q_matches_with_cache_rows_strided(device):
    """Caches as views of the engine's `[2, nkv, S, hd]` storage (strided head axis)."""
    dtype = torch.bfloat16
    qkv, q_w, k_w, cos, sin, positions = _inputs(6, 4, 2, 64, dtype, device, "yarn", seed=3)
    kv = torch.full((2, 2, S, 64), float("nan"), dtype=dtype, device=device)
    kv_ref = kv.clone()
    q = qk_norm_rope_kv_write(qkv, q_w, k_w, cos, sin, positions, kv[0], kv[1], 4, 2, EPS)
    q_ref = qk_norm_rope_kv_write_ref(qkv, q_w, k_w, cos, sin, positions, kv_ref[0], kv_ref[1], 4, 2, EPS)
    _assert_rope_close(q, q_ref, _term_max(qkv, q_w, k_w, cos, sin, 4, 2), dtype)
    assert torch.equal(kv.isnan(), kv_ref.isnan())  # the same cells written, nothing else
    assert torch.equal(kv[1, :, positions], kv_ref[1, :, positions])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_independent(dtype, device):
    """A row's q and cache rows are bit-identical alone or within a 16-row step."""
    nh, nkv, hd = 4, 2, 64
    qkv, q_w, k_w, cos, sin, positions = _inputs(16, nh, nkv, hd, dtype, device, "yarn", seed=5)
    kc, vc = _poisoned_caches(nkv, hd, dtype, device)
    q = qk_norm_rope_kv_write(qkv, q_w, k_w, cos, sin, positions, kc, vc, nh, nkv, EPS)
    for i in (0, 9, 15):
        kc1, vc1 = _poisoned_caches(nkv, hd, dtype, device)
        q1 = qk_norm_rope_kv_write(qkv[i:i + 1], q_w, k_w, cos, sin, positions[i:i + 1], kc1, vc1,
                                   nh, nkv, EPS)
        p = positions[i]
        assert torch.equal(q1[0], q[i])
        assert torch.equal(kc1[:, p], kc[:, p]) and torch.equal(vc1[:, p], vc[:, p])


# --------------------------------------------------------------------------- no q/k norm (LLaMA)


def _assert_no_norm_close(got, want, qkv, cos, sin, dtype):
    """The no-norm kernel's only difference from the twin is rope's rounding (once from float32
    against three model-dtype roundings), so the bound is the normed variant's with the raw
    projected values as the terms."""
    table = max(float(cos.float().abs().max()), float(sin.float().abs().max()))
    _assert_rope_close(got, want, float(qkv.float().abs().max()) * table, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,table", [
    (1, 4, 2, 64, "default"),
    (16, 4, 1, 64, "random"),
    (5, 2, 1, 96, "yarn"),  # head_dim whose half is not a power of two
])
def test_rope_kv_write_matches_ref_and_applies_no_norm(t, nh, nkv, hd, table, dtype, device):
    qkv, _, _, cos, sin, positions = _inputs(t, nh, nkv, hd, dtype, device, table, seed=7)
    kc, vc = _poisoned_caches(nkv, hd, dtype, device)
    kc_ref, vc_ref = _poisoned_caches(nkv, hd, dtype, device)
    q = rope_kv_write(qkv, cos, sin, positions, kc, vc, nh, nkv)
    q_ref = rope_kv_write_ref(qkv, cos, sin, positions, kc_ref, vc_ref, nh, nkv)
    assert q.shape == (t, nh, hd) and q.dtype == dtype
    _assert_no_norm_close(q, q_ref, qkv, cos, sin, dtype)
    written = torch.zeros(S, dtype=torch.bool, device=device)
    written[positions] = True
    _assert_no_norm_close(kc[:, written], kc_ref[:, written], qkv, cos, sin, dtype)
    assert torch.equal(vc[:, written], vc_ref[:, written])
    assert torch.isnan(kc[:, ~written]).all() and torch.isnan(vc[:, ~written]).all()
    # not a unit-weight norm in disguise: the normed kernel with unit weights rescales each head
    unit = torch.ones(hd, dtype=dtype, device=device)
    normed = qk_norm_rope_kv_write(qkv, unit, unit, cos, sin, positions, *_poisoned_caches(nkv, hd, dtype, device),
                                   nh, nkv, EPS)
    assert not torch.allclose(normed.float(), q.float(), rtol=0.05, atol=0.05)


def test_rope_kv_write_rows_are_independent(device):
    nh, nkv, hd, dtype = 4, 2, 64, torch.bfloat16
    qkv, _, _, cos, sin, positions = _inputs(16, nh, nkv, hd, dtype, device, "yarn", seed=8)
    kc, vc = _poisoned_caches(nkv, hd, dtype, device)
    q = rope_kv_write(qkv, cos, sin, positions, kc, vc, nh, nkv)
    for i in (0, 15):
        kc1, vc1 = _poisoned_caches(nkv, hd, dtype, device)
        q1 = rope_kv_write(qkv[i:i + 1], cos, sin, positions[i:i + 1], kc1, vc1, nh, nkv)
        p = positions[i]
        assert torch.equal(q1[0], q[i]) and torch.equal(kc1[:, p], kc[:, p]) and torch.equal(vc1[:, p], vc[:, p])


@pytest.mark.parametrize("bad", ["positions float", "positions short", "k_cache head_dim", "v_cache n_kv"])
def test_refuses_bad_positions_and_caches(bad, device):
    """The positions and KV-cache checks the fused step kernels share (kernels/_common.py)."""
    nh, nkv, hd, t = 4, 2, 64, 3
    qkv, q_w, k_w, cos, sin, positions = _inputs(t, nh, nkv, hd, torch.float32, device)
    kc, vc = _poisoned_caches(nkv, hd, torch.float32, device)
    if bad == "positions float":
        positions = positions.float()
    elif bad == "positions short":
        positions = positions[:-1]
    elif bad == "k_cache head_dim":
        kc = kc[..., :-2]
    else:
        vc = vc[:1]
    match = "positions must be" if bad.startswith("positions") else bad.split()[0] + r" .* is not \[n_kv=2, S, head_dim=64\]"
    with pytest.raises(ValueError, match=match):
        qk_norm_rope_kv_write(qkv, q_w, k_w, cos, sin, positions, kc, vc, nh, nkv, EPS)


# --------------------------------------------------------------------------- the projection's epilogue


def _qkv_case(t: int, dtype, seed: int = 0, nh: int = 4, nkv: int = 2, hd: int = 32, hidden: int = 64, S: int = 48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w = (torch.randn((nh + 2 * nkv) * hd, hidden, generator=g) * 0.1).to(dtype)
    qn, kn = ((1 + 0.2 * torch.randn(hd, generator=g)).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(S, hd, generator=g).to(dtype) for _ in range(2))
    pos = torch.randperm(S, generator=g)[:t]
    return x, w, qn, kn, cos, sin, pos, nh, nkv


def _fused(x, w, qn, kn, cos, sin, pos, nh, nkv, norm=True, device="cpu"):
    from memra_kernels.dense_linear import dense_qkv_rope_kv_write

    hd = cos.shape[1]
    kc = torch.zeros(nkv, cos.shape[0], hd, dtype=x.dtype, device=device)
    vc = torch.zeros_like(kc)
    q = dense_qkv_rope_kv_write(x.to(device), w.to(device), qn.to(device) if norm else None,
                                kn.to(device) if norm else None, cos.to(device), sin.to(device), pos.to(device),
                                kc, vc, nh, nkv, 1e-6)
    return q, kc, vc


@pytest.mark.parametrize("t", [5, 20])  # one m tile, two
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_projection_epilogue_is_the_two_launches(t, split, norm, dtype, device, monkeypatch):
    """`dense_qkv_rope_kv_write` (one launch) == `dense_linear` then `qk_norm_rope_kv_write` /
    `rope_kv_write`, bit for bit: q, the K and the V cache, one tile per half head, `in` split or
    not (the split partials summed in split order, rounded as the projection is)."""
    from memra_kernels import dense_linear as dl

    x, w, qn, kn, cos, sin, pos, nh, nkv = _qkv_case(t, dtype)
    monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=16, block_k=16, split_k=split, num_stages=2))
    q, kc, vc = _fused(x, w, qn, kn, cos, sin, pos, nh, nkv, norm, device)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    qkv = dl.dense_linear(x.to(device), w.to(device))
    args = (cos.to(device), sin.to(device), pos.to(device), kc2, vc2, nh, nkv)
    q2 = qk_norm_rope_kv_write(qkv, qn.to(device), kn.to(device), *args, 1e-6) if norm else rope_kv_write(qkv, *args)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc[:, pos].abs().sum() > 0 and vc[:, pos].abs().sum() > 0  # written where the rows sit


def test_the_projection_epilogue_rows_are_independent_and_a_planted_break_is_seen(device, monkeypatch):
    """A row's q and K/V bits alone == among 16 rows (any row of the m tile); and the check can fail:
    a row normed by the whole step's statistic (a planted break) differs."""
    from memra_kernels import dense_linear as dl

    x, w, qn, kn, cos, sin, pos, nh, nkv = _qkv_case(16, torch.bfloat16, seed=3)
    monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=16, block_k=16, split_k=2, num_stages=2))
    q, kc, vc = _fused(x, w, qn, kn, cos, sin, pos, nh, nkv, device=device)
    for i in (0, 15):
        q1, kc1, vc1 = _fused(x[i:i + 1], w, qn, kn, cos, sin, pos[i:i + 1], nh, nkv, device=device)
        p = pos[i].item()
        assert torch.equal(q1[0], q[i]) and torch.equal(kc1[:, p], kc[:, p]) and torch.equal(vc1[:, p], vc[:, p])
    head = dl.dense_linear(x.to(device), w.to(device))[:, :32].float()  # q head 0 of every row
    shared = head * torch.rsqrt(head.pow(2).mean() + 1e-6)  # one statistic for the whole step
    planted = (qn.to(device) * shared.to(torch.bfloat16))[4]
    ref = _rms_norm_ref(head[4:5].to(torch.bfloat16), qn.to(device), 1e-6)[0]
    assert not torch.equal(planted, ref)


def test_the_projection_epilogue_refuses_tiles_across_heads(device, monkeypatch):
    from memra_kernels import dense_linear as dl

    x, w, qn, kn, cos, sin, pos, nh, nkv = _qkv_case(4, torch.float32)
    monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=64, block_k=16, split_k=1, num_stages=2))
    with pytest.raises(ValueError, match="inside heads of 32"):
        _fused(x, w, qn, kn, cos, sin, pos, nh, nkv, device=device)
