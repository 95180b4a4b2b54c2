"""Split-K causal GQA attention vs its torch twin, and its bit-invariance.

The invariance tests are the point: a row's output must not change (torch.equal) with the rows
beside it, their positions or queries, the cache storage size, or the row chunking.

The one-launch path (the last split program of a tile merges) must equal the two-launch path
bit for bit and leave its counters at 0. The interpreter runs programs one at a time in grid
order, so these tests catch counting bugs (a counter not reset, a combine one split early, a
wrong target), never ordering ones (a missing barrier or acquire, two programs merging): those
are the GPU benchmark's (benchmarks/gpu/attention_tiles.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels import attention  # noqa: E402
from memra_kernels.attention import SPLIT_KEYS, decode_attention, decode_attention_ref  # noqa: E402

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
]
CASE_IDS = [f"t{c[0]}-nh{c[1]}-kv{c[2]}-hd{c[3]}" for c in CASES]


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


LIVE = 600  # live keys in the invariance tests: 3 splits of 256, kept short for the interpreter


def _step(seed, device, t=16, max_pos=LIVE - 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max_pos + 1, (t,), generator=g).to(device)


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
@pytest.mark.parametrize("g,hd", [(4, 64), (1, 128)])
def test_row_alone_equals_row_in_step(g, hd, dtype, device):
    """(a) Row i alone == row i inside 16 (and 17) rows at other random positions."""
    nkv = 2
    nh = g * nkv
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    targets = (0, 36, SPLIT_KEYS - 1, SPLIT_KEYS, LIVE - 1)  # split boundaries included
    for t, slots, seed in ((16, (13, 2, 7, 0, 15), 1), (17, (16, 3, 9, 15, 1), 2)):
        # (slot 16 of 17 rows lands in the second M tile when g = 4)
        q = _q(t, nh, hd, dtype, device, seed=seed)
        pos = _step(seed, device, t=t)
        for slot, p in zip(slots, targets):
            pos[slot] = p
        batch = decode_attention(q, k, v, pos, _scale(hd))
        for slot in slots:
            alone = decode_attention(q[slot:slot + 1], k, v, pos[slot:slot + 1], _scale(hd))
            assert torch.equal(alone[0], batch[slot]), (t, slot, int(pos[slot]))


@pytest.mark.parametrize("dtype", INV_DTYPES, ids=str)
def test_storage_size_does_not_matter(dtype, device):
    """(b) Same live keys in storages of LIVE and 2085 positions, NaN past the live keys:
    identical outputs, and no NaN leaks in."""
    nkv, g, hd = 2, 4, 64
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


def test_row_chunking_does_not_matter(device):
    """Large batches run in row chunks (bounded workspace): chunking changes nothing."""
    dtype = torch.bfloat16
    nkv, g, hd = 2, 4, 64
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    q = _q(9, nkv * g, hd, dtype, device, seed=6)
    pos = _step(6, device, t=9)
    kw = dict(split=attention.SPLIT_KEYS, block_m=attention.BLOCK_M, block_n=attention.BLOCK_N,
              num_warps=attention.NUM_WARPS, num_stages=attention.NUM_STAGES)
    one = attention._launch(q, k, v, pos, _scale(hd), **kw)
    per_row = nkv * g * (S // SPLIT_KEYS + 1) * (hd + 2) * 4
    chunked = attention._launch(q, k, v, pos, _scale(hd), workspace_bytes=4 * per_row, **kw)
    assert torch.equal(one, chunked)


# ---------------------------------------------------------------- one launch vs two

def _tiles(**kw):
    """The module's tile constants, overridden by kw (for `attention._launch`)."""
    cfg = dict(split=attention.SPLIT_KEYS, block_m=attention.BLOCK_M, block_n=attention.BLOCK_N,
               num_warps=attention.NUM_WARPS, num_stages=attention.NUM_STAGES)
    return {**cfg, **kw}


def _counters_zero(device) -> bool:
    buffers = attention._COUNTERS.get(torch.device(device), [])
    return all(int(b.abs().sum()) == 0 for b in buffers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,nh,nkv,hd,positions", CASES, ids=CASE_IDS)
def test_fused_equals_two_launch(t, nh, nkv, hd, positions, dtype, device):
    """The one-launch path (the split programs merge) == the two-launch path, bit for bit, and
    it leaves every counter at 0. Storage 1100 (not a multiple of the split), odd positions."""
    q = _q(t, nh, hd, dtype, device, seed=40 + t)
    k, v = _cache(nkv, hd, max(positions) + 1, dtype, device)
    pos = torch.tensor(positions, device=device)
    fused = attention._launch(q, k, v, pos, _scale(hd), fused=True, **_tiles())
    two = attention._launch(q, k, v, pos, _scale(hd), fused=False, **_tiles())
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, two)
    assert _counters_zero(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_two_launch_small_tiles(dtype, device):
    """Many tiles and many splits per row (split 64, block_m 16: 17 rows at g = 4 are 5 tiles,
    row 16 alone in the last; up to 10 splits a row), and merge shapes that differ between the
    paths and from the defaults: every variant gives the same bits, counters end at 0."""
    nkv, g, hd, t = 2, 4, 64, 17
    q = _q(t, nkv * g, hd, dtype, device, seed=41)
    k, v = _cache(nkv, hd, 600, dtype, device, storage=620)
    pos = torch.tensor([599, 0, 63, 64, 65, 127, 128, 500, 1, 2, 300, 301, 302, 590, 62, 5, 598],
                       device=device)
    tiles = _tiles(split=64, block_m=16, block_n=32)
    base = attention._launch(q, k, v, pos, _scale(hd), fused=False, **tiles)
    torch.testing.assert_close(base, decode_attention_ref(q, k, v, pos, _scale(hd)), **TOL[dtype])
    for fused, merge in ((True, {}), (True, dict(merge_pairs=16, merge_unroll=4)),
                         (True, dict(merge_pairs=64, merge_unroll=1)),
                         (False, dict(combine_pairs=32, merge_unroll=4))):
        got = attention._launch(q, k, v, pos, _scale(hd), fused=fused, **tiles, **merge)
        assert torch.equal(got, base), (fused, merge)
    assert _counters_zero(device)


def test_fused_consecutive_calls(device):
    """Calls back to back through the same counters, each needing a different number of splits
    per tile (1, 4, 2, then 4 again): each equals the two-launch result, so a counter left
    non-zero by one call (the next then combines too early, or never) fails here. The fused
    calls run first, all of them: a workspace reused from a two-launch call on the same inputs
    would hold the right partials even for a program that merged too early."""
    dtype, nkv, g, hd = torch.bfloat16, 2, 4, 64
    k, v = _cache(nkv, hd, 1000, dtype, device)
    tiles = _tiles(split=256, block_m=16)
    q = _q(6, nkv * g, hd, dtype, device, seed=42)
    calls = []  # outputs kept alive: no call's output may reuse another's memory
    for start in (0, 990, 300, 800):
        pos = torch.arange(start, start + 6, device=device)
        calls.append((pos, attention._launch(q, k, v, pos, _scale(hd), fused=True, **tiles)))
    for pos, got in calls:
        want = attention._launch(q, k, v, pos, _scale(hd), fused=False, **tiles)
        assert torch.equal(got, want), int(pos[0])
    assert _counters_zero(device)


@pytest.mark.parametrize("g,hd", [(4, 64), (1, 128)])
def test_fused_row_alone_equals_row_in_step(g, hd, device):
    """Row-count invariance of the one-launch path with small tiles (block_m 16, split 128):
    a row merged by another tile's combining program, among other rows, == the row alone."""
    dtype, nkv = torch.bfloat16, 2
    nh = g * nkv
    k, v = _cache(nkv, hd, LIVE, dtype, device)
    tiles = _tiles(split=128, block_m=16)
    q = _q(17, nh, hd, dtype, device, seed=43)
    pos = _step(43, device, t=17)
    slots, targets = (16, 3, 9, 12), (0, 127, 128, LIVE - 1)
    for slot, p in zip(slots, targets):
        pos[slot] = p
    batch = attention._launch(q, k, v, pos, _scale(hd), fused=True, **tiles)
    for slot in slots:
        alone = attention._launch(q[slot:slot + 1], k, v, pos[slot:slot + 1], _scale(hd),
                                  fused=True, **tiles)
        assert torch.equal(alone[0], batch[slot]), (slot, int(pos[slot]))
    assert _counters_zero(device)


def test_counter_buffer_not_allocated_during_capture(monkeypatch, device):
    """The counters are allocated (and grown) only outside stream capture; a capture that would
    need them says how to fix it instead of allocating inside the graph."""
    monkeypatch.setattr(attention, "_COUNTERS", {})
    monkeypatch.setattr(attention, "MIN_COUNTERS", 4)
    dtype, nkv, g, hd = torch.bfloat16, 2, 4, 64
    k, v = _cache(nkv, hd, 300, dtype, device, storage=300)
    q = _q(17, nkv * g, hd, dtype, device, seed=44)
    pos = torch.arange(283, 300, device=device)
    capturing = {"on": True}
    monkeypatch.setattr(attention, "_capturing", lambda dev: capturing["on"])
    with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
        decode_attention(q[:1], k, v, pos[:1], _scale(hd))
    capturing["on"] = False
    small = decode_attention(q[:1], k, v, pos[:1], _scale(hd))  # eager: 1 tile x 2 KV heads
    assert [b.numel() for b in attention._COUNTERS[torch.device(device)]] == [4]
    capturing["on"] = True
    assert torch.equal(decode_attention(q[:1], k, v, pos[:1], _scale(hd)), small)  # fits
    with pytest.raises(RuntimeError, match="only 4 are"):  # 17 rows at g = 4: 5 tiles x 2 heads
        attention._launch(q, k, v, pos, _scale(hd), fused=True, **_tiles(block_m=16))
    capturing["on"] = False
    attention._launch(q, k, v, pos, _scale(hd), fused=True, **_tiles(block_m=16))
    sizes = [b.numel() for b in attention._COUNTERS[torch.device(device)]]
    assert sizes == [4, 16]  # grown, and the old buffer kept alive (a graph may hold it)
    assert _counters_zero(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_follows_positions():
    """Captured once, replayed with new positions written in place: equals eager."""
    dtype, nkv, g, hd = torch.bfloat16, 8, 4, 128
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
