"""Split-K causal GQA attention vs its torch twin, and its bit-invariance.

The invariance tests are the point: a row's output must not change (torch.equal) with the rows
beside it, their positions or queries, the cache storage size, or the row chunking.
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
