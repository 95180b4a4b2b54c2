"""Split-K causal GQA attention vs its torch twin, and its bit-invariance.

The invariance tests are the point: a row's output must not change (torch.equal) with the rows
beside it, their positions or queries, the cache storage size, or the row chunking.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, replace

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels import attention  # noqa: E402
from memra_kernels.attention import (  # noqa: E402
    TILES, Tile, decode_attention, decode_attention_ref, tile_for)

# float32: scores, softmax and accumulation are float32 in both; only summation orders (and the
# GPU's exp2 approximation) differ: a few float32 ulps of outputs of magnitude ~1.
# bf16: the kernel rounds the probabilities to bf16 for the P.V dot (as flash attention; the
# reference keeps them float32), ~2^-9 relative per term, and both round the output to bf16
# (2^-8 relative): a couple of bf16 ulps of values of magnitude <= ~3.
TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2**-6, atol=2**-6)}
DTYPES = [torch.float32, torch.bfloat16]
S = 1100  # storage positions (live lengths up to 1000 span several splits)


def _q(t, nh, hd, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, nh, hd, generator=g).to(dtype).to(device)


def _cache(nkv, hd, live, dtype, device, storage=S, seed=100):
    """K/V `[nkv, storage, hd]`: random live keys 0..live-1 (the same for any storage: drawn at
    `live` then copied), NaN beyond. Keys have a non-zero mean so softmaxes are peaked."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((nkv, storage, hd), float("nan"), dtype=dtype)
    v = torch.full((nkv, storage, hd), float("nan"), dtype=dtype)
    k[:, :live] = (torch.randn(nkv, live, hd, generator=g) + 0.2).to(dtype)
    v[:, :live] = torch.randn(nkv, live, hd, generator=g).to(dtype)
    return k.to(device), v.to(device)


def _scale(hd):
    return hd ** -0.5


CASES = [  # t, n_heads, n_kv, head_dim, positions (odd live lengths 1, 37, 300, 1000, ...)
    (1, 4, 1, 128, [999]),
    (3, 2, 2, 64, [0, 36, 299]),
    (16, 8, 2, 64, [0, 36, 299, 999, 511, 512, 513, 1, 2, 100, 700, 255, 256, 998, 31, 32]),
    (17, 8, 2, 128, list(range(980, 997))),  # a verify step: consecutive positions
    # Qwen3.5's gated attention (16 q / 4 kv heads of 256, its own tile): positions across
    # multiples of 256 (split boundaries of any power-of-two split up to 256) and odd lengths.
    (1, 16, 4, 256, [558]),
    pytest.param(16, 16, 4, 256, [0, 36, 127, 128, 129, 255, 256, 257, 299, 383, 384, 511, 512, 513, 558, 1],
                 marks=pytest.mark.exhaustive),  # quick: the 256 tile's one-row and verify-step cases
    (17, 16, 4, 256, list(range(500, 517))),  # a verify step across key 512
    (3, 4, 2, 80, [0, 299, 999]),  # a head narrower than its tile: the padded columns masked
]
CASE_IDS = [f"t{v[0]}-nh{v[1]}-kv{v[2]}-hd{v[3]}" for v in (getattr(c, "values", c) for c in CASES)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,positions", CASES, ids=CASE_IDS)
def test_matches_ref(t, nh, nkv, hd, positions, dtype, device):
    q = _q(t, nh, hd, dtype, device, seed=t)
    k, v = _cache(nkv, hd, max(positions) + 1, dtype, device)
    pos = torch.tensor(positions, device=device)
    got = decode_attention(q, k, v, pos, _scale(hd))
    assert got.shape == (t, nh * hd) and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])


def test_prefill_chunk_matches_ref(device):
    """A prefill chunk: 24 rows at consecutive positions 500..523 (crossing a split), g = 2."""
    dtype = torch.bfloat16
    q = _q(24, 4, 64, dtype, device, seed=7)
    k, v = _cache(2, 64, 524, dtype, device, storage=600)
    pos = torch.arange(500, 524, device=device)
    got = decode_attention(q, k, v, pos, _scale(64))
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(64)), **TOL[dtype])


# ---------------------------------------------------------------- bit-invariance

# The interpreter runs both dtypes through the same float32 numpy arithmetic: bf16 alone there
# (it also exercises the probabilities' rounding); both on CUDA, where the code paths differ.
INV_DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.bfloat16]


LIVE = 600  # live keys in the invariance tests: 3 splits of 256 (5 of 128), short for the interpreter
# Qwen3.5's attention shape (nkv, g, hd), run by the invariance tests beside the 128 tile's: its
# own tile. 16 heads of 256 cost the interpreter a few times more, so (c) leaves it out: (a)
# already puts other rows' queries and positions beside a row. The quick tier's invariance check of
# the 256 tile is the windowed one (test_window_row_alone_equals_row_in_step[hd256]), a few times
# cheaper; (a) and (b) at 256 run in the exhaustive tier.
HD256 = (4, 4, 256)
HD256_EXHAUSTIVE = pytest.param(*HD256, marks=pytest.mark.exhaustive, id="4-4-256")


def _step(seed, device, t=16, max_pos=LIVE - 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max_pos + 1, (t,), generator=g).to(device)


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
@pytest.mark.parametrize("nkv,g,hd", [(2, 4, 64), (2, 1, 128), HD256_EXHAUSTIVE])
def test_row_alone_equals_row_in_step(nkv, g, hd, dtype, device):
    """(a) Row i alone == row i inside 16 (and 17) rows at other random positions."""
    nh = g * nkv
    split = tile_for(hd).split
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    targets = (0, 36, split - 1, split, LIVE - 1)  # split boundaries included
    for t, slots, seed in ((16, (13, 2, 7, 0, 15), 1), (17, (16, 3, 9, 15, 1), 2)):
        # (slot 16 of 17 rows lands in an M tile of its own when g = 4 and BLOCK_M is 64 or 16)
        q = _q(t, nh, hd, dtype, device, seed=seed)
        pos = _step(seed, device, t=t)
        for slot, p in zip(slots, targets):
            pos[slot] = p
        batch = decode_attention(q, k, v, pos, _scale(hd))
        for slot in slots:
            alone = decode_attention(q[slot:slot + 1], k, v, pos[slot:slot + 1], _scale(hd))
            assert torch.equal(alone[0], batch[slot]), (t, slot, int(pos[slot]))


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
@pytest.mark.parametrize("nkv,g,hd", [(2, 4, 64), HD256_EXHAUSTIVE])
def test_storage_size_does_not_matter(nkv, g, hd, dtype, device):
    """(b) Same live keys in storages of LIVE and 2085 positions, NaN past the live keys:
    identical outputs, and no NaN leaks in."""
    q = _q(16, nkv * g, hd, dtype, device, seed=3)
    pos = _step(3, device)
    pos[0] = LIVE - 1
    outs = []
    for storage in (LIVE, 2085):
        k, v = _cache(nkv, hd, LIVE, dtype, device, storage=storage)
        outs.append(decode_attention(q, k, v, pos, _scale(hd)))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    # A view that bounds the grid (kv[:, :n]) is just another storage size.
    k, v = _cache(nkv, hd, LIVE, dtype, device, storage=2085)
    assert torch.equal(decode_attention(q, k[:, :LIVE], v[:, :LIVE], pos, _scale(hd)), outs[0])


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_other_rows_queries_do_not_matter(dtype, device):
    """(c) Same positions, other rows' queries replaced (by huge values, too): row i unchanged."""
    nkv, g, hd = 2, 4, 64
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    q = _q(16, nkv * g, hd, dtype, device, seed=4)
    pos = _step(4, device)
    base = decode_attention(q, k, v, pos, _scale(hd))
    other = _q(16, nkv * g, hd, dtype, device, seed=5) * 30
    for i in (5, 15):
        mixed = other.clone()
        mixed[i] = q[i]
        assert torch.equal(decode_attention(mixed, k, v, pos, _scale(hd))[i], base[i])


@pytest.mark.parametrize("nkv,g,hd", [(2, 4, 64), HD256_EXHAUSTIVE])
def test_row_chunking_does_not_matter(nkv, g, hd, device):
    """Large batches run in row chunks (bounded workspace): chunking changes nothing."""
    dtype = torch.bfloat16
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    q = _q(9, nkv * g, hd, dtype, device, seed=6)
    pos = _step(6, device, t=9)
    kw = asdict(tile_for(hd))
    one = attention._launch(q, k, v, pos, _scale(hd), **kw)
    per_row = nkv * g * (S // kw["split"] + 1) * (hd + 2) * 4  # >= the workspace of one row
    chunked = attention._launch(q, k, v, pos, _scale(hd), workspace_bytes=4 * per_row, **kw)
    assert torch.equal(one, chunked)


# ---------------------------------------------------------------- long splits

# A small tile the interpreter runs quickly: splits of 32 keys, doubled for rows at positions
# >= 200 (64 keys) and again >= 400 (128 keys, the cap).
SMALL = dict(split=32, block_n=16, block_m=16, num_stages=1, num_warps=4)
LONG = dict(SMALL, long_split=128, long_from=200)
# In an order that puts rows of different split sizes in every M tile (4 rows of g = 4 a tile),
# so programs walk keys past some rows' splits: those keys must stay masked for them.
LONG_POS = [447, 150, 31, 300, 0, 401, 255, 198, 128, 399, 32, 384, 200, 127, 400, 256, 201, 383, 199]


def _own_split(p: int) -> int:
    return 32 if p < 200 else 64 if p < 400 else 128


def _long_step(dtype, device, seed):
    """q for LONG_POS's rows (2 KV heads, g = 4, head_dim 64) and their positions."""
    return _q(len(LONG_POS), 8, 64, dtype, device, seed=seed), torch.tensor(LONG_POS, device=device)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16],
                         ids=str)  # quick: bf16, whose rounding shows a changed order first
def test_long_split_matches_ref(dtype, device):
    """Rows at every split size in one step: the reference's result, usual tolerance."""
    nkv, hd = 2, 64
    k, v = _cache(nkv, hd, 448, dtype, device, storage=460)
    q, pos = _long_step(dtype, device, seed=21)
    got = attention._launch(q, k, v, pos, _scale(hd), **LONG)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])


@pytest.mark.exhaustive  # the long split's path is quick in test_long_split_matches_ref / _row_alone_equals_row_in_step
@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_long_split_rows_run_their_own_split(dtype, device):
    """The definition, bit for bit: each row gets what a one-size launch with its own split
    (32, 64 or 128 keys by its position) gives it, whatever the storage and whatever shares
    the step. Fails if a row sees keys past its split or if the combine reads a row's partials
    at the wrong units. (A program that also stored a row whose split starts elsewhere would
    only waste work: the combine never reads that unit, and no value shows it.)"""
    nkv, hd = 2, 64
    q, pos = _long_step(dtype, device, seed=22)
    own = torch.tensor([_own_split(p) for p in LONG_POS], device=device)
    for storage in (448, 700):
        k, v = _cache(nkv, hd, 448, dtype, device, storage=storage)
        got = attention._launch(q, k, v, pos, _scale(hd), **LONG)
        for split in (32, 64, 128):
            want = attention._launch(q, k, v, pos, _scale(hd), **dict(SMALL, split=split))
            assert torch.equal(got[own == split], want[own == split]), (storage, split)


@pytest.mark.exhaustive  # quick: long splits against the twin; their invariance on the GPU tier's compiled kernels
@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_long_split_row_alone_equals_row_in_step(dtype, device):
    """Rows on either side of long_from: alone == inside a step of rows on both sides."""
    nkv, hd = 2, 64
    k, v = _cache(nkv, hd, 448, dtype, device, storage=520)
    q, pos = _long_step(dtype, device, seed=23)
    batch = attention._launch(q, k, v, pos, _scale(hd), **LONG)
    for i in (0, 1, 2, 3, 7, 12, 14, 18):
        alone = attention._launch(q[i:i + 1], k, v, pos[i:i + 1], _scale(hd), **LONG)
        assert torch.equal(alone[0], batch[i]), int(pos[i])


def test_long_split_tiles_are_checked():
    with pytest.raises(ValueError):
        Tile(**dict(LONG, long_split=80))  # not a multiple of split
    with pytest.raises(ValueError):
        Tile(**dict(LONG, long_split=96))  # not split times a power of two
    with pytest.raises(ValueError):
        Tile(**dict(LONG, long_split=32))  # not above split
    with pytest.raises(ValueError):
        Tile(**dict(LONG, long_from=0))
    with pytest.raises(ValueError):
        Tile(**dict(SMALL, long_from=200))  # long_from without long_split
    assert Tile(**LONG).long_split == 128


# ---------------------------------------------------------------- the tile table


def test_tile_depends_on_head_dim_only():
    """tile_for takes the head size and nothing else (no t, no S can reach a row's tile), maps
    each size to its class's entry, and refuses what the register tile cannot hold."""
    assert list(inspect.signature(tile_for).parameters) == ["head_dim"]
    for hd in (1, 16, 64, 100, 128):
        assert tile_for(hd) is TILES[128]
    for hd in (129, 192, 255, 256):
        assert tile_for(hd) is TILES[256]
    for hd in (257, 384, 512):
        assert tile_for(hd) is TILES[512]
    for hd in (0, 513, 1024):
        with pytest.raises(ValueError):
            tile_for(hd)
    # The entries are runnable tiles (Tile checks tl.dot's >= 16 and the powers of two).
    for tile in TILES.values():
        assert Tile(**asdict(tile)) == tile
    with pytest.raises(ValueError):
        Tile(split=128, block_n=32, block_m=8, num_stages=3, num_warps=4)  # M < 16: tl.dot refuses
    with pytest.raises(ValueError):
        Tile(split=96, block_n=64, block_m=16, num_stages=3, num_warps=4)  # block_n not dividing split


def test_decode_attention_launches_the_head_dims_tile(monkeypatch, device):
    """decode_attention launches tile_for(hd): the 256 entry for hd 256 whatever t (a spy on
    _launch), the 128 entry for hd 128; and a replaced 256 entry (as a benchmark sets it) is the
    one that runs: still matching the reference, with other last bits at another split."""
    seen = []
    real = attention._launch

    def spy(*args, **kw):
        seen.append({k: kw[k] for k in asdict(TILES[128])})
        return real(*args, **kw)

    monkeypatch.setattr(attention, "_launch", spy)
    dtype = torch.float32
    nkv, g, hd = HD256
    k, v = _cache(nkv, hd, 560, dtype, device, storage=600)
    q = _q(5, nkv * g, hd, dtype, device, seed=11)  # 20 folded pairs: two M tiles of 16
    pos = torch.tensor([559, 300, 7, 558, 512], device=device)
    base = decode_attention(q, k, v, pos, _scale(hd))
    decode_attention(q[:1], k, v, pos[:1], _scale(hd))
    assert seen == [asdict(TILES[256])] * 2
    k128, v128 = _cache(2, 128, 40, dtype, device, storage=40)
    decode_attention(_q(1, 2, 128, dtype, device, seed=12), k128, v128, torch.tensor([39], device=device),
                     _scale(128))
    assert seen[-1] == asdict(TILES[128])

    other = replace(TILES[256], split=64 if TILES[256].split != 64 else 128)
    monkeypatch.setitem(attention.TILES, 256, other)
    got = decode_attention(q, k, v, pos, _scale(hd))
    assert seen[-1] == asdict(other)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])
    assert not torch.equal(got, base)  # another split: another summation order, other last bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nkv,g,hd", [(8, 4, 128), HD256])
def test_cuda_graph_replay_follows_positions(nkv, g, hd):
    """Captured once, replayed with new positions written in place: equals eager."""
    dtype = torch.bfloat16
    k, v = _cache(nkv, hd, 1000, dtype, "cuda", storage=4096)
    q = _q(16, nkv * g, hd, dtype, "cuda", seed=8)
    pos = torch.arange(16, device="cuda")
    decode_attention(q, k, v, pos, _scale(hd))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, pos, _scale(hd))
    for start in (0, 500, 984):
        pos.copy_(torch.arange(start, start + 16, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode_attention(q, k, v, pos, _scale(hd)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_stages_change_no_bit(dtype):
    """Pipeline stages only move loads (FLOAT32_MAX_STAGES relies on it): the 512 tile at one
    and two stages, and the 128 tile at one and three, give the same bits on the compiled kernel."""
    for nkv, g, hd in ((1, 4, 512), (2, 4, 128)):
        k, v = _cache(nkv, hd, 1000, dtype, "cuda", storage=1100)
        q = _q(16, nkv * g, hd, dtype, "cuda", seed=39)
        pos = torch.arange(984, 1000, device="cuda")
        tile = asdict(tile_for(hd))
        outs = [attention._launch(q, k, v, pos, 1.0, **dict(tile, num_stages=n)) for n in (1, 2 if hd == 512 else 3)]
        assert torch.equal(outs[0], outs[1]), hd


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd", [(1, 4, 2, 64), (3, 16, 4, 256), (17, 8, 2, 128)], ids=str)
def test_gated_attention_is_attention_then_the_output_gate(t, nh, nkv, hd, dtype, device):
    """Qwen3.5's output gate applied in the combine launch == `qwen35.output_gate` of
    `decode_attention`, bit for bit (the same formulas on the same rounded values), the gate read
    in place from a fused projection whose rows are wider than the gates (`[q | gate]` per head,
    then k and v)."""
    from memra_kernels.attention import gated_decode_attention
    from memra_kernels.qwen35 import output_gate

    positions = torch.tensor([(37 * i + 5) % 300 + 250 for i in range(t)], device=device)
    q = _q(t, nh, hd, dtype, device, seed=t + hd)
    k, v = _cache(nkv, hd, int(positions.max()) + 1, dtype, device, storage=600)
    g = torch.Generator().manual_seed(9)
    qgkv = (3 * torch.randn(t, (2 * nh + 2 * nkv) * hd, generator=g)).to(dtype).to(device)
    got = gated_decode_attention(q, k, v, positions, _scale(hd), qgkv)
    want = output_gate(decode_attention(q, k, v, positions, _scale(hd)), qgkv, nh)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="qgkv must be"):
        gated_decode_attention(q, k, v, positions, _scale(hd), qgkv[:, : nh * hd])


# ---------------------------------------------------------------- sliding windows (Gemma 4)

# Gemma 4's attention shapes, cut down for the interpreter: sliding layers (head_dim 256, g = 2)
# and full layers (head_dim 512, g = 4 here), scaling 1.0. WIN is not a multiple of any split or
# block, so window starts fall inside blocks and splits; rows near 0 have windows cut at key 0.
WIN = 150
GEMMA_SHAPES = {"hd256": (2, 2, 256), "hd512": (1, 4, 512)}
# positions on both sides of every edge: the window reaching key 0 (<= WIN - 1), window starts on
# a split boundary (WIN + 127 -> key 128) and one key past it, splits' ends (255, 256, 383)
WIN_POS = [0, 1, WIN - 2, WIN - 1, WIN, WIN + 1, WIN + 127, WIN + 128, 255, 256, 299, 383, 384, 420, 449, 7]
# the twin comparison's rows (the interpreter's time goes by rows): one on each side of each edge
WIN_POS_SHORT = [1, WIN - 1, WIN, WIN + 127, WIN + 128, 383, 384, 449]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(GEMMA_SHAPES))
def test_window_matches_ref(shape, dtype, device):
    """Each row over its window's live keys only (the twin slices keys p - W < j <= p): the
    usual tolerance; and rows whose window leaves keys out differ from the causal result, while
    rows whose window reaches key 0 get the causal kernel's very bits."""
    nkv, g, hd = GEMMA_SHAPES[shape]
    k, v = _cache(nkv, hd, 450, dtype, device, storage=460)
    q = _q(len(WIN_POS_SHORT), nkv * g, hd, dtype, device, seed=31)
    pos = torch.tensor(WIN_POS_SHORT, device=device)
    got = decode_attention(q, k, v, pos, 1.0, window=WIN)
    want = decode_attention_ref(q, k, v, pos, 1.0, window=WIN)
    torch.testing.assert_close(got, want, **TOL[dtype])
    full = decode_attention_ref(q, k, v, pos, 1.0)
    late = pos >= WIN  # rows whose window leaves keys out: the causal result is another one
    assert not torch.allclose(got[late].float(), full[late].float(), **TOL[dtype])
    assert torch.equal(got[~late], decode_attention(q, k, v, pos, 1.0)[~late])  # whole window: the causal bits


def _win_rows_alone_vs_step(launch, nkv, g, hd, dtype, device, slots=(1, 4, 6, 12)):
    """Rows of a 16-row windowed step (WIN_POS, shuffled by the seed) that differ from the same
    row run alone: [(slot, position)]."""
    k, v = _cache(nkv, hd, 450, dtype, device, storage=460)
    q = _q(len(WIN_POS), nkv * g, hd, dtype, device, seed=32)
    pos = torch.tensor(WIN_POS, device=device)
    batch = launch(q, k, v, pos)
    return [(s, int(pos[s])) for s in slots
            if not torch.equal(launch(q[s:s + 1], k, v, pos[s:s + 1])[0], batch[s])]


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["hd256", pytest.param("hd512", marks=pytest.mark.exhaustive)])  # the same code
def test_window_row_alone_equals_row_in_step(shape, dtype, device):
    """A windowed row's bits do not depend on the rows beside it (their windows start elsewhere:
    the tile walks blocks before this row's window for them) nor on the storage size."""
    nkv, g, hd = GEMMA_SHAPES[shape]
    launch = lambda q, k, v, pos: decode_attention(q, k, v, pos, 1.0, window=WIN)  # noqa: E731
    assert _win_rows_alone_vs_step(launch, nkv, g, hd, dtype, device) == []
    q = _q(4, nkv * g, hd, dtype, device, seed=33)
    pos = torch.tensor([449, 300, WIN, 5], device=device)
    outs = [decode_attention(q, *_cache(nkv, hd, 450, dtype, device, storage=s), pos, 1.0, window=WIN)
            for s in (450, 1000)]
    assert torch.equal(outs[0], outs[1])


def _planted(tmp_path, old: str, new: str):
    """kernels/attention.py with `old` replaced by `new`, imported as a sibling module of
    memra_kernels (its relative imports resolve), for the planted-bug tests."""
    import importlib.util
    import sys

    src = inspect.getsource(attention)
    assert src.count(old) == 1, "the plant no longer applies: update this test with attention.py"
    path = tmp_path / "attention_planted.py"
    path.write_text(src.replace(old, new))
    name = f"memra_kernels._planted_{tmp_path.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_planted_window_off_by_one_is_caught(tmp_path, device):
    """A window one key too wide (p - W <= j): the twin comparison above fails on it."""
    bad = _planted(tmp_path, "win_start = pos - window + 1", "win_start = pos - window")
    nkv, g, hd = GEMMA_SHAPES["hd256"]
    dtype = torch.float32
    k, v = _cache(nkv, hd, 450, dtype, device, storage=460)
    q = _q(len(WIN_POS_SHORT), nkv * g, hd, dtype, device, seed=31)
    pos = torch.tensor(WIN_POS_SHORT, device=device)
    got = bad.decode_attention(q, k, v, pos, 1.0, window=WIN)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, 1.0, window=WIN), **TOL[dtype])


@pytest.mark.exhaustive  # ~2 s through the interpreter; the window's invariance itself is checked quick
def test_planted_block_order_from_the_step_is_caught(tmp_path, device):
    """Key blocks that start at the tile's earliest window start instead of the absolute block
    grid: a row's block boundaries then follow the rows beside it. Still the right keys (the
    twin comparison passes), but the invariance check above catches it."""
    bad = _planted(tmp_path, "first = tl.min(tl.where(mine, row_start // BLOCK_N * BLOCK_N, hi), axis=0)",
                   "first = tl.min(tl.where(mine, row_start, hi), axis=0)")
    nkv, g, hd = GEMMA_SHAPES["hd256"]
    dtype = torch.float32
    launch = lambda q, k, v, pos: bad.decode_attention(q, k, v, pos, 1.0, window=WIN)  # noqa: E731
    k, v = _cache(nkv, hd, 450, dtype, device, storage=460)
    q = _q(len(WIN_POS), nkv * g, hd, dtype, device, seed=32)
    pos = torch.tensor(WIN_POS, device=device)
    torch.testing.assert_close(launch(q, k, v, pos), decode_attention_ref(q, k, v, pos, 1.0, window=WIN),
                               **TOL[dtype])
    assert _win_rows_alone_vs_step(launch, nkv, g, hd, dtype, device) != []


@pytest.mark.exhaustive  # windows and growing splits together: no shipped tile uses both yet
def test_window_with_long_splits(device):
    """A window across rows of every split size (LONG): the twin's result, and each row's bits
    alone as in the step."""
    nkv, hd, dtype = 2, 64, torch.float32
    k, v = _cache(nkv, hd, 448, dtype, device, storage=460)
    q, pos = _long_step(dtype, device, seed=24)
    got = attention._launch(q, k, v, pos, _scale(hd), **LONG, window=WIN)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd), window=WIN), **TOL[dtype])
    for i in (0, 3, 5, 14, 18):
        alone = attention._launch(q[i:i + 1], k, v, pos[i:i + 1], _scale(hd), **LONG, window=WIN)
        assert torch.equal(alone[0], got[i]), int(pos[i])


# A sliding window over a storage many windows long, rows of each tile far apart: the window
# grid's programs (split_programs) loop over several units each.
FAR_POS = [1000, 3, 499, 47, 998, 260, 33, 731, 1001, 2, 640, 128, 127, 900, 64, 350]
FAR_WIN = 40


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_window_grid_loops_over_rows_far_apart(dtype, device, monkeypatch):
    """Rows of one tile whose windows lie splits apart: the window grid's programs take
    several units each (checked: fewer programs than splits); each row gets the twin's
    result, its bits alone, and the causal grid's over every position (GRID_OVER_WINDOWS
    off, the benchmarks' baseline)."""
    nkv, g, hd = 2, 4, 64
    k, v = _cache(nkv, hd, 1002, dtype, device, storage=1010)
    q = _q(len(FAR_POS), nkv * g, hd, dtype, device, seed=36)
    pos = torch.tensor(FAR_POS, device=device)
    n_splits = -(-1010 // SMALL["split"])
    assert attention.split_programs(n_splits, FAR_WIN, SMALL["split"]) < n_splits // 4  # the loop runs
    got = attention._launch(q, k, v, pos, _scale(hd), **SMALL, window=FAR_WIN)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd), window=FAR_WIN), **TOL[dtype])
    for i in (0, 1, 12):
        alone = attention._launch(q[i:i + 1], k, v, pos[i:i + 1], _scale(hd), **SMALL, window=FAR_WIN)
        assert torch.equal(alone[0], got[i]), int(pos[i])
    monkeypatch.setattr(attention, "GRID_OVER_WINDOWS", False)
    assert torch.equal(attention._launch(q, k, v, pos, _scale(hd), **SMALL, window=FAR_WIN), got)


@pytest.mark.exhaustive  # the window test with long splits runs beside it there
def test_planted_window_grid_start_without_the_rows_split_is_caught(tmp_path, device):
    """The window grid starting at the unit of a row's first key rather than of its first
    split's start (a long split starts before the key): those rows lose their first split,
    and the twin comparison of test_window_with_long_splits fails."""
    bad = _planted(tmp_path, "tl.maximum(win_start, 0) // row_split * row_split // SPLIT",
                   "tl.maximum(win_start, 0) // SPLIT")
    nkv, hd, dtype = 2, 64, torch.float32
    k, v = _cache(nkv, hd, 448, dtype, device, storage=460)
    q, pos = _long_step(dtype, device, seed=24)
    got = bad._launch(q, k, v, pos, _scale(hd), **LONG, window=WIN)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd), window=WIN), **TOL[dtype])


# ---------------------------------------------------------------- value-column parts (Tile.block_dv)

PARTS = dict(SMALL, block_dv=16)  # a 64-wide head in 4 parts
PARTS_LIVE = 240  # several splits and windows, short for the interpreter


@pytest.mark.exhaustive  # quick: the padded head's parts below, and TILES[512]'s parts in the hd512 window tests
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_value_parts_match_the_twin(dtype, device):
    """A head's value columns in parts (one program each): the twin's result, causal and
    windowed, and the whole-head tile's within the same tolerance."""
    nkv, g, hd = 2, 4, 64
    k, v = _cache(nkv, hd, PARTS_LIVE, dtype, device, storage=PARTS_LIVE)
    q = _q(8, nkv * g, hd, dtype, device, seed=37)
    pos = _step(37, device, t=8, max_pos=PARTS_LIVE - 1)
    for window in (0, WIN):
        got = attention._launch(q, k, v, pos, _scale(hd), **PARTS, window=window)
        torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd), window=window), **TOL[dtype])
        whole = attention._launch(q, k, v, pos, _scale(hd), **SMALL, window=window)
        torch.testing.assert_close(got, whole, **TOL[dtype])


@pytest.mark.exhaustive  # quick: the parts against the twin; the invariance argument is the whole tile's
@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_value_parts_row_alone_equals_row_in_step(dtype, device):
    """With value parts a row's bits still depend on its own position and query only."""
    nkv, g, hd = 2, 4, 64
    k, v = _cache(nkv, hd, PARTS_LIVE, dtype, device, storage=PARTS_LIVE)
    q = _q(9, nkv * g, hd, dtype, device, seed=38)
    pos = _step(38, device, t=9, max_pos=PARTS_LIVE - 1)
    batch = attention._launch(q, k, v, pos, _scale(hd), **PARTS)
    for i in (0, 5, 8):  # slot 8 is a tile of its own
        alone = attention._launch(q[i:i + 1], k, v, pos[i:i + 1], _scale(hd), **PARTS)
        assert torch.equal(alone[0], batch[i]), int(pos[i])


def test_value_parts_of_a_padded_head_match_the_twin(device):
    """An 80-wide head in parts of 32 of its 128-wide tile: the last part is all padding (stores
    nothing), the third half padding."""
    nkv, g, hd, dtype = 2, 2, 80, torch.float32
    k, v = _cache(nkv, hd, PARTS_LIVE, dtype, device, storage=PARTS_LIVE)
    q = _q(3, nkv * g, hd, dtype, device, seed=40)
    pos = torch.tensor([0, 100, PARTS_LIVE - 1], device=device)
    got = attention._launch(q, k, v, pos, _scale(hd), **dict(SMALL, block_dv=32))
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])


def test_value_parts_are_checked():
    with pytest.raises(ValueError, match="block_dv"):
        Tile(**dict(SMALL, block_dv=24))
    with pytest.raises(ValueError, match="block_dv"):
        Tile(**dict(SMALL, block_dv=8))
    assert Tile(**PARTS).block_dv == 16


# ---------------------------------------------------------------- ring storage (Gemma 4's sliding layers)


def _ring_of(plain: torch.Tensor, rows: int, last: int) -> torch.Tensor:
    """What a ring of `rows` rows holds after positions 0..last were written in order: row r the
    latest position j <= last with j % rows == r (older positions overwritten)."""
    ring = torch.full_like(plain[:, :rows], float("nan"))
    for j in range(last + 1):
        ring[:, j % rows] = plain[:, j]
    return ring


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_a_ring_storage_gives_the_plain_storages_bits(dtype, device):
    """Rows of a 16-row windowed step at positions 434..449 over a ring of WIN + 16 rows (every
    position written in order, so each row's window is the ring's last keys, wrapped around
    its end) get the bits of the same rows over a plain storage of every position; the twin
    with `span` gives its plain result too."""
    nkv, g, hd = GEMMA_SHAPES["hd256"]
    k, v = _cache(nkv, hd, 450, dtype, device, storage=460)
    rows = WIN + 16
    kr, vr = _ring_of(k, rows, 449), _ring_of(v, rows, 449)
    q = _q(16, nkv * g, hd, dtype, device, seed=34)
    pos = torch.arange(434, 450, device=device)
    plain = decode_attention(q, k, v, pos, 1.0, window=WIN)
    assert torch.equal(decode_attention(q, kr, vr, pos, 1.0, window=WIN, span=460), plain)
    assert torch.equal(decode_attention_ref(q, kr, vr, pos, 1.0, window=WIN, span=460),
                       decode_attention_ref(q, k, v, pos, 1.0, window=WIN))


def test_a_ring_storage_is_refused_where_it_cannot_serve(device):
    """A ring needs a window no wider than its rows, and serves at least its own rows."""
    nkv, g, hd = GEMMA_SHAPES["hd256"]
    k, v = _cache(nkv, hd, 40, torch.bfloat16, device, storage=40)
    q = _q(1, nkv * g, hd, torch.bfloat16, device, seed=35)
    pos = torch.tensor([39], device=device)
    with pytest.raises(ValueError, match="needs a window of at most 40 keys, got none"):
        decode_attention(q, k, v, pos, 1.0, span=100)
    with pytest.raises(ValueError, match="needs a window of at most 40 keys, got 41"):
        decode_attention(q, k, v, pos, 1.0, window=41, span=100)
    with pytest.raises(ValueError, match="span 30 is below the storage's 40 rows"):
        decode_attention(q, k, v, pos, 1.0, window=8, span=30)


# ---------------------------------------------------------------- one split: no combine launch


def _count_launches(monkeypatch):
    """Names of the attention kernels launched from here on (a spy on the two kernels' grids)."""
    names = []
    for name in ("_split_kernel", "_combine_kernel"):
        kernel = getattr(attention, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                names.append(self.name)
                return self.kernel[grid]

        monkeypatch.setattr(attention, name, Spy(kernel, name))
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gqa", [(2, 2, 64), (1, 4, 32)], ids=["g2-hd64", "g4-hd32"])
def test_one_split_writes_the_combines_bits_in_one_launch(gqa, dtype, monkeypatch, device):
    """A grid of one split (a storage of at most a split's keys) writes its outputs from the split
    kernel (DIRECT): one launch, the bits of the split kernel's partial and the combine (the
    two launches, DIRECT_ONE_SPLIT off), and within the reference's tolerance; a padding row
    (position -1) gets NaN. A -0 output (every value -0) comes out +0, as the combine's lane sum
    makes it: bit for bit, sign included."""
    nkv, g, hd = gqa
    tile = dict(split=64, block_n=16, block_m=16, num_stages=1, num_warps=4)
    k, v = _cache(nkv, hd, 50, dtype, device, storage=60)
    q = _q(6, nkv * g, hd, dtype, device, seed=21)
    pos = torch.tensor([49, 0, 17, 49, -1, 5], device=device)  # row 4: a padding row (the combine's NaN)
    names = _count_launches(monkeypatch)
    one = attention._launch(q, k, v, pos, _scale(hd), **tile)
    assert names == ["_split_kernel"]
    monkeypatch.setattr(attention, "DIRECT_ONE_SPLIT", False)
    two = attention._launch(q, k, v, pos, _scale(hd), **tile)
    assert names == ["_split_kernel", "_split_kernel", "_combine_kernel"]
    live = pos >= 0  # (the combine reads a padding row's partial, which no program stored: undefined)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(one[live].view(bits), two[live].view(bits))
    assert one[4].isnan().all() and one[live].isfinite().all()
    torch.testing.assert_close(one[live], decode_attention_ref(q[live], k, v, pos[live], _scale(hd)), **TOL[dtype])
    v_neg = torch.full_like(v, -0.0)
    two = attention._launch(q, k, v_neg, pos, _scale(hd), **tile)
    monkeypatch.setattr(attention, "DIRECT_ONE_SPLIT", True)
    one = attention._launch(q, k, v_neg, pos, _scale(hd), **tile)
    assert not torch.signbit(two[live]).any() and torch.equal(torch.signbit(one[live]), torch.signbit(two[live]))


def test_a_drafters_block_attention_runs_its_tile_and_any_storage_gives_its_bits(monkeypatch, device):
    """`draft_block_attention`: the drafter's tile (DRAFT_TILES, by head size only; TILES where a
    class has none); a block (every row at its last position) over a storage of one split is one
    launch, and over a storage of two splits (the combine after them) the same bits; within the
    reference's tolerance. Planted: the target's tile gives other last bits (another split)."""
    from memra_kernels.attention import DRAFT_TILES, draft_block_attention, draft_tile_for

    assert draft_tile_for(64) is DRAFT_TILES[128] and draft_tile_for(256) is tile_for(256)
    small = Tile(split=64, block_n=16, block_m=16, num_stages=1, num_warps=4)
    monkeypatch.setitem(DRAFT_TILES, 128, small)  # the interpreter's size: one split of 64 keys
    dtype, nkv, g, hd = torch.bfloat16, 2, 2, 64
    q = _q(15, nkv * g, hd, dtype, device, seed=22)
    pos = torch.full((15,), 47, device=device)  # a block's rows at its last position
    names = _count_launches(monkeypatch)
    k, v = _cache(nkv, hd, 48, dtype, device, storage=64)
    one = draft_block_attention(q, k, v, pos, _scale(hd))
    assert names == ["_split_kernel"]
    k2, v2 = _cache(nkv, hd, 48, dtype, device, storage=100)
    two = draft_block_attention(q, k2, v2, pos, _scale(hd))
    assert names[1:] == ["_split_kernel", "_combine_kernel"] and torch.equal(one, two)
    torch.testing.assert_close(one, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])
    assert not torch.equal(one, decode_attention(q, k, v, pos, _scale(hd)))  # TILES[128]: 256-key splits
