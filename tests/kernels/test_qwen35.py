"""Qwen3.5's fused kernels (kernels/qwen35.py) vs their torch twins, row invariance, and planted
bugs the comparisons must catch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from memra_kernels.deltanet import causal_conv_silu  # noqa: E402
from memra_kernels.qwen35 import (  # noqa: E402
    gated_qk_norm_rope_kv_write, gated_qk_norm_rope_kv_write_ref, gated_rms_norm, gated_rms_norm_ref,
    gdn_conv_gates, gdn_conv_gates_ref, gdn_gates, gdn_gates_ref, output_gate, output_gate_ref,
)

from memra_cli.engine.layers.deltanet import gated_rms_norm as engine_gated_rms_norm  # noqa: E402
from memra_cli.engine.layers.deltanet import rms_norm_1p  # noqa: E402
from memra_cli.engine.layers.rope import apply_partial_rope  # noqa: E402
from memra_cli.engine.layers.torch_step_ops import TorchStepOps  # noqa: E402

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# Each kernel rounds where its twin rounds, so what differs is float32 arithmetic: a sum of
# squares in another order, exp / log / divide. In float32 a few ulps (~1e-7 relative; atol for
# values that cancel, e.g. a rope sum); in bf16 that rarely flips a rounding, by one bf16 ulp
# (2^-8..2^-7 relative), on a few elements only: MAX_MISMATCH bounds the fraction of elements
# that differ at all, which is what catches a missing or extra rounding (it touches many).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-8),
       torch.float16: dict(rtol=2**-10, atol=2**-11)}
MAX_MISMATCH = 0.02


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL[want.dtype])
    if want.dtype != torch.float32:
        mismatched = (got != want).float().mean().item()
        assert mismatched <= MAX_MISMATCH, f"{mismatched:.1%} of elements differ"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- gated attention


def _attn_inputs(t, nh, nkv, hd, r, dtype, device, seed=0, s=40, pad=0):
    """qgkv as a column slice of a wider buffer when pad > 0 (strided rows, as the engine's
    projection views are not, but a kernel must not assume it)."""
    g = _gen(seed)
    width = (2 * nh + 2 * nkv) * hd
    buf = (torch.randn(t, width + 2 * pad, generator=g) * 2 + 0.3).to(dtype)
    qgkv = buf[:, pad:pad + width]
    q_norm = (1 + 0.3 * torch.randn(hd, generator=g)).float()
    k_norm = (1 + 0.3 * torch.randn(hd, generator=g)).float()
    ang = torch.arange(s)[:, None].float() * torch.rand(r // 2, generator=g)[None] * 0.3
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    positions = torch.randperm(s, generator=g)[:t]
    kv = torch.randn(2, nkv, s, hd, generator=g).to(dtype)
    to = (lambda x: x.to(device))
    return (to(qgkv), to(q_norm), to(k_norm), to(cos), to(sin), to(positions), to(kv))


def _run_qk(fn, qgkv, q_norm, k_norm, cos, sin, positions, kv, nh, nkv):
    kv = kv.clone()
    q = fn(qgkv, q_norm, k_norm, cos, sin, positions, kv[0], kv[1], nh, nkv, EPS)
    return q, kv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,r,pad", [
    (1, 4, 2, 32, 8, 0), (3, 4, 2, 32, 32, 16), (16, 4, 2, 64, 16, 0), (17, 2, 1, 128, 32, 8),
    (3, 2, 1, 256, 64, 0), (16, 4, 2, 256, 256, 8),
])
def test_gated_qk_matches_ref(t, nh, nkv, hd, r, pad, dtype, device):
    args = _attn_inputs(t, nh, nkv, hd, r, dtype, device, pad=pad)
    kv_before = args[-1].clone()
    q, kv = _run_qk(gated_qk_norm_rope_kv_write, *args, nh, nkv)
    q_ref, kv_ref = _run_qk(gated_qk_norm_rope_kv_write_ref, *args, nh, nkv)
    _assert_matches(q, q_ref)
    _assert_matches(kv[0], kv_ref[0])
    assert torch.equal(kv[1], kv_ref[1])  # v is copied as projected
    written = torch.zeros(kv.shape[2], dtype=torch.bool, device=device)
    written[args[5]] = True
    assert torch.equal(kv[:, :, ~written], kv_before[:, :, ~written])  # nothing else touched


def test_gated_qk_ref_is_the_engine_formula(device):
    """The twin is the model's torch code: zero-centred norm, then partial rope, bit for bit."""
    nh, nkv, hd, r = 4, 2, 64, 16
    qgkv, q_norm, k_norm, cos, sin, positions, kv = _attn_inputs(5, nh, nkv, hd, r, torch.bfloat16, device)
    q, kv = _run_qk(gated_qk_norm_rope_kv_write_ref, qgkv, q_norm, k_norm, cos, sin, positions, kv, nh, nkv)
    qg = qgkv[:, :2 * nh * hd].view(5, nh, 2 * hd)
    want = apply_partial_rope(rms_norm_1p(qg[..., :hd], q_norm, EPS), cos[positions], sin[positions])
    assert torch.equal(q, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_qk_catches_planted_bugs(dtype, device):
    """What the comparison would miss if it were loose: the Qwen3 norm order (rounded before the
    weight multiply) and rope over the whole head instead of the rotary dims both fail it."""
    nh, nkv, hd, r = 4, 2, 64, 16
    args = _attn_inputs(16, nh, nkv, hd, r, dtype, device, seed=3)
    qgkv, q_norm, k_norm, cos, sin, positions, _ = args
    q, _ = _run_qk(gated_qk_norm_rope_kv_write, *args, nh, nkv)
    qh = qgkv[:, :2 * nh * hd].view(16, nh, 2 * hd)[..., :hd]
    xf = qh.float()
    qwen3_order = (q_norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)).to(dtype)
    wrong = [apply_partial_rope(qwen3_order, cos[positions], sin[positions])]
    full = torch.cat([cos, torch.ones(cos.shape[0], hd - r, dtype=dtype, device=device)], dim=-1)
    zeros = torch.cat([sin, torch.zeros(sin.shape[0], hd - r, dtype=dtype, device=device)], dim=-1)
    wrong.append(apply_partial_rope(rms_norm_1p(qh, q_norm, EPS), full[positions], zeros[positions]))
    if dtype == torch.float32:
        wrong = wrong[1:]  # in float32 the two norm orders round alike
    for w in wrong:
        with pytest.raises(AssertionError):
            _assert_matches(q, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_qk_rows_are_independent(dtype, device):
    nh, nkv, hd, r = 4, 2, 64, 16
    args = _attn_inputs(16, nh, nkv, hd, r, dtype, device, seed=4)
    qgkv, q_norm, k_norm, cos, sin, positions, kv = args
    q, kv_full = _run_qk(gated_qk_norm_rope_kv_write, *args, nh, nkv)
    other = _attn_inputs(16, nh, nkv, hd, r, dtype, device, seed=5)[0]
    for i in (0, 7, 15):
        qi, kvi = _run_qk(gated_qk_norm_rope_kv_write, qgkv[i:i + 1], q_norm, k_norm, cos, sin,
                          positions[i:i + 1], kv, nh, nkv)
        assert torch.equal(qi[0], q[i])
        p = positions[i]
        assert torch.equal(kvi[:, :, p], kv_full[:, :, p])
        mixed = other.clone()
        mixed[i] = qgkv[i]
        qm, _ = _run_qk(gated_qk_norm_rope_kv_write, mixed, q_norm, k_norm, cos, sin, positions, kv, nh, nkv)
        assert torch.equal(qm[i], q[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,hd,pad", [(1, 4, 32, 0), (3, 2, 256, 8), (16, 4, 64, 0), (17, 16, 128, 4)])
def test_output_gate_matches_ref(t, nh, hd, pad, dtype, device):
    g = _gen(6)
    width = (2 * nh + 2) * hd
    qgkv = (torch.randn(t, width + pad, generator=g) * 3).to(dtype).to(device)[:, pad:]
    out = torch.randn(t, nh * hd + pad, generator=g).to(dtype).to(device)[:, :nh * hd]
    got = output_gate(out, qgkv, nh)
    want = output_gate_ref(out, qgkv, nh)
    _assert_matches(got, want)
    # planted bug: a gate read from the query half instead (an off-by-hd column) must fail
    wrong = out * torch.sigmoid(qgkv[:, :2 * nh * hd].view(t, nh, 2 * hd)[..., :hd].reshape(t, nh * hd))
    with pytest.raises(AssertionError):
        _assert_matches(got, wrong)
    # rows alone == rows in the launch
    for i in (0, t - 1):
        assert torch.equal(output_gate(out[i:i + 1], qgkv[i:i + 1], nh)[0], got[i])


# --------------------------------------------------------------------------- Gated DeltaNet


def _gate_inputs(t, hv, dtype, device, seed=0, c=96, ring=20):
    g = _gen(seed)
    proj = torch.randn(t, c + 2 * hv + 8, generator=g) * 4
    proj[:, c + hv] = 25.0  # above softplus' threshold (a + dt_bias > 20)
    proj[:, c + hv + 1] = -30.0  # where log1p(exp(x)) ~ exp(x)
    proj = proj.to(dtype).to(device)
    ba = proj[:, c:c + 2 * hv]  # a strided view, as the engine's split
    a_neg = -(torch.rand(hv, generator=g) * 8 + 0.5).to(device)
    dt_bias = (torch.randn(hv, generator=g) * 0.5).to(device)
    ring_idx = torch.randperm(ring, generator=g)[:t].to(device)
    return proj, ba, a_neg, dt_bias, ring_idx


def _record_buffers(t, hv, c, ring, dtype, device, replay, seed=1):
    g = _gen(seed)
    xs = torch.randn(ring, c, generator=g).to(dtype).to(device)
    conv = torch.randn(t, c, generator=g).to(dtype).to(device)
    if not replay:
        return xs, None
    return xs, (torch.randn(ring, c, generator=g).to(dtype).to(device), conv,
                torch.randn(ring, hv, generator=g).to(device), torch.randn(ring, hv, generator=g).to(device))


def _clone(record):
    xs, replay = record
    return xs.clone(), None if replay is None else (replay[0].clone(), replay[1], replay[2].clone(), replay[3].clone())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,hv", [(1, 4), (3, 32), (16, 48), (17, 4)])
def test_gdn_gates_match_ref(t, hv, dtype, device):
    proj, ba, a_neg, dt_bias, _ = _gate_inputs(t, hv, dtype, device)
    g, beta = gdn_gates(ba, a_neg, dt_bias)
    g_ref, beta_ref = gdn_gates_ref(ba, a_neg, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=0)  # log1p by Goldberg's form: a few ulps
    if dtype == torch.float32:
        torch.testing.assert_close(beta, beta_ref, rtol=1e-6, atol=0)
    else:  # sigmoid rounded to bf16: equal unless a float32 ulp flips the rounding
        torch.testing.assert_close(beta, beta_ref, rtol=2**-7, atol=0)
        assert (beta != beta_ref).float().mean().item() <= MAX_MISMATCH
    # planted bug: softplus without its threshold branch overflows nothing here, but log(1 + e)
    # for tiny e (a + dt_bias = -30) loses everything: g would be 0 where it must not be
    x = ba[:, hv:].float() + dt_bias
    naive = a_neg * torch.log(1 + torch.exp(x))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(g, naive, rtol=1e-5, atol=0)


@pytest.mark.parametrize("replay", [False, True], ids=["stash", "replay"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gdn_gates_record_like_index_copy(replay, dtype, device):
    t, hv, c, ring = 5, 8, 1100, 20  # c spans two column blocks
    proj, ba, a_neg, dt_bias, ring_idx = _gate_inputs(t, hv, dtype, device, c=c, ring=ring)
    mixed = proj[:, :c]
    record = _record_buffers(t, hv, c, ring, dtype, device, replay)
    got_rec, want_rec = _clone(record), _clone(record)
    g, beta = gdn_gates(ba, a_neg, dt_bias, ring_idx, got_rec[0], mixed, got_rec[1])
    gdn_gates_ref(ba, a_neg, dt_bias, ring_idx, want_rec[0], mixed, want_rec[1])
    assert torch.equal(got_rec[0], want_rec[0])
    if replay:
        assert torch.equal(got_rec[1][0], want_rec[1][0])
        untouched = torch.ones(ring, dtype=torch.bool, device=device)
        untouched[ring_idx] = False
        assert torch.equal(got_rec[1][2][ring_idx], g) and torch.equal(got_rec[1][3][ring_idx], beta)
        assert torch.equal(got_rec[1][2][untouched], record[1][2][untouched])
        assert torch.equal(got_rec[1][3][untouched], record[1][3][untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gdn_gates_rows_are_independent(dtype, device):
    proj, ba, a_neg, dt_bias, _ = _gate_inputs(16, 32, dtype, device, seed=7)
    g, beta = gdn_gates(ba, a_neg, dt_bias)
    for i in (0, 9, 15):
        gi, bi = gdn_gates(ba[i:i + 1], a_neg, dt_bias)
        assert torch.equal(gi[0], g[i]) and torch.equal(bi[0], beta[i])


# ---------------------------------------------------- the fused conv + gates (gdn_conv_gates)

RECORDS = ["none", "stash", "replay"]  # no record (prefill), conv inputs only, + conv out / g / beta


def _conv_gates_inputs(t, k, c, hv, dtype, device, record, final, seed=0, ring=20):
    """As the engine passes them: `mixed` and `ba` strided column views of one projection (with
    softplus' threshold and its tiny-exp end in `a`), a contiguous window, rings and the final
    window pre-filled with noise (so a missed or stray write shows)."""
    g = _gen(seed)
    proj = torch.randn(t, c + 5 + 2 * hv + 3, generator=g) * 3
    proj[:, c + 5 + hv] = 25.0
    proj[:, c + 5 + hv + 1] = -30.0
    proj = proj.to(dtype).to(device)
    mixed, ba = proj[:, :c], proj[:, c + 5:c + 5 + 2 * hv]
    window = torch.randn(k - 1, c, generator=g).to(dtype).to(device)
    conv_w = (torch.randn(c, k, generator=g) * 0.5).to(device)
    a_neg = -(torch.rand(hv, generator=g) * 8 + 0.5).to(device)
    dt_bias = (torch.randn(hv, generator=g) * 0.5).to(device)
    ring_idx = torch.randperm(ring, generator=g)[:t].to(device) if record != "none" else None
    xs = torch.randn(ring, c, generator=g).to(dtype).to(device) if record != "none" else None
    rings = None
    if record == "replay":
        rings = (torch.randn(ring, c, generator=g).to(dtype).to(device), torch.randn(ring, hv, generator=g).to(device),
                 torch.randn(ring, hv, generator=g).to(device))
    fw = torch.randn(k - 1, c, generator=g).to(dtype).to(device) if final else None
    return (window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs, rings, fw)


def _fresh(args):
    """The inputs with fresh copies of everything written (rings, final window)."""
    window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs, rings, fw = args
    return (window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, None if xs is None else xs.clone(),
            None if rings is None else tuple(r.clone() for r in rings), None if fw is None else fw.clone())


def _written(args):
    """What an op wrote: xs ring, replay rings, final window (None where not asked)."""
    return [args[7], *(args[8] or (None, None, None)), args[9]]


def _old_ops(args):
    """The two separate kernels, as the step ran them before the fusion."""
    window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs, rings, fw = args
    conv = causal_conv_silu(window, mixed, conv_w)
    replay = None if rings is None else (rings[0], conv, rings[1], rings[2])
    g, beta = gdn_gates(ba, a_neg, dt_bias, ring_idx, xs, None if ring_idx is None else mixed, replay)
    if fw is not None:  # not the old ops' job: the window after the last row, by hand
        fw.copy_(torch.cat([window, mixed])[mixed.shape[0]:])
    return conv, g, beta


CONV_GATES_SHAPES = [  # (t, K, C): C not a multiple of the 256-column conv block, t below / at / above K-1
    (1, 4, 300), (2, 4, 96), (3, 4, 513), (16, 4, 300), (17, 4, 96), (1, 2, 300), (3, 2, 257), (17, 2, 96),
]


@pytest.mark.parametrize("final", [False, True], ids=["nofw", "fw"])
@pytest.mark.parametrize("record", RECORDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k,c", CONV_GATES_SHAPES)
def test_gdn_conv_gates_is_the_two_old_kernels_bit_for_bit(t, k, c, dtype, record, final, device):
    """The contract: one launch, the same bits as `causal_conv_silu` then `gdn_gates` (outputs and
    every ring row), and the final window exactly the last K-1 rows of [window; mixed]."""
    args = _conv_gates_inputs(t, k, c, 8, dtype, device, record, final, seed=t * 10 + k)
    got_args, old_args = _fresh(args), _fresh(args)
    got = gdn_conv_gates(*got_args)
    want = _old_ops(old_args)
    for a, b, name in zip(got, want, ("conv", "g", "beta"), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for a, b in zip(_written(got_args), _written(old_args), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    if record != "none":  # rows outside the step's slots untouched (the old ops' own guarantee)
        kept = torch.ones(args[7].shape[0], dtype=torch.bool, device=device)
        kept[args[6]] = False
        for before, after in zip(_written(args)[:4], _written(got_args)[:4]):
            if before is not None:
                assert torch.equal(after[kept], before[kept])


@pytest.mark.parametrize("final", [False, True], ids=["nofw", "fw"])
@pytest.mark.parametrize("record", RECORDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k,c", [(1, 4, 300), (3, 4, 513), (17, 4, 96), (3, 2, 257)])
def test_gdn_conv_gates_matches_its_twin(t, k, c, dtype, record, final, device):
    """Against the torch twin: the conv at the conv kernel's tolerance (test_deltanet.py), the
    gates at the gates kernel's, everything copied (record, final window) exactly, and the twin
    is the engine's torch op bit for bit."""
    args = _conv_gates_inputs(t, k, c, 8, dtype, device, record, final, seed=1)
    got_args, ref_args, eng_args = _fresh(args), _fresh(args), _fresh(args)
    conv, g, beta = gdn_conv_gates(*got_args)
    conv_r, g_r, beta_r = gdn_conv_gates_ref(*ref_args)
    eng = TorchStepOps.gdn_conv_gates(*eng_args)
    present = (lambda xs: [x for x in xs if x is not None])
    for a, b in zip((conv_r, g_r, beta_r, *present(_written(ref_args))), (*eng, *present(_written(eng_args))),
                    strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(conv, conv_r, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-6)
    torch.testing.assert_close(g, g_r, rtol=1e-5, atol=0)
    torch.testing.assert_close(beta, beta_r, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0)
    if dtype != torch.float32:
        assert (conv != conv_r).float().mean().item() <= MAX_MISMATCH
    got_w, ref_w = _written(got_args), _written(ref_args)
    assert (got_w[0] is None) == (ref_w[0] is None) and (got_w[0] is None or torch.equal(got_w[0], ref_w[0]))
    assert (got_w[4] is None) == (ref_w[4] is None) and (got_w[4] is None or torch.equal(got_w[4], ref_w[4]))
    if record == "replay":  # the rings hold the op's own outputs at the step's slots
        idx = args[6]
        assert torch.equal(got_w[1][idx], conv) and torch.equal(got_w[2][idx], g) and torch.equal(got_w[3][idx], beta)


@pytest.mark.parametrize("k", [4, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gdn_conv_gates_rows_one_at_a_time_through_the_final_window(k, dtype, device):
    """Grouping invariance with the final window as the carried state: 16 rows one launch at a
    time, each from the previous launch's final window, give the 16-row launch's bits (outputs,
    ring rows, final window)."""
    t, c, hv = 16, 300, 8
    args = _conv_gates_inputs(t, k, c, hv, dtype, device, "replay", True, seed=21)
    whole_args = _fresh(args)
    whole = gdn_conv_gates(*whole_args)
    window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs, rings, fw = _fresh(args)
    win = window.clone()
    for r in range(t):
        out = gdn_conv_gates(win, mixed[r:r + 1], conv_w, ba[r:r + 1], a_neg, dt_bias, ring_idx[r:r + 1], xs, rings,
                             fw)
        for a, b in zip(out, whole, strict=True):
            assert torch.equal(a[0], b[r]), r
        win = fw.clone()  # the next row's window (final_window must not overlap window)
    assert torch.equal(fw, whole_args[9])
    assert torch.equal(xs, whole_args[7]) and all(torch.equal(a, b) for a, b in zip(rings, whole_args[8]))


@pytest.mark.parametrize("live", [1, 2, 6, 99])
@pytest.mark.parametrize("fn", [gdn_conv_gates, gdn_conv_gates_ref, TorchStepOps.gdn_conv_gates],
                         ids=["kernel", "twin", "engine"])
def test_gdn_conv_gates_final_window_after_the_last_live_row(fn, live, device):
    """A fixed step's padding: with `live` the final window is the one after row min(t, live) - 1,
    bit for bit a call on the live rows alone leaves (K = 4, so live 1 and 2 take window rows
    too), and every row's outputs and record are those of the call without `live`."""
    t, k, c = 6, 4, 300
    args = _conv_gates_inputs(t, k, c, 8, torch.bfloat16, device, "replay", True, seed=5)
    n = min(t, live)
    alone = list(_fresh(args))
    alone[1], alone[3], alone[6] = alone[1][:n], alone[3][:n], alone[6][:n]
    fn(*alone)
    full, padded = _fresh(args), _fresh(args)
    want = fn(*full)
    got = fn(*padded, live=torch.tensor([live], dtype=torch.int32, device=device))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(padded[9], alone[9])
    assert n == t or not torch.equal(padded[9], full[9])  # the padding rows' window is another one
    for a, b in zip(_written(padded)[:4], _written(full)[:4], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_gdn_conv_gates_refuses_bad_inputs(device):
    args = _conv_gates_inputs(3, 4, 96, 8, torch.float32, device, "replay", True)
    window, mixed, conv_w, ba, a_neg, dt_bias, ring_idx, xs, rings, fw = args
    cases = [
        (dict(final_window=fw[:2]), r"final_window \(2, 96\) torch.float32 is not \[K-1=3, C=96\]"),
        (dict(final_window=fw.to(torch.bfloat16)), "final_window .* is not"),
        (dict(final_window=window), "final_window must not overlap window"),
        (dict(window=window[:2]), r"window \(2, 96\) torch.float32 is not \[K-1=3, C=96\]"),
        (dict(window=window.to(torch.bfloat16)), "window .* is not"),
        (dict(conv_w=conv_w[:, :3].contiguous().T), r"conv_w .* is not a contiguous float32 \[C=96, K\]"),
        (dict(ba=ba[:2]), r"ba \(2, 16\) is not \[t=3, 2\*Hv\]"),
        (dict(replay_rings=rings[:2]), r"replay_rings must be \(qkv_ring, g_ring, beta_ring\)"),
        (dict(ring_idx=None), "a record needs ring_idx"),
        (dict(replay_rings=(rings[0][:, :95], rings[1], rings[2])), "qkv_ring .* does not fit mixed"),
    ]
    base = dict(window=window, mixed=mixed, conv_w=conv_w, ba=ba, a_neg=a_neg, dt_bias=dt_bias, ring_idx=ring_idx,
                xs_ring=xs, replay_rings=rings, final_window=fw)
    for fn in (gdn_conv_gates, gdn_conv_gates_ref):
        for change, match in cases:
            with pytest.raises(ValueError, match=match):
                fn(**{**base, **change})
    # an adjacent, non-overlapping final window (one stacked buffer, as the state's) is fine
    buf = torch.zeros(2, 3, 96, device=device)
    gdn_conv_gates(buf[0], mixed, conv_w, ba, a_neg, dt_bias, final_window=buf[1])


def test_gdn_conv_gates_zero_rows(device):
    args = _conv_gates_inputs(1, 4, 96, 8, torch.float32, device, "none", True)
    window, mixed, conv_w, ba, a_neg, dt_bias, _, _, _, fw = args
    conv, g, beta = gdn_conv_gates(window, mixed[:0], conv_w, ba[:0], a_neg, dt_bias, final_window=fw)
    assert conv.shape == (0, 96) and g.shape == beta.shape == (0, 8)
    assert torch.equal(fw, window)  # no rows: the window after them is the window


def _norm_inputs(t, hv, dv, dtype, device, seed=0, pad=8):
    g = _gen(seed)
    core = (torch.randn(t, hv, dv, generator=g) * 0.2).to(device)
    z = (torch.randn(t, hv * dv + pad, generator=g) * 2).to(dtype).to(device)[:, pad:]
    w = (1 + 0.3 * torch.randn(dv, generator=g)).to(dtype).to(device)
    return core, z, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,hv,dv", [(1, 4, 32), (3, 2, 64), (16, 4, 128), (17, 32, 128), (3, 2, 256)])
def test_gated_rms_norm_matches_ref(t, hv, dv, dtype, device):
    core, z, w = _norm_inputs(t, hv, dv, dtype, device)
    got = gated_rms_norm(core, z, w, EPS)
    want = gated_rms_norm_ref(core, z, w, EPS)
    # the twin is the engine's formula (layers/deltanet.py) bit for bit
    engine = engine_gated_rms_norm(core.to(dtype), z.reshape(t, hv, dv), w, EPS).reshape(t, hv * dv)
    assert torch.equal(want, engine)
    _assert_matches(got, want)
    # planted bug: skipping the cast of core to the model dtype first (bf16) or the silu gate
    wrong = [gated_rms_norm_ref(core, torch.zeros_like(z), w, EPS) + 0 * z]
    if dtype != torch.float32:
        xf = core.float()
        out = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))
        wrong.append((out * F.silu(z.reshape(t, hv, dv).float())).to(dtype).reshape(t, hv * dv))
    for bad in wrong:
        with pytest.raises(AssertionError):
            _assert_matches(got, bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_rms_norm_rows_are_independent(dtype, device):
    core, z, w = _norm_inputs(16, 4, 64, dtype, device, seed=8)
    full = gated_rms_norm(core, z, w, EPS)
    other_core, other_z, _ = _norm_inputs(16, 4, 64, dtype, device, seed=9)
    for i in (0, 5, 15):
        assert torch.equal(gated_rms_norm(core[i:i + 1], z[i:i + 1], w, EPS)[0], full[i])
        c2, z2 = other_core.clone(), other_z.clone()
        c2[i], z2[i] = core[i], z[i]
        assert torch.equal(gated_rms_norm(c2, z2, w, EPS)[i], full[i])


def test_float16(device):
    """Every kernel in float16 too (one shape each; the same criteria, at half's ulp)."""
    dt = torch.float16
    args = _attn_inputs(5, 4, 2, 64, 16, dt, device, seed=11, pad=8)
    q, kv = _run_qk(gated_qk_norm_rope_kv_write, *args, 4, 2)
    q_ref, kv_ref = _run_qk(gated_qk_norm_rope_kv_write_ref, *args, 4, 2)
    _assert_matches(q, q_ref)
    _assert_matches(kv, kv_ref)
    out = torch.randn(5, 4 * 64, generator=_gen(12)).to(dt).to(device)
    _assert_matches(output_gate(out, args[0], 4), output_gate_ref(out, args[0], 4))
    _, ba, a_neg, dt_bias, _ = _gate_inputs(5, 8, dt, device, seed=13)
    (g, beta), (g_ref, beta_ref) = gdn_gates(ba, a_neg, dt_bias), gdn_gates_ref(ba, a_neg, dt_bias)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(beta, beta_ref, rtol=2**-10, atol=0)
    core, z, w = _norm_inputs(5, 4, 128, dt, device, seed=14)
    _assert_matches(gated_rms_norm(core, z, w, EPS), gated_rms_norm_ref(core, z, w, EPS))
    args = _conv_gates_inputs(5, 4, 300, 8, dt, device, "replay", True, seed=15)
    got_args, old_args = _fresh(args), _fresh(args)
    for a, b in zip((*gdn_conv_gates(*got_args), *_written(got_args)), (*_old_ops(old_args), *_written(old_args)),
                    strict=True):
        assert torch.equal(a, b)
