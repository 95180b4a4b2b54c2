"""The fused markov chain (one launch per slot) against its torch twin, the engine's loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.markov import (  # noqa: E402
    BLOCK_R, BLOCK_V, TABLE_BLOCK, bias_table, markov_chain, markov_chain_ref, table_fits,
)

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(n, V, r, v_in, dtype, device, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * spread).to(device)
    w1 = (torch.randn(v_in, r, generator=g) / r ** 0.5).to(dtype).to(device)
    w2 = torch.randn(V, r, generator=g).to(dtype).to(device)
    anchor = torch.tensor([v_in // 3], dtype=torch.long, device=device)
    return logits, anchor, w1, w2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,V,r", [(1, 37, 8), (3, BLOCK_V * 3 + 5, BLOCK_R + 36), (15, 1000, 64), (16, 512, 16)])
def test_matches_ref(n, V, r, dtype, device):
    """Same tokens as the twin (the logits' spread keeps every slot far from a tie, so the dot's
    summation order cannot flip a pick), and a token's bias matches the twin's to an ulp."""
    logits, anchor, w1, w2 = _inputs(n, V, r, V, dtype, device)
    got = markov_chain(logits, anchor, w1, w2, dtype)
    ref = markov_chain_ref(logits, anchor, w1, w2, dtype)
    assert got.dtype == torch.long and got.shape == (n,)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_chain_depends_on_the_previous_pick(dtype, device):
    """Weak logits and a strong w2 · w1[prev]: each pick is decided by the previous one, so a
    kernel that used the anchor (or a stale slot) for every slot gives another chain."""
    n, V, r = 8, 300, 32
    logits, anchor, w1, w2 = _inputs(n, V, r, V, dtype, device, seed=3, spread=0.01)
    w1 = (w1 * 8).to(dtype)
    ref = markov_chain_ref(logits, anchor, w1, w2, dtype)
    assert len(set(ref.tolist())) > 3  # the chain moves
    assert markov_chain(logits, anchor, w1, w2, dtype).tolist() == ref.tolist()


def test_ties_go_to_the_first_index_across_programs(device):
    """Equal maxima in several programs' rows: torch.argmax's rule, the first index."""
    n, V, r = 2, BLOCK_V * 4, 8
    logits = torch.zeros(n, V, device=device)
    logits[0, [BLOCK_V * 3 + 1, BLOCK_V + 7, BLOCK_V * 2]] = 5.0
    logits[1, [V - 1, BLOCK_V * 2 + 3]] = 2.0
    w1 = torch.zeros(V, r, device=device)
    w2 = torch.zeros(V, r, device=device)
    anchor = torch.tensor([0], device=device)
    got = markov_chain(logits, anchor, w1, w2, torch.float32)
    assert got.tolist() == [BLOCK_V + 7, BLOCK_V * 2 + 3]
    assert got.tolist() == markov_chain_ref(logits, anchor, w1, w2, torch.float32).tolist()


def test_a_bias_rounded_in_the_compute_dtype(device):
    """The bias is rounded to bf16 as the linear layer's output is: a logit gap smaller than
    that rounding decides the pick the way the twin does."""
    V, r = 64, 4
    logits = torch.zeros(1, V, device=device)
    w1 = torch.zeros(V, r, device=device)
    w1[0, 0] = 1.0
    w2 = torch.zeros(V, r, device=device)
    w2[10, 0] = 1.0 + 2**-9  # rounds to 1.0 in bf16
    w2[20, 0] = 1.0
    logits[0, 20] = 2**-12  # beats row 10 only once row 10's bias is rounded to 1.0
    anchor = torch.tensor([0], device=device)
    bf = markov_chain(logits, anchor, w1, w2, torch.bfloat16)
    assert bf.tolist() == markov_chain_ref(logits, anchor, w1, w2, torch.bfloat16).tolist() == [20]
    assert markov_chain(logits, anchor, w1, w2, torch.float32).tolist() == [10]


def test_refuses_bad_shapes(device):
    logits, anchor, w1, w2 = _inputs(2, 50, 8, 50, torch.float32, device)
    with pytest.raises(ValueError, match="w1 \\[V_in, r\\] and w2"):
        markov_chain(logits, anchor, w1, w2[:40], torch.float32)
    with pytest.raises(ValueError, match="logits must be \\[n, V\\] float32, bfloat16 or float16"):
        markov_chain(logits.double(), anchor, w1, w2, torch.float32)
    assert markov_chain(logits[:0], anchor, w1, w2, torch.float32).shape == (0,)


# ------------------------------------------------------------------------ the one-launch chain


def _table_chain(logits, anchor, w1, w2, dtype):
    return markov_chain(logits, anchor, w1, w2, dtype, table=bias_table(w1, w2, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,V,r,v_in", [(1, 37, 8, 37), (3, TABLE_BLOCK + 5, 24, TABLE_BLOCK + 5), (15, 1000, 64, 1000),
                                         (16, 512, 16, 700)])
def test_table_chain_matches_ref(n, V, r, v_in, dtype, device):
    """The one-launch chain over the bias table: the twin's tokens (vocabularies of one tile,
    several tiles, an input vocabulary larger than the output one)."""
    logits, anchor, w1, w2 = _inputs(n, V, r, v_in, dtype, device, seed=5)
    got = _table_chain(logits, anchor, w1, w2, dtype)
    assert got.dtype == torch.long and got.shape == (n,)
    assert got.tolist() == markov_chain_ref(logits, anchor, w1, w2, dtype).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_chain_follows_the_previous_pick(dtype, device):
    """Each pick decided by the previous one (weak logits, strong bias): a kernel reading the
    anchor's (or a stale) table row for every slot gives another chain."""
    n, V, r = 8, 300, 32
    logits, anchor, w1, w2 = _inputs(n, V, r, V, dtype, device, seed=3, spread=0.01)
    w1 = (w1 * 8).to(dtype)
    ref = markov_chain_ref(logits, anchor, w1, w2, dtype)
    assert len(set(ref.tolist())) > 3
    assert _table_chain(logits, anchor, w1, w2, dtype).tolist() == ref.tolist()


def test_table_chain_ties_go_to_the_first_index_across_tiles(device):
    """Equal maxima in several tiles and lanes: the first index, as torch.argmax."""
    n, V, r = 2, TABLE_BLOCK * 2 + 9, 4
    logits = torch.zeros(n, V, device=device)
    logits[0, [TABLE_BLOCK + 1, 7, TABLE_BLOCK * 2 + 3]] = 5.0  # 7 is first
    logits[1, [TABLE_BLOCK * 2 + 8, TABLE_BLOCK + 3]] = 2.0  # TABLE_BLOCK + 3 is first
    w1 = torch.zeros(V, r, device=device)
    w2 = torch.zeros(V, r, device=device)
    anchor = torch.tensor([0], device=device)
    got = _table_chain(logits, anchor, w1, w2, torch.float32)
    assert got.tolist() == [7, TABLE_BLOCK + 3] == markov_chain_ref(logits, anchor, w1, w2, torch.float32).tolist()


def test_table_is_the_rounded_linear_and_refused_when_malformed(device):
    """Row p of the table is linear(w1[p], w2) rounded to the compute dtype (bf16 here), and a
    table of the wrong shape or dtype is refused; the size rule keeps big vocabularies out."""
    logits, anchor, w1, w2 = _inputs(2, 64, 8, 80, torch.bfloat16, device)
    t = bias_table(w1, w2, torch.bfloat16)
    assert t.shape == (80, 64) and t.dtype == torch.bfloat16
    row = torch.nn.functional.linear(w1[5:6].to(torch.bfloat16), w2.to(torch.bfloat16))
    assert torch.allclose(t[5].float(), row[0].float(), rtol=2**-7, atol=1e-6)
    with pytest.raises(ValueError, match="table must be"):
        markov_chain(logits, anchor, w1, w2, torch.bfloat16, table=t.float())
    with pytest.raises(ValueError, match="table must be"):
        markov_chain(logits, anchor, w1, w2, torch.bfloat16, table=t[:, :32])
    with pytest.raises(ValueError, match="at least 64 rows"):  # a pick indexes w1 (and the table)
        markov_chain(logits, anchor, w1[:40], w2, torch.bfloat16)
    big = torch.empty(151936, 8, dtype=torch.bfloat16, device="meta")
    assert table_fits(w1, w2, torch.bfloat16) and not table_fits(big, big, torch.bfloat16)


@pytest.mark.parametrize("use_table", [True, False], ids=["table", "slots"])
def test_model_dtype_logits_are_widened_exactly(use_table, device):
    """bf16 logits (the lm_head's own output, before its float32 widening) give the chain of the
    widened ones: the kernels widen what they load, exactly."""
    n, V, r = 15, 700, 16
    logits, anchor, w1, w2 = _inputs(n, V, r, V, torch.bfloat16, device, seed=11)
    low = logits.to(torch.bfloat16)
    table = bias_table(w1, w2, torch.bfloat16) if use_table else None
    want = markov_chain_ref(low.float(), anchor, w1, w2, torch.bfloat16).tolist()
    assert markov_chain(low, anchor, w1, w2, torch.bfloat16, table=table).tolist() == want
    assert markov_chain(low.float(), anchor, w1, w2, torch.bfloat16, table=table).tolist() == want


def test_table_chain_signed_zero_ties_go_to_the_first_index(device):
    """A maximum of 0 reached as -0.0 (index 5: -0.0 logit + -0.0 bias) before +0.0 (index 9):
    equal, so the first index, torch's rule, although the two bit patterns order differently."""
    V, r = 64, 4
    logits = torch.full((1, V), -1.0, device=device)
    logits[0, 5], logits[0, 9] = -0.0, 0.0
    table = torch.zeros(V, V, device=device)
    table[:, 5] = -0.0
    w1, w2 = torch.zeros(V, r, device=device), torch.zeros(V, r, device=device)  # shapes only: the table decides
    anchor = torch.tensor([0], device=device)
    scores = logits[0] + table[0]
    assert torch.signbit(scores[5]) and not torch.signbit(scores[9])
    assert torch.argmax(scores).item() == 5
    assert markov_chain(logits, anchor, w1, w2, torch.float32, table=table).tolist() == [5]


@pytest.mark.parametrize("use_table", [True, False], ids=["table", "slots"])
def test_with_anchor_puts_the_anchor_first(use_table, device):
    """`with_anchor`: `[anchor, chain...]`, the chain the same picks as without it (the table's
    launch writes the anchor itself; the slots' path concatenates after its launches)."""
    logits, anchor, w1, w2 = _inputs(15, 1000, 64, 1000, torch.bfloat16, device, seed=4)
    table = bias_table(w1, w2, torch.bfloat16) if use_table else None
    chain = markov_chain(logits, anchor, w1, w2, torch.bfloat16, table=table)
    both = markov_chain(logits, anchor, w1, w2, torch.bfloat16, table=table, with_anchor=True)
    assert both.shape == (16,) and both.dtype == torch.long
    assert both[0].item() == anchor.item() and torch.equal(both[1:], chain)
    none = markov_chain(logits[:0], anchor, w1, w2, torch.bfloat16, table=table, with_anchor=True)
    assert none.tolist() == [anchor.item()]


@pytest.mark.parametrize("V,markov_features,pending", [(1000, True, True), (TABLE_BLOCK + 5, True, False),
                                                       (300, False, True)],
                         ids=["one-tile-pending", "tiles", "hidden-only"])
def test_the_chain_scores_its_slots_as_the_confidence_head_does(V, markov_features, pending, device):
    """`markov_chain_confidence`: the candidates are `with_anchor`'s, and slot k's raw is
    `confidence_raw` of draft row k with the token before it (the anchor for slot 0): the same
    body (`gather.confidence_rows`, summed in an order no warp count or row count changes), so the
    same bits. Over a PendingNorm's rows too, and with one vocabulary tile or several. Planted:
    scoring with each slot's own pick (the token after it) gives other raws, so the check can
    tell."""
    from memra_kernels.dense_linear import PendingNorm
    from memra_kernels.gather import confidence_raw
    from memra_kernels.markov import markov_chain_confidence

    n, H, r, dtype = 15, 96, 16, torch.bfloat16
    logits, anchor, w1, w2 = _inputs(n, V, r, V, dtype, device, seed=6)  # slots pick apart: the previous tokens vary
    table = bias_table(w1, w2, dtype)
    g = torch.Generator().manual_seed(7)
    rows = (torch.randn(n, H, generator=g) * 2).to(dtype).to(device)
    hidden = rows
    if pending:
        sumsq = torch.stack([rows[:, j:j + 32].float().square().sum(1) for j in range(0, H, 32)], 1).contiguous()
        hidden = PendingNorm(rows, sumsq, (1 + 0.2 * torch.randn(H, generator=g)).to(dtype).to(device), 1e-6)
    conf_w1 = (torch.randn(V, r, generator=g) / 4).to(dtype).to(device) if markov_features else None
    conf_w = torch.randn(H + (r if markov_features else 0), generator=g).to(device)
    conf_b = torch.randn(1, generator=g).to(device)
    cand, raws = markov_chain_confidence(logits, anchor, w1, w2, dtype, table, hidden, conf_w, conf_b, conf_w1)
    assert torch.equal(cand, markov_chain(logits, anchor, w1, w2, dtype, table=table, with_anchor=True))
    assert len(set(cand.tolist())) > 3
    prev = cand[:-1] if markov_features else None
    want = confidence_raw(hidden, conf_w, conf_b, prev, conf_w1)
    assert raws.dtype == torch.float32 and raws.shape == (n,)
    assert torch.equal(raws, want)
    if markov_features:
        after = confidence_raw(hidden, conf_w, conf_b, cand[1:], conf_w1)
        assert not torch.allclose(raws, after, rtol=1e-5, atol=1e-4)


def test_the_chain_scores_its_slots_only_over_a_table_and_refuses_a_mismatch(device):
    from memra_kernels.markov import markov_chain_confidence

    logits, anchor, w1, w2 = _inputs(4, 50, 8, 50, torch.float32, device)
    table = bias_table(w1, w2, torch.float32)
    w, b = torch.ones(16, device=device), torch.zeros(1, device=device)
    with pytest.raises(ValueError, match="not the chain's slots"):
        markov_chain_confidence(logits, anchor, w1, w2, torch.float32, table, torch.ones(5, 16, device=device), w, b)
    with pytest.raises(ValueError, match="bias table"):
        markov_chain(logits, anchor, w1, w2, torch.float32, None, _conf={"WITH_CONF": True})
    cand, raws = markov_chain_confidence(logits[:0], anchor, w1, w2, torch.float32, table,
                                         torch.ones(0, 16, device=device), w, b)
    assert cand.tolist() == [anchor.item()] and raws.shape == (0,)


def test_slots_too_wide_for_one_tile_are_scored_by_the_heads_launch(monkeypatch, device):
    """Where next_pow2(n) x the head's column block passes CONF_TILE_MAX the chain does not score
    its slots (they would spill): the head's own launch does, with the same bits."""
    from memra_kernels import markov
    from memra_kernels.gather import confidence_raw

    logits, anchor, w1, w2 = _inputs(6, 300, 8, 300, torch.float32, device, seed=8)
    table = bias_table(w1, w2, torch.float32)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(6, 64, generator=g).to(device)
    w, b = torch.randn(72, generator=g).to(device), torch.randn(1, generator=g).to(device)
    fused = markov.markov_chain_confidence(logits, anchor, w1, w2, torch.float32, table, hidden, w, b, w1)
    launched = []
    real = markov._markov_table_kernel
    monkeypatch.setattr(markov, "CONF_TILE_MAX", 8 * 64 - 1)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs.get("WITH_CONF", False))
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(markov, "_markov_table_kernel", Spy())
    apart = markov.markov_chain_confidence(logits, anchor, w1, w2, torch.float32, table, hidden, w, b, w1)
    assert launched == [False]
    assert torch.equal(apart[0], fused[0]) and torch.equal(apart[1], fused[1])
    assert torch.equal(fused[1], confidence_raw(hidden, w, b, fused[0][:-1], w1))
