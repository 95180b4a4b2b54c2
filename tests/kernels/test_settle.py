"""The chained round's settlement kernel (memra_kernels.settle) against its torch twin
(kernels/settle_ref.py): every window kind, adapt on and off, caps, budgets that cut
the window, odd widths and partial agreement; the packed output and the rewritten inputs must
be equal, value for value (they are integers and float32 raws widened exactly)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.settle import settle_round, settle_round_ref  # noqa: E402


def _case(gen, w, nd, agree_upto):
    """cand / sel agreeing on drafts 0..agree_upto-1 (cand[j+1] == sel[j]), not on draft
    agree_upto, and on about half of the drafts after it (only the leading run counts)."""
    sel = torch.randint(0, 1000, (w,), generator=gen)
    cand = torch.randint(1000, 2000, (w,), generator=gen)  # never equal to a pick
    cand[1: agree_upto + 1] = sel[:agree_upto]
    later = torch.arange(agree_upto + 1, max(agree_upto + 1, w - 1))
    later = later[torch.rand(later.shape[0], generator=gen) < 0.5]
    cand[later + 1] = sel[later]
    raws = (torch.randn(nd, generator=gen) * 1.5 + 3.0).float() if nd else None  # sigmoids ~0.95, some low
    return cand, sel, raws


def _cost(gen, cap):
    """A step cost of 1..cap rows (float64 [cap]): a fixed part and an expert union that grows
    with the rows and saturates, at a random scale (the shape of spec/priced.py's)."""
    fixed, expert = 1.0 + 9.0 * float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen)) * 4.0
    return torch.tensor([fixed + expert * 8 * (1 - 0.75 ** v) for v in range(1, cap + 1)], dtype=torch.float64)


@pytest.mark.parametrize("kind", ["ladder", "confidence", "confidence-slot", "priced", "priced-runs"])
@pytest.mark.parametrize("adapt", [True, False])
def test_settle_kernel_equals_its_twin(kind, adapt, device):
    gen = torch.Generator().manual_seed(11)
    seen_m = set()
    for trial in range(40):
        w = (16, 7, 17, 2)[trial % 4]
        nd = 0 if kind in ("ladder", "priced-runs") else max(1, w - (trial % 2))
        cand, sel, raws = _case(gen, w, nd, int(torch.randint(0, w, (1,), generator=gen)))
        cap = int(torch.randint(2, w + 1, (1,), generator=gen)) if w > 2 else 2
        runs = [int(x) for x in torch.randint(0, 40, (2,), generator=gen)] if kind == "priced-runs" else []
        inputs = torch.tensor([100 + trial, 50 + trial, 7, int(torch.randint(max(2, cap - 2), cap + 1, (1,), generator=gen)),
                               (1000, 3, 1, 0)[trial % 4]] + runs)
        threshold = torch.tensor([(0.3, 0.5, 0.8)[trial % 3]], dtype=torch.float64)
        cost = _cost(gen, cap) if kind.startswith("priced") else None
        args = dict(kind=kind, cap=cap, adapt=adapt)
        ref_inputs = inputs.clone()
        ref = settle_round_ref(cand, sel, raws, ref_inputs, threshold, cost=cost, **args)
        dev_inputs = inputs.to(device)
        got = settle_round(cand.to(device), sel.to(device), None if raws is None else raws.to(device), dev_inputs,
                           threshold.to(device), cost=None if cost is None else cost.to(device), **args)
        assert torch.equal(got.cpu(), ref), (trial, got, ref)
        assert torch.equal(dev_inputs.cpu(), ref_inputs), (trial, dev_inputs, ref_inputs)
        seen_m.add(int(ref[-1]))
    assert len(seen_m) >= 4  # partial acceptance of several lengths, not only 0


@pytest.mark.parametrize("w", [16, 5])
def test_settle_writes_the_replay_restore_rows_like_its_twin(w, device):
    """With `restore=`: the ring rows a replay restore re-runs, `[t_start % ring, m + 1]`, and
    rows -1 when every row is kept (the step wrote that state), every m from 0 to W - 1."""
    gen = torch.Generator().manual_seed(w)
    ring = 24
    for m_want in range(w):
        cand, sel, _ = _case(gen, w, 0, m_want)
        if m_want == w - 1:
            cand[1:] = sel[:-1]  # every draft agrees
        t_start = 37 + m_want
        inputs = torch.tensor([t_start, 5, 0, w, 1000])
        ref_restore = torch.full((2,), 99, dtype=torch.int32)
        ref = settle_round_ref(cand, sel, None, inputs.clone(), None, kind="ladder", cap=w, adapt=False,
                               restore=ref_restore, ring=ring)
        got_restore = torch.full((2,), 99, dtype=torch.int32, device=device)
        got = settle_round(cand.to(device), sel.to(device), None, inputs.to(device), None, kind="ladder", cap=w,
                           adapt=False, restore=got_restore, ring=ring)
        assert int(ref[-1]) == m_want and torch.equal(got.cpu(), ref)
        kept = -1 if m_want + 1 == w else m_want + 1
        assert ref_restore.tolist() == [t_start % ring, kept] == got_restore.cpu().tolist(), m_want


def test_settle_refuses_bad_arguments():
    cand = sel = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="kind must be one of"):
        settle_round_ref(cand, sel, None, torch.zeros(5, dtype=torch.long), None, kind="wide", cap=4, adapt=True)
    with pytest.raises(ValueError, match="needs contiguous float32 raws"):
        settle_round_ref(cand, sel, None, torch.zeros(5, dtype=torch.long), None, kind="confidence", cap=4, adapt=True)
    with pytest.raises(ValueError, match="threshold as a float64"):
        settle_round_ref(cand, sel, torch.zeros(3), torch.zeros(5, dtype=torch.long), torch.zeros(1), kind="confidence",
                         cap=4, adapt=True)
    with pytest.raises(ValueError, match="inputs must be"):
        settle_round_ref(cand, sel, None, torch.zeros(4, dtype=torch.long), None, kind="ladder", cap=4, adapt=True)
    with pytest.raises(ValueError, match=r"inputs must be \[7\]"):  # priced-runs carries the runs too
        settle_round_ref(cand, sel, None, torch.zeros(5, dtype=torch.long), None, kind="priced-runs", cap=4, adapt=True,
                         cost=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"cost as a contiguous float64 \[4\] tensor"):
        settle_round_ref(cand, sel, torch.zeros(3), torch.zeros(5, dtype=torch.long), None, kind="priced", cap=4,
                         adapt=True, cost=torch.ones(3, dtype=torch.float64))
    five = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="restore must be int32"):
        settle_round_ref(cand, sel, None, five, None, kind="ladder", cap=4, adapt=True, restore=five[:2], ring=8)
    with pytest.raises(ValueError, match="a ring of at least the round's 4 rows, got 2"):
        settle_round_ref(cand, sel, None, five, None, kind="ladder", cap=4, adapt=True,
                         restore=torch.zeros(2, dtype=torch.int32), ring=2)
