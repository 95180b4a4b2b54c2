"""RMSNorm kernels vs their torch twins, and row invariance."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402

EPS = 1e-6
# The kernel rounds where torch rounds (to the model dtype after normalizing, after the weight
# multiply, after the residual add), so the only difference is the float32 sum of squares
# (another reduction order): a float32 ulp or two of the statistic. In float32 that is ~1e-7
# relative; in bf16 it rarely flips a rounding, by one bf16 ulp (2^-7 relative at most) of the
# normalized value, which the weight multiply can turn into two.
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
# ...and in bf16 it may touch only a few elements: dropping a rounding step would touch many.
MAX_MISMATCH_FRACTION = 0.02
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(t: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 3 + 0.5).to(dtype).to(device)
    res = torch.randn(t, d, generator=g).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype).to(device)
    return x, res, w


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=0)
    if want.dtype != torch.float32:
        mismatched = (got != want).float().mean().item()
        assert mismatched <= MAX_MISMATCH_FRACTION, f"{mismatched:.1%} of elements differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d", [(1, 64), (3, 96), (16, 4096), (17, 1000)])
def test_rms_norm_matches_ref(t, d, dtype, device):
    x, _, w = _inputs(t, d, dtype, device)
    _assert_matches(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d", [(1, 64), (3, 96), (16, 4096), (17, 1000)])
def test_add_rms_norm_matches_ref(t, d, dtype, device):
    x, res, w = _inputs(t, d, dtype, device, seed=1)
    normed, new_res = add_rms_norm(x, res, w, EPS)
    want_normed, want_res = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(new_res, want_res)  # one add, rounded once, exactly as torch
    _assert_matches(normed, want_normed)


def test_strided_rows_and_f32_weight(device):
    """Rows of a wider buffer (a view) and a float32 weight on bf16 activations (promotes)."""
    wide, _, _ = _inputs(5, 256, torch.bfloat16, device, seed=2)
    x = wide[:, 64:192]
    w = (1 + 0.3 * torch.randn(128, generator=torch.Generator().manual_seed(3))).to(device)
    got = rms_norm(x, w, EPS)
    assert got.dtype == torch.float32
    _assert_matches(got, rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("variant", ["qwen3", "zero_centred"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_independent(variant, dtype, device):
    """A row's output is bit-identical alone or among 16 other rows with other contents (the
    Qwen3 norms and their zero-centred `(1 + w)` forms)."""
    from memra_kernels.norm import add_rms_norm_1p, rms_norm_1p

    make, add_norm, norm = ((_inputs, add_rms_norm, rms_norm) if variant == "qwen3"
                            else (_inputs_1p, add_rms_norm_1p, rms_norm_1p))
    x, res, w = make(16, 512, dtype, device, seed=4)
    other, other_res, _ = make(16, 512, dtype, device, seed=5)
    full, full_res = add_norm(x, res, w, EPS)
    for i in (0, 7, 15):
        alone, alone_res = add_norm(x[i:i + 1], res[i:i + 1], w, EPS)
        assert torch.equal(alone[0], full[i]) and torch.equal(alone_res[0], full_res[i])
        mixed_x, mixed_res = other.clone(), other_res.clone()
        mixed_x[i], mixed_res[i] = x[i], res[i]
        assert torch.equal(add_norm(mixed_x, mixed_res, w, EPS)[0][i], full[i])
        assert torch.equal(norm(mixed_x, w, EPS)[i], norm(x[i:i + 1], w, EPS)[0])


def test_empty_batch(device):
    x, res, w = _inputs(0, 64, torch.float32, device)
    assert rms_norm(x, w, EPS).shape == (0, 64)
    assert add_rms_norm(x, res, w, EPS)[1].shape == (0, 64)


# --------------------------------------------------------------------------- zero-centred (Qwen3.5)


def _inputs_1p(t: int, d: int, dtype: torch.dtype, device: str, seed: int = 0, pad: int = 0):
    """x as a column slice of a wider buffer when pad > 0 (strided rows); w1p float32 1 + w."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d + pad, generator=g) * 3 + 0.5).to(dtype).to(device)[:, pad:]
    res = torch.randn(t, d, generator=g).to(dtype).to(device)
    w1p = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype).float().to(device)  # 1 + w of a model-dtype w
    return x, res, w1p


# One rounding (after the float32 weight multiply) where the Qwen3 norm has two, so the bf16
# difference is at most one bf16 ulp of the output (2^-8..2^-7 relative), on a few elements.
RTOL_1P = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _assert_1p(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL_1P[want.dtype], atol=0)
    if want.dtype != torch.float32:
        mismatched = (got != want).float().mean().item()
        assert mismatched <= MAX_MISMATCH_FRACTION, f"{mismatched:.1%} of elements differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d,pad", [(1, 64, 0), (3, 96, 16), (16, 2560, 0), (17, 1000, 8)])
def test_rms_norm_1p_matches_ref(t, d, pad, dtype, device):
    from memra_cli.engine.layers.deltanet import rms_norm_1p as engine_rms_norm_1p
    from memra_kernels.norm import add_rms_norm_1p, add_rms_norm_1p_ref, rms_norm_1p, rms_norm_1p_ref

    x, res, w1p = _inputs_1p(t, d, dtype, device, pad=pad)
    want = rms_norm_1p_ref(x, w1p, EPS)
    assert torch.equal(want, engine_rms_norm_1p(x, w1p, EPS))  # the twin is the engine's formula
    _assert_1p(rms_norm_1p(x, w1p, EPS), want)
    normed, new_res = add_rms_norm_1p(x, res, w1p, EPS)
    want_normed, want_res = add_rms_norm_1p_ref(x, res, w1p, EPS)
    assert torch.equal(new_res, want_res) and torch.equal(want_res, x + res)
    _assert_1p(normed, want_normed)


def test_rms_norm_1p_catches_the_qwen3_order(device):
    """A planted bug: the Qwen3 kernel's order (round before the weight multiply) on the same
    inputs differs from the zero-centred twin in many bf16 elements, which the check rejects."""
    from memra_kernels.norm import rms_norm, rms_norm_1p_ref

    x, _, w1p = _inputs_1p(16, 2560, torch.bfloat16, device, seed=6)
    wrong = rms_norm(x, w1p, EPS).to(torch.bfloat16)  # float32 out (promoted), rounded again
    with pytest.raises(AssertionError):
        _assert_1p(wrong, rms_norm_1p_ref(x, w1p, EPS))


# --------------------------------------------------------------------------- embedding gather + norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_rms_norm_is_the_gather_then_the_norm(dtype, device):
    """One launch, the two launches' bits: the rows are the embedding's (a copy) and the normed
    rows are `rms_norm` of them, bit for bit (the same kernel body); against the torch twin the
    norm differs only in the sum of squares' order (RTOL above)."""
    from memra_kernels.gather import embed_rows
    from memra_kernels.norm import embed_rms_norm, embed_rms_norm_ref

    table, _, w = _inputs(50, 96, dtype, device, seed=6)
    ids = torch.tensor([49, 0, 7, 7, 12], device=device)
    normed, rows = embed_rms_norm(ids, table, w, EPS)
    assert torch.equal(rows, embed_rows(ids, table))
    assert torch.equal(normed, rms_norm(embed_rows(ids, table), w, EPS))
    want_normed, want_rows = embed_rms_norm_ref(ids, table, w, EPS)
    assert torch.equal(rows, want_rows)
    _assert_matches(normed, want_normed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_rms_norm_1p_is_the_gather_then_the_zero_centred_norm(dtype, device):
    """Qwen3.5's first norm in the gather's launch: the rows are the embedding's and the normed
    rows `rms_norm_1p` of them, bit for bit; the twin within RTOL_1P. Planted: the same launch with
    the Qwen3 norm's order (rounded before the weight multiply) fails the twin's check."""
    from memra_kernels.gather import embed_rows
    from memra_kernels.norm import embed_rms_norm, embed_rms_norm_1p, embed_rms_norm_1p_ref, rms_norm_1p

    g = torch.Generator().manual_seed(9)
    table = (torch.randn(64, 2560, generator=g) * 3 + 0.5).to(dtype).to(device)
    w1p = (1 + 0.3 * torch.randn(2560, generator=g)).to(dtype).float().to(device)  # 1 + w of a model-dtype w
    ids = torch.randint(0, 64, (16,), generator=g).to(device)
    normed, rows = embed_rms_norm_1p(ids, table, w1p, EPS)
    assert torch.equal(rows, embed_rows(ids, table)) and normed.dtype == dtype
    assert torch.equal(normed, rms_norm_1p(embed_rows(ids, table), w1p, EPS))
    want_normed, want_rows = embed_rms_norm_1p_ref(ids, table, w1p, EPS)
    assert torch.equal(rows, want_rows)
    _assert_1p(normed, want_normed)
    if dtype == torch.bfloat16:
        wrong = embed_rms_norm(ids, table, w1p, EPS)[0].to(dtype)  # float32 out (promoted), rounded again
        with pytest.raises(AssertionError):
            _assert_1p(wrong, want_normed)


def test_embed_rms_norm_rows_are_independent_and_a_planted_break_is_seen(device):
    """A row's bits alone == among 16 rows; and the check can fail: a row normed by another row's
    statistics (a planted break of row independence) does not pass it."""
    from memra_kernels.norm import embed_rms_norm

    table, _, w = _inputs(64, 128, torch.bfloat16, device, seed=7)
    ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(8)).to(device)
    full, full_rows = embed_rms_norm(ids, table, w, EPS)
    for i in (0, 9, 15):
        alone, alone_rows = embed_rms_norm(ids[i:i + 1], table, w, EPS)
        assert torch.equal(alone[0], full[i]) and torch.equal(alone_rows[0], full_rows[i])
    x = full_rows.float()
    shared = x * torch.rsqrt(x.pow(2).mean().clamp_min(EPS))  # one statistic for the whole step
    planted = (w * shared.to(torch.bfloat16))[3]
    assert not torch.equal(planted, full[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_rms_norm_takes_row_0s_id_from_first(dtype, device):
    """A drafter's block `[anchor, mask, ...]` from its constant mask ids and the anchor on the
    device: the launch with `first` is, bit for bit, the launch over the concatenated ids (and
    the twin's rows); the ids tensor is left as it was. Planted: `first` ignored (row 0 from
    ids[0]) is seen."""
    from memra_kernels.norm import embed_rms_norm, embed_rms_norm_ref, with_first

    table, _, w = _inputs(50, 96, dtype, device, seed=10)
    mask_ids = torch.full((6,), 41, device=device)
    first = torch.tensor([7], device=device)
    normed, rows = embed_rms_norm(mask_ids, table, w, EPS, first=first)
    block = torch.tensor([7, 41, 41, 41, 41, 41], device=device)
    want_normed, want_rows = embed_rms_norm(block, table, w, EPS)
    assert torch.equal(normed, want_normed) and torch.equal(rows, want_rows)
    assert torch.equal(with_first(mask_ids, first), block) and mask_ids[0].item() == 41
    ref_normed, ref_rows = embed_rms_norm_ref(mask_ids, table, w, EPS, first=first)
    assert torch.equal(rows, ref_rows)
    _assert_matches(normed, ref_normed)
    ignored = embed_rms_norm(mask_ids, table, w, EPS)[1]
    assert not torch.equal(ignored, rows)
    with pytest.raises(ValueError, match="first"):
        embed_rms_norm(mask_ids, table, w, EPS, first=torch.tensor([7.0], device=device))


def test_the_rows_output_may_be_a_column_slice(device):
    """`add_rms_norm(res_out=)` and `embed_rms_norm(rows_out=)` write their second output into a
    column slice of a wider buffer (a step's taps), the bits of their own tensors, the other
    columns untouched; a slice of the wrong shape is refused."""
    from memra_kernels.norm import add_rms_norm, embed_rms_norm

    x, res, w = _inputs(16, 64, torch.bfloat16, device, seed=11)
    buf = torch.full((16, 3 * 64), 7.0, dtype=torch.bfloat16, device=device)
    normed, new_res = add_rms_norm(x, res, w, EPS, res_out=buf[:, 64:128])
    want_normed, want_res = add_rms_norm(x, res, w, EPS)
    assert new_res.data_ptr() == buf[:, 64:128].data_ptr()
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], device=device)
    n2, rows = embed_rms_norm(ids, x, w, EPS, rows_out=buf[:, :64])
    assert torch.equal(rows, embed_rms_norm(ids, x, w, EPS)[1]) and torch.equal(buf[:, :64], rows)
    assert (buf[:, 128:] == 7.0).all()
    with pytest.raises(ValueError, match="rows' output"):
        add_rms_norm(x, res, w, EPS, res_out=buf[:, :65])


def test_embed_rms_norm_refuses_bad_arguments(device):
    from memra_kernels.norm import embed_rms_norm

    table, _, w = _inputs(8, 32, torch.float32, device)
    with pytest.raises(ValueError, match="ids"):
        embed_rms_norm(torch.zeros(2, 2, dtype=torch.long, device=device), table, w, EPS)
    with pytest.raises(ValueError, match="weight"):
        embed_rms_norm(torch.zeros(2, dtype=torch.long, device=device), table, w[:16], EPS)
