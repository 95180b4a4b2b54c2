"""The per-row argmax kernel against its twin, torch.argmax(x, dim=-1), index for index:
first index among ties, NaN as the maximum, -inf rows, awkward and huge vocabularies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.argmax import MAX_BLOCK, SPLIT_FROM, plan, row_argmax, row_argmax_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF, NAN = float("inf"), float("nan")


def _logits(rows, V, dtype, device, seed=0, levels=None):
    """Normal logits, or (levels) small integers: in a row of thousands, the maximum then sits
    at many columns and only the first-index rule gives torch's answer."""
    g = torch.Generator().manual_seed(seed)
    if levels is None:
        x = torch.randn(rows, V, generator=g) * 4
    else:
        x = torch.randint(-levels, levels, (rows, V), generator=g).float()
    return x.to(dtype).to(device)


def _last_of_ties(x):
    """The wrong rule (the last index among equal maxima), to show the tie tests can fail."""
    return x.shape[-1] - 1 - torch.argmax(x.flip(-1), dim=-1)


def _check(x):
    got = row_argmax(x)
    assert got.dtype == torch.long and got.shape == (x.shape[0],)
    assert got.tolist() == row_argmax_ref(x).tolist()
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,V", [(1, 1), (1, 7), (3, 4097), (16, 4096), (17, 300),
                                    (2, MAX_BLOCK * 2 + 3)])
def test_matches_ref(rows, V, dtype, device):
    _check(_logits(rows, V, dtype, device, seed=rows + V))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,V", [(3, 4097), (16, 4096), (5, MAX_BLOCK * 3 + 1)])
def test_many_ties_take_the_first_index(rows, V, dtype, device):
    """Small integer logits: each row's maximum at dozens of columns, across lanes and tiles."""
    x = _logits(rows, V, dtype, device, seed=7, levels=6)
    got = _check(x)
    assert (got != _last_of_ties(x)).all()  # the last-index rule fails this test on every row


def test_planted_ties(device):
    """Equal maxima planted within one tile, across tiles and at the row's ends."""
    V = MAX_BLOCK * 2 + 5
    x = torch.zeros(4, V, device=device)
    x[0, [MAX_BLOCK + 9, 17, MAX_BLOCK * 2 + 4]] = 3.0  # first is in the first tile, not lane 0
    x[1, [V - 1, MAX_BLOCK * 2, MAX_BLOCK + 3]] = 1.5  # first is in the second tile
    x[2, [0, 1, V - 1]] = 2.0  # column 0
    x[3, 5] = INF  # +inf ties the same way
    x[3, [MAX_BLOCK + 5, V - 2]] = INF
    expect = [17, MAX_BLOCK + 3, 0, 5]
    assert _check(x).tolist() == expect
    assert _last_of_ties(x).tolist() != expect


def test_signed_zeros_are_equal(device):
    """-0.0 == +0.0: the first of them, whichever sign it carries."""
    x = torch.full((2, 300), -1.0, device=device)
    x[0, [3, 200]] = torch.tensor([-0.0, 0.0], device=device)
    x[1, [3, 200]] = torch.tensor([0.0, -0.0], device=device)
    assert _check(x).tolist() == [3, 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_is_the_maximum(dtype, device):
    """torch.argmax returns the first NaN's index when a row has one (above +inf too)."""
    V = MAX_BLOCK + 70
    x = _logits(6, V, dtype, device, seed=3).cpu()
    x[0, [50, 9]] = NAN  # first NaN at 9
    x[1, 0] = INF
    x[1, [MAX_BLOCK + 1, V - 1]] = NAN  # NaN in the second tile beats +inf in the first
    x[2, V - 1] = NAN  # the last column
    x[3] = NAN  # all NaN: column 0
    x[4, 0] = NAN  # column 0 among later NaNs
    x[4, [30, MAX_BLOCK + 30]] = NAN
    x[5, [MAX_BLOCK + 30, 30 + 1]] = NAN  # lane 31 of the first tile before lane 30 of the second
    assert _check(x.to(device)).tolist() == [9, MAX_BLOCK + 1, V - 1, 0, 0, 31]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_infinite_rows(dtype, device):
    """A row of -inf gives 0 (all tie at the maximum); one finite value among -inf wins."""
    V = MAX_BLOCK + 33
    x = torch.full((4, V), -INF, dtype=dtype, device=device)
    x[1, MAX_BLOCK + 2] = -1e4
    x[2, [V - 1, 4]] = INF
    x[3, 1:] = 0.0  # -inf only at column 0
    assert _check(x).tolist() == [0, MAX_BLOCK + 2, 4, 1]


@pytest.mark.parametrize("dtype,V", [(torch.float32, 248320), (torch.bfloat16, 151936)], ids=str)
def test_huge_vocab(dtype, V, device):
    """Qwen-sized rows (dozens of tiles): a planted maximum near the end and a tie after it."""
    x = _logits(2, V, dtype, device, seed=11)
    x[0, [V - 7, V - 2]] = 100.0
    x[1, 123] = 100.0
    assert _check(x).tolist() == [V - 7, 123]


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_split_rows_first_max_and_nan_across_chunks(rows, device):
    """Rows cut into chunks (the plan depends on the row count): equal maxima and NaNs planted in
    several chunks, and signed zeros at the top of a row, give the first column every time."""
    V = 151936
    block, chunk, n = plan(rows, V)
    assert n > 1 and chunk % block == 0 and (n - 1) * chunk < V <= n * chunk
    x = -torch.rand(rows, V, generator=torch.Generator().manual_seed(rows))  # all below 0
    c = lambda i, off: min(i * chunk + off, V - 1)  # column `off` into chunk i
    cases = []
    for r in range(rows):
        kind = r % 4
        if kind == 0:  # the same maximum in a later and an earlier chunk (written later first)
            x[r, c(n - 1, 5)] = 7.0
            x[r, c(1, chunk - 1)] = 7.0
            cases.append(c(1, chunk - 1))
        elif kind == 1:  # NaNs in two chunks beat +inf in the first
            x[r, 3] = INF
            x[r, c(n - 2, 0)] = NAN
            x[r, c(n - 1, 2)] = NAN
            cases.append(c(n - 2, 0))
        elif kind == 2:  # -0.0 in an early chunk ties +0.0 in a later one: the first wins
            x[r, c(n - 1, 1)] = 0.0
            x[r, c(0, chunk - 2)] = -0.0
            cases.append(c(0, chunk - 2))
        else:  # the row's last column
            x[r, V - 1] = 1.0
            cases.append(V - 1)
    x = x.to(device)
    assert _check(x).tolist() == cases


# quick: the split's edges; Qwen3's vocabulary in the exhaustive tier
@pytest.mark.parametrize("V", [SPLIT_FROM, SPLIT_FROM + 1, pytest.param(151936, marks=pytest.mark.exhaustive)])
def test_split_index_is_the_same_for_any_row_count(V, device):
    """A row's index alone, among 16 or among 17 rows (three different cuts of the row)."""
    x = _logits(17, V, torch.bfloat16, device, seed=V, levels=3)  # many ties in every row
    full = row_argmax(x)
    assert full.tolist() == row_argmax_ref(x).tolist()
    assert torch.equal(row_argmax(x[:16]), full[:16])
    for i in (0, 9, 16):
        assert torch.equal(row_argmax(x[i:i + 1])[0], full[i])


def test_strided_rows_and_out(device):
    """Rows of a wider buffer, every other row of a batch, and `out=` into a strided view."""
    wide = _logits(6, 1100, torch.bfloat16, device, seed=5, levels=8)
    x = wide[:, 37:37 + 1001]  # row stride 1100, not 1001
    assert not x.is_contiguous()
    _check(x)
    _check(wide[::2])  # row stride 2200
    buf = torch.full((12,), -5, dtype=torch.long, device=device)
    got = row_argmax(x, out=buf[::2])
    assert got.data_ptr() == buf.data_ptr()
    assert buf[::2].tolist() == row_argmax_ref(x).tolist() and (buf[1::2] == -5).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_are_independent(dtype, device):
    """A row's index is the same alone, in a batch of 16 or 17, or among other rows."""
    V = 4097
    x = _logits(17, V, dtype, device, seed=9, levels=5)
    other = _logits(17, V, dtype, device, seed=10)
    full = row_argmax(x)
    assert torch.equal(row_argmax(x[:16]), full[:16])
    for i in (0, 5, 16):
        assert torch.equal(row_argmax(x[i:i + 1])[0], full[i])
        mixed = other.clone()
        mixed[i] = x[i]
        assert torch.equal(row_argmax(mixed)[i], full[i])


def test_refuses_bad_inputs(device):
    x = _logits(2, 50, torch.float32, device)
    with pytest.raises(ValueError, match=r"x must be \[rows, V\]"):
        row_argmax(x[0])
    with pytest.raises(ValueError, match="empty row"):
        row_argmax(x[:, :0])
    with pytest.raises(TypeError, match="not supported"):
        row_argmax(x.double())
    with pytest.raises(ValueError, match="last axis must be contiguous"):
        row_argmax(x.t())
    with pytest.raises(ValueError, match="out must be int64"):
        row_argmax(x, out=torch.empty(2, dtype=torch.int32, device=device))
    assert row_argmax(x[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_writes_out():
    """Captured once into a graph-owned `out`, replayed over new logits written in place."""
    x = _logits(16, 4096, torch.float32, "cuda", seed=1)
    out = torch.empty(16, dtype=torch.long, device="cuda")
    row_argmax(x, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_argmax(x, out=out)
    for seed in (2, 3):
        x.copy_(_logits(16, 4096, torch.float32, "cuda", seed=seed, levels=4 if seed == 3 else None))
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == row_argmax_ref(x).tolist()
