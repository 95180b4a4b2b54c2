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
