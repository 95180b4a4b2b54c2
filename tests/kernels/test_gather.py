"""Embedding rows and DSpark's confidence head, one program per row, against their torch twins."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.gather import (  # noqa: E402
    MAX_BLOCK, confidence_raw, confidence_raw_ref, embed_rows, embed_rows_ref, pack_round, pack_round_ref,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CONF_TOL = 1e-5  # relative: float32 dots summed in another order than torch's GEMV


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,V,H", [(1, 10, 64), (3, 50, 100), (16, 4096, 256), (17, 33, MAX_BLOCK + 3)])
def test_embed_rows_is_the_embedding_bit_for_bit(n, V, H, dtype, device):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(V, H, generator=g).to(dtype).to(device)
    ids = torch.randint(0, V, (n,), generator=g).to(device)
    ids[-1] = V - 1  # the last row of the table
    got = embed_rows(ids, w)
    assert got.dtype == dtype and torch.equal(got, embed_rows_ref(ids, w))


def test_embed_rows_reads_strided_tables_and_int32_ids_and_writes_out(device):
    base = torch.randn(20, 80, device=device)
    w = base[:, :64]  # row stride 80
    ids = torch.tensor([19, 0, 7, 7], dtype=torch.int32, device=device)
    out = torch.full((4, 64), float("nan"), device=device)
    assert embed_rows(ids, w, out=out) is out
    assert torch.equal(out, embed_rows_ref(ids.long(), w))
    one = embed_rows(ids[2:3], w)
    assert torch.equal(one[0], out[2])  # a row alone == the same row in a batch


def test_embed_rows_refuses_bad_arguments(device):
    w = torch.randn(5, 8, device=device)
    with pytest.raises(ValueError, match="ids must be"):
        embed_rows(torch.zeros(2, 2, dtype=torch.long, device=device), w)
    with pytest.raises(ValueError, match="weight must be"):
        embed_rows(torch.zeros(2, dtype=torch.long, device=device), w.t())
    with pytest.raises(ValueError, match="out must be"):
        embed_rows(torch.zeros(2, dtype=torch.long, device=device), w, out=torch.empty(2, 9, device=device))


def _head(n, H, V, r, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(dtype).to(device)
    w1 = torch.randn(V, r, generator=g).to(dtype).to(device)
    w = torch.randn(H + r, generator=g).to(device)
    b = torch.randn(1, generator=g).to(device)
    prev = torch.randint(0, V, (n,), generator=g).to(device)
    return hidden, w, b, prev, w1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,H,V,r", [(1, 64, 10, 8), (15, 256, 4096, 64), (17, 100, 30, 3), (2, MAX_BLOCK + 9, 12, 40)])
@pytest.mark.parametrize("markov", [True, False], ids=["markov", "hidden-only"])
def test_confidence_raw_matches_the_torch_head(n, H, V, r, dtype, markov, device):
    hidden, w, b, prev, w1 = _head(n, H, V, r, dtype, device)
    if not markov:
        w, prev, w1 = w[:H].contiguous(), None, None
    got = confidence_raw(hidden, w, b, prev, w1)
    ref = confidence_raw_ref(hidden, w, b, prev, w1)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.allclose(got, ref, rtol=CONF_TOL, atol=CONF_TOL * (H + r) ** 0.5)


def test_confidence_raw_uses_each_rows_own_previous_token(device):
    """Only the markov features differ between rows (same hidden): each score follows its own
    prev id, so a kernel that read one row's prev for all (or skipped the markov part) fails."""
    hidden, w, b, prev, w1 = _head(4, 32, 6, 8, torch.float32, device, seed=3)
    hidden = hidden[:1].expand(4, -1).contiguous()
    prev = torch.tensor([0, 5, 2, 5], device=device)
    got = confidence_raw(hidden, w, b, prev, w1)
    assert torch.allclose(got, confidence_raw_ref(hidden, w, b, prev, w1), rtol=CONF_TOL, atol=1e-4)
    assert abs(got[1] - got[3]) < 1e-5 and abs(got[0] - got[1]) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_confidence_raw_norms_a_pending_norm_as_it_loads_it(dtype, device):
    """A drafter's final norm left to its heads: the scores of a `PendingNorm` equal, bit for bit,
    the scores of its rows normed by `norm.rms_norm_partials` (the same statistic, the same
    roundings), over column blocks wider than MAX_BLOCK too. Planted: the norm's weight left out."""
    from memra_kernels.dense_linear import PendingNorm
    from memra_kernels.norm import rms_norm_partials
    from memra_kernels.norm_ref import tree_sumsq_ref

    for H in (96, MAX_BLOCK + 40):
        rows, w, b, prev, w1 = _head(15, H, 50, 8, dtype, device, seed=4)
        rows = rows * 3
        tiles = [rows[:, j:j + 32] for j in range(0, H, 32)]  # a producer's 32-wide n tiles
        sumsq = torch.stack([tree_sumsq_ref(t) for t in tiles], dim=1).contiguous()
        nw = (1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(5))).to(dtype).to(device)
        pending = PendingNorm(rows, sumsq, nw, 1e-6)
        got = confidence_raw(pending, w, b, prev, w1)
        want = confidence_raw(rms_norm_partials(rows, sumsq, nw, 1e-6), w, b, prev, w1)
        assert torch.equal(got, want)
        unweighted = confidence_raw(rms_norm_partials(rows, sumsq, torch.ones_like(nw), 1e-6), w, b, prev, w1)
        assert not torch.equal(got, unweighted)


def test_confidence_raw_refuses_bad_arguments(device):
    hidden, w, b, prev, w1 = _head(3, 16, 5, 4, torch.float32, device)
    with pytest.raises(ValueError, match="come together"):
        confidence_raw(hidden, w, b, prev, None)
    with pytest.raises(ValueError, match="w must be"):
        confidence_raw(hidden, w[:16].contiguous(), b, prev, w1)
    with pytest.raises(ValueError, match="b must be"):
        confidence_raw(hidden, w, b.double(), prev, w1)


@pytest.mark.parametrize("w,n", [(16, 15), (16, None), (1, None), (17, 3), (4, 40)])
def test_pack_round_is_the_float64_concatenation(w, n, device):
    """Ids up to 2^53 and float32 scores are exact in float64: the packed vector equals torch's
    `.double()` of each part, concatenated, element for element (raws longer than the ids too)."""
    g = torch.Generator().manual_seed(w)
    cand = torch.randint(0, 2**40, (w,), generator=g).to(device)
    cand[0] = 2**53 - 1
    sel = torch.randint(0, 151936, (w,), generator=g).to(device)
    raws = None if n is None else (torch.randn(n, generator=g) * 1e3).to(device)
    got = pack_round(cand, sel, raws)
    assert got.dtype == torch.float64 and torch.equal(got, pack_round_ref(cand, sel, raws))
    assert int(got[0].item()) == 2**53 - 1


def test_pack_round_refuses_bad_parts(device):
    ids = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="sel must be"):
        pack_round(ids, ids.int())
    with pytest.raises(ValueError, match="raws must be"):
        pack_round(ids, ids, torch.zeros(3, dtype=torch.float64, device=device))
