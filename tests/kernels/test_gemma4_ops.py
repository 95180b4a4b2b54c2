"""Gemma 4's fused step ops (memra_kernels.gemma4) vs their torch twins (gemma4_ref): the q/k
norm + rope + v norm + K/V write (k_eq_v or a v projection, default and proportional rope tables,
a KV-shared layer's q alone) and the logits' softcap; rows independent bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.gemma4 import (  # noqa: E402
    gelu_tanh_mul,
    gelu_tanh_mul_ref,
    gemma_add_norm,
    gemma_add_norm_ref,
    gemma_add_two_norms,
    gemma_add_two_norms_ref,
    gemma_qk_norm_rope_kv_write,
    gemma_qk_norm_rope_kv_write_ref,
    gemma_rms_norm_ref,
    softcap,
    softcap_ref,
)

EPS = 1e-6
S_TAB, S = 64, 50
DTYPES = [torch.float32, torch.bfloat16]
# The kernel rounds where the twin rounds (norm: once after the weight; rope: each product, then
# the sum), so the two differ only in the float32 sum of squares' order (and 1/sqrt vs pow(-0.5)):
# the mean square within 2·sqrt(hd)·u relative (two orders of hd terms, u = 2^-24), half of that
# in its inverse square root, plus a rounding of rstd and of x·rstd·w on each side. In bf16 that
# can move a normed value's rounding by one ulp (2^-7 relative at most). Rope's products and sum
# carry it as that relative error of the largest term |normed * table| (absolute: the sum may
# cancel) plus a few ulps of the dtype there, and one ulp of the result (rtol).
EPS_OF = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}
ATOL_ULPS = {torch.float32: 8, torch.bfloat16: 2}


def _norm_rtol(hd: int, dtype: torch.dtype) -> float:
    """Relative bound between the kernel's and the twin's normed values (comment above)."""
    return (hd ** 0.5 + 4) * 2.0**-24 if dtype == torch.float32 else EPS_OF[dtype]


def _tables(kind, hd, dtype, device):
    """cos/sin `[S_TAB, hd]`: `default` rotates every pair; `proportional` (Gemma's full layers,
    partial factor 1/4) leaves the pairs past the first hd/8 frequencies at cos 1, sin 0."""
    inv = 1.0 / (1e4 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if kind == "proportional":
        inv[hd // 8:] = 0.0
    ang = torch.arange(S_TAB, dtype=torch.float32)[:, None] * torch.cat([inv, inv])[None, :]
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def _inputs(t, nh, nkv, hd, dtype, device, k_eq_v, seed=0, shared=False):
    g = torch.Generator().manual_seed(seed)
    width = (nh + (0 if shared else nkv * (1 if k_eq_v else 2))) * hd
    proj = (torch.randn(t, width, generator=g) * 2 + 0.3).to(dtype).to(device)
    q_w = (1 + 0.3 * torch.randn(hd, generator=g)).to(dtype).to(device)
    k_w = (1 + 0.3 * torch.randn(hd, generator=g)).to(dtype).to(device)
    positions = torch.randperm(S, generator=g)[:t].to(device)  # distinct, unordered
    return proj, q_w, k_w, positions


def _nan_caches(nkv, hd, dtype, device):
    return tuple(torch.full((nkv, S, hd), float("nan"), dtype=dtype, device=device) for _ in range(2))


def _assert_rope_close(got, want, term_max, dtype):
    assert torch.isfinite(got).all()
    atol = (2 * _norm_rtol(got.shape[-1], dtype) + ATOL_ULPS[dtype] * EPS_OF[dtype]) * term_max
    torch.testing.assert_close(got, want, rtol=EPS_OF[dtype], atol=atol)


CASES = [  # t, nh, nkv, hd, rope tables, k_eq_v
    (5, 4, 2, 64, "default", False),  # a sliding layer: its own v projection
    (3, 2, 1, 128, "proportional", True),  # a full layer: v from the key projection
    (2, 2, 1, 512, "proportional", True),  # the 31B's full-layer head size
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,table,k_eq_v", CASES, ids=[f"hd{c[3]}-{c[4]}-keqv{int(c[5])}" for c in CASES])
def test_qkv_matches_ref_and_writes_only_its_positions(t, nh, nkv, hd, table, k_eq_v, dtype, device):
    proj, q_w, k_w, positions = _inputs(t, nh, nkv, hd, dtype, device, k_eq_v)
    cos, sin = _tables(table, hd, dtype, device)
    kc, vc = _nan_caches(nkv, hd, dtype, device)
    kc_ref, vc_ref = _nan_caches(nkv, hd, dtype, device)
    args = (cos, sin, positions)
    q = gemma_qk_norm_rope_kv_write(proj, q_w, k_w, *args, kc, vc, nh, nkv, EPS, k_eq_v)
    q_ref = gemma_qk_norm_rope_kv_write_ref(proj, q_w, k_w, *args, kc_ref, vc_ref, nh, nkv, EPS, k_eq_v)
    assert q.shape == (t, nh, hd) and q.dtype == dtype
    heads = proj.view(t, -1, hd)
    term_max = float(torch.cat([gemma_rms_norm_ref(heads[:, :nh], q_w, EPS).flatten(),
                                gemma_rms_norm_ref(heads[:, nh:nh + nkv], k_w, EPS).flatten()]).abs().max())
    _assert_rope_close(q, q_ref, term_max, dtype)
    written = torch.zeros(S, dtype=torch.bool, device=device)
    written[positions] = True
    _assert_rope_close(kc[:, written], kc_ref[:, written], term_max, dtype)
    # v: a norm without weight, rounded once as the twin does; only the sum of squares' order differs
    torch.testing.assert_close(vc[:, written], vc_ref[:, written], rtol=_norm_rtol(hd, dtype), atol=0)
    assert torch.isnan(kc[:, ~written]).all() and torch.isnan(vc[:, ~written]).all()
    if k_eq_v:  # v is the normed raw key projection, not the normed+rotated k
        raw_k = heads[:, nh:nh + nkv].transpose(0, 1)
        torch.testing.assert_close(vc[:, positions], gemma_rms_norm_ref(raw_k, None, EPS), rtol=_norm_rtol(hd, dtype),
                                   atol=0)
    if table == "proportional":  # the unrotated pairs pass through rope: q there is the normed q
        normed = gemma_rms_norm_ref(heads[:, :nh], q_w, EPS)
        keep = torch.zeros(hd, dtype=torch.bool)
        keep[hd // 8:hd // 2] = keep[hd // 2 + hd // 8:] = True
        torch.testing.assert_close(q[..., keep], normed[..., keep], rtol=_norm_rtol(hd, dtype), atol=0)


def test_kv_shared_layer_gets_its_q_only(device):
    dtype, nh, hd = torch.bfloat16, 4, 64
    proj, q_w, _, positions = _inputs(3, nh, 0, hd, dtype, device, False, seed=4, shared=True)
    cos, sin = _tables("default", hd, dtype, device)
    q = gemma_qk_norm_rope_kv_write(proj, q_w, None, cos, sin, positions, None, None, nh, 0, EPS, False)
    q_ref = gemma_qk_norm_rope_kv_write_ref(proj, q_w, None, cos, sin, positions, None, None, nh, 0, EPS, False)
    _assert_rope_close(q, q_ref, float(gemma_rms_norm_ref(proj.view(3, nh, hd), q_w, EPS).abs().max()), dtype)
    with pytest.raises(ValueError, match="proj"):
        gemma_qk_norm_rope_kv_write(proj, q_w, None, cos, sin, positions, *_nan_caches(1, hd, dtype, device),
                                    nh, 1, EPS, True)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16],
                         ids=str)  # one kernel path for both dtypes under the interpreter
def test_qkv_rows_are_independent(dtype, device):
    nh, nkv, hd = 4, 2, 64
    proj, q_w, k_w, positions = _inputs(16, nh, nkv, hd, dtype, device, False, seed=5)
    cos, sin = _tables("default", hd, dtype, device)
    kc, vc = _nan_caches(nkv, hd, dtype, device)
    q = gemma_qk_norm_rope_kv_write(proj, q_w, k_w, cos, sin, positions, kc, vc, nh, nkv, EPS, False)
    for i in (0, 9, 15):
        kc1, vc1 = _nan_caches(nkv, hd, dtype, device)
        q1 = gemma_qk_norm_rope_kv_write(proj[i:i + 1], q_w, k_w, cos, sin, positions[i:i + 1], kc1, vc1,
                                         nh, nkv, EPS, False)
        p = positions[i]
        assert torch.equal(q1[0], q[i]) and torch.equal(kc1[:, p], kc[:, p]) and torch.equal(vc1[:, p], vc[:, p])


# --------------------------------------------------------------------------- sandwich norms


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,scalar", [(64, False), (5376, True)], ids=["d64", "d5376-scalar"])
def test_add_norm_matches_ref(d, scalar, dtype, device):
    """The residual add of a normed branch (times layer_scalar) and the next norm, against the twin.
    Only the two sums of squares' order differs (`_norm_rtol`): the branch's normed values by that
    relative error, so the new residual by that much of the largest normed value plus a rounding
    flip of the sum (one ulp: rtol); the second norm adds its own and the relative error it reads."""
    g = torch.Generator().manual_seed(9)
    x, branch = (torch.randn(5, d, generator=g) * 2).to(dtype), (torch.randn(5, d, generator=g) * 3 + 0.5).to(dtype)
    w_b, w_o = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    sc = torch.tensor([0.7], dtype=dtype) if scalar else None
    args = [a.to(device) for a in (x, branch, w_b, w_o)] + [EPS, None if sc is None else sc.to(device)]
    (x_new, out), (x_ref, out_ref) = gemma_add_norm(*args), gemma_add_norm_ref(*args)
    rel = _norm_rtol(d, dtype)
    branch_max = float(gemma_add_norm_ref(torch.zeros_like(args[0]), *args[1:])[0].float().abs().max())
    torch.testing.assert_close(x_new, x_ref, rtol=EPS_OF[dtype], atol=2 * rel * branch_max)
    out_atol = (4 * rel + 2 * EPS_OF[dtype]) * float(out_ref.abs().max())
    torch.testing.assert_close(out, out_ref, rtol=EPS_OF[dtype], atol=out_atol)
    assert torch.equal(gemma_add_norm(*[a[2:3] if i < 2 else a for i, a in enumerate(args)])[1], out[2:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_two_norms_writes_the_second_norm_in_the_same_program(dtype, device):
    """`gemma_add_two_norms` (the MoE block's experts' input norm beside the MLP's): the new
    residual and first norm the same bits as `gemma_add_norm`'s, the second norm within the bound
    of `test_add_norm_matches_ref`'s second norm against its twin, and a row's bits alone.
    Planted: the first weight in the second's place, caught by the same bound."""
    d = 64
    g = torch.Generator().manual_seed(13)
    x, branch = (torch.randn(5, d, generator=g) * 2).to(dtype), (torch.randn(5, d, generator=g) * 3 + 0.5).to(dtype)
    w_b, w_o, w_o2 = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype) for _ in range(3))
    args = [a.to(device) for a in (x, branch, w_b, w_o, w_o2)] + [EPS]
    x_new, out, out2 = gemma_add_two_norms(*args)
    want_x, want_out = gemma_add_norm(*args[:4], EPS)
    assert torch.equal(x_new, want_x) and torch.equal(out, want_out)
    ref2 = gemma_add_two_norms_ref(*args)[2]
    atol = (4 * _norm_rtol(d, dtype) + 2 * EPS_OF[dtype]) * float(ref2.abs().max())
    torch.testing.assert_close(out2, ref2, rtol=EPS_OF[dtype], atol=atol)
    assert torch.equal(gemma_add_two_norms(*[a[2:3] if i < 2 else a for i, a in enumerate(args)])[2], out2[2:3])
    planted = gemma_add_two_norms(*args[:4], args[3], EPS)[2]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(planted, ref2, rtol=EPS_OF[dtype], atol=atol)


# --------------------------------------------------------------------------- GELU-tanh · up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_mul_matches_ref(dtype, device):
    """Gate values through the tanh's series edge and its saturation. The kernel's tanh is within
    2^-20 of torch's (see the softcap test), so its GELU within 0.5·|g|·2^-20 before the rounding
    to the dtype, plus a few float32 ulps of the rest of the formula; in bf16 that may flip the
    GELU's rounding by one ulp, which the product with up carries (2 ulps relative: rtol)."""
    g = torch.Generator().manual_seed(11)
    gate = torch.cat([torch.linspace(-8, 8, 801), torch.randn(1199, generator=g) * 3]).view(2, 1000)
    up = torch.randn(2, 1000, generator=g) * 2
    gu = torch.cat([gate, up], dim=-1).to(dtype).to(device)
    got, want = gelu_tanh_mul(gu), gelu_tanh_mul_ref(gu)
    assert got.shape == (2, 1000) and got.dtype == dtype
    g_max = float(gate.abs().max())
    atol = (0.5 * 2.0**-20 + 8 * 2.0**-24) * g_max * float(up.abs().max())
    torch.testing.assert_close(got, want, rtol=2 * EPS_OF[dtype], atol=atol)
    assert torch.equal(gelu_tanh_mul(gu[1:2]), got[1:2])


# --------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_matches_ref(dtype, device):
    """Logits from -200 to 200 (past the cap, through 0, the series' edge |z| = cap/16): within
    the bound the kernel's tanh allows. Its tanh is a few float32 ulps from torch's; every other
    step rounds where torch does, so in bf16 a rounding of tanh (<= 1 ulp of 2^-8 at |tanh| < 1)
    may flip, which the cap multiplies, plus one ulp of the result; in float32 the same with the
    tanh error (<= 2^-20 absolute: 1 - e carries e's ulp divided by 1 - e >= 1 - exp(-1/8))."""
    cap = 30.0
    g = torch.Generator().manual_seed(7)
    z = torch.cat([torch.linspace(-200, 200, 4001), torch.randn(3 * 4001 - 4001, generator=g) * 20,
                   torch.tensor([cap / 16, -cap / 16, 0.0, 1e-6, -1e-30])])
    z = z[: 3 * 1000].view(3, 1000).to(dtype).to(device)
    z[2, :5] = torch.tensor([cap / 16, -cap / 16, 0.0, 1e-6, -1e-30], dtype=dtype)
    tanh_err = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-8}[dtype]
    for out_dtype in (None, torch.float32):
        got, want = softcap(z, cap, out_dtype), softcap_ref(z, cap, out_dtype)
        assert got.dtype == want.dtype == (out_dtype or dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=EPS_OF[dtype], atol=cap * tanh_err)
        assert got.abs().max() <= cap
    # rows are independent: one row alone gives its bits
    assert torch.equal(softcap(z[1:2], cap), softcap(z, cap)[1:2])


def test_qkv_into_a_ring_writes_rows_positions_modulo_its_size(device):
    """A ring storage of R rows (a sliding layer's past `ring_rows`): position p's K/V land on
    row p % R, the same values the plain storage gets at row p, and nothing else is written."""
    dtype, nh, nkv, hd, rows = torch.bfloat16, 4, 2, 64, 24
    proj, q_w, k_w, _ = _inputs(6, nh, nkv, hd, dtype, device, False, seed=6)
    positions = torch.tensor([40, 47, 3, 30, 26, 49], device=device)  # rows 16, 23, 3, 6, 2, 1
    cos, sin = _tables("default", hd, dtype, device)
    kc, vc = _nan_caches(nkv, hd, dtype, device)
    ring_k, ring_v = (torch.full((nkv, rows, hd), float("nan"), dtype=dtype, device=device) for _ in range(2))
    ref_k, ref_v = (torch.full((nkv, rows, hd), float("nan"), dtype=dtype, device=device) for _ in range(2))
    gemma_qk_norm_rope_kv_write(proj, q_w, k_w, cos, sin, positions, kc, vc, nh, nkv, EPS, False)
    gemma_qk_norm_rope_kv_write(proj, q_w, k_w, cos, sin, positions, ring_k, ring_v, nh, nkv, EPS, False)
    gemma_qk_norm_rope_kv_write_ref(proj, q_w, k_w, cos, sin, positions, ref_k, ref_v, nh, nkv, EPS, False)
    slots = positions % rows
    assert torch.equal(ring_k[:, slots], kc[:, positions]) and torch.equal(ring_v[:, slots], vc[:, positions])
    written = torch.zeros(rows, dtype=torch.bool, device=device)
    written[slots] = True
    assert torch.isnan(ring_k[:, ~written]).all() and torch.isnan(ring_v[:, ~written]).all()
    assert torch.isnan(ref_k[:, ~written]).all() and not torch.isnan(ref_k[:, written]).any()
