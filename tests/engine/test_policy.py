"""Harvest and verify-window policy: every case the spec's unit tests pin, plus properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cli.engine.errors import PolicyError
from memra_cli.engine.spec.policy import (
    LADDER,
    Harvest,
    PolicySettings,
    VerifyWindow,
    confidence_vt,
    ladder_next,
    parse_harvest,
    parse_verify_cap,
    parse_verify_window,
    resolve_harvest,
    resolve_receipts,
    resolve_verify_window,
    slot_confidence_vt,
)
from memra_cli.engine.spec.sampling import accept_prefix

B = 7  # the spec's block size in its fixtures


def logit(p: float) -> float:
    return math.log(p / (1 - p))


# ---------------------------------------------------------------- harvest (dspark_harvest_tests)


def test_dspark_strategy_requires_shifted_harvest():
    h = Harvest.DSPARK
    assert h.first_row == 0
    assert h.n_drafts(B) == B
    assert [h.trained_offset_of_row(r) for r in range(B)] == list(range(1, B + 1))


def test_dflash_strategy_keeps_mask_fill_harvest():
    h = Harvest.DFLASH
    assert h.first_row == 1
    assert h.n_drafts(B) == B - 1
    assert [h.trained_offset_of_row(r) for r in range(1, B)] == list(range(1, B))


@pytest.mark.parametrize("h", list(Harvest))
def test_every_candidate_verifies_the_position_its_row_was_trained_for(h):
    for i in range(1, h.n_drafts(B) + 1):
        assert h.trained_offset_of_row(h.first_row + i - 1) == i


def test_env_seam_parses_and_refuses():
    assert parse_harvest(None) is Harvest.DFLASH
    assert parse_harvest("") is Harvest.DFLASH
    assert parse_harvest("dspark") is Harvest.DSPARK
    assert parse_harvest("dflash") is Harvest.DFLASH
    with pytest.raises(PolicyError, match="harvest='shifted'"):
        parse_harvest("shifted")
    assert Harvest.from_name("dspark") is Harvest.DSPARK
    assert Harvest.from_name("dflash") is Harvest.DFLASH
    assert Harvest.from_name("mask-fill") is None


def test_ratified_default_harvest_is_strategy_keyed():
    assert resolve_harvest(None, True) is Harvest.DSPARK
    assert resolve_harvest(None, False) is Harvest.DFLASH
    assert resolve_harvest("", False) is Harvest.DFLASH
    assert resolve_harvest("dflash", True) is Harvest.DFLASH
    assert resolve_harvest("dspark", False) is Harvest.DSPARK
    with pytest.raises(PolicyError):
        resolve_harvest("shifted", True)


def test_ratified_default_vt_is_confidence_slot_tau_half():
    assert resolve_verify_window(None, None, None, True) == VerifyWindow("confidence-slot", 0.5)
    assert resolve_verify_window(None, "0.35", None, True) == VerifyWindow("confidence-slot", 0.35)
    with pytest.raises(PolicyError, match="tau='nan-ish'"):
        resolve_verify_window(None, "nan-ish", None, True)
    assert resolve_verify_window(None, None, None, False) == LADDER
    assert resolve_verify_window(None, None, "0", True) == LADDER
    assert resolve_verify_window("ladder", None, None, True) == LADDER
    assert resolve_verify_window("confidence", "0.35", None, True) == VerifyWindow("confidence", 0.35)
    with pytest.raises(PolicyError, match="contradictory"):
        resolve_verify_window("confidence-slot", None, "0", True)


def test_dspark_trained_rows_through_mask_fill_harvest_accept_nothing():
    base = 1000
    anchor = base
    vam = [base + j for j in range(1, B + 2)]

    def row_argmax(r: int) -> int:  # a drafter trained under the DSpark strategy
        return base + Harvest.DSPARK.trained_offset_of_row(r)

    right = Harvest.DSPARK
    cand = [anchor] + [row_argmax(right.first_row + i - 1) for i in range(1, right.n_drafts(B) + 1)]
    vt = right.n_drafts(B) + 1
    assert accept_prefix(cand, vam, vt) == vt - 1
    wrong = Harvest.DFLASH
    cand = [anchor] + [row_argmax(wrong.first_row + i - 1) for i in range(1, wrong.n_drafts(B) + 1)]
    assert accept_prefix(cand, vam, wrong.n_drafts(B) + 1) == 0


# ---------------------------------------------------------------- window sizing (dspark_vt_tests)

SURVIVAL_RAWS = [logit(p) for p in (0.9, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9)]


def test_confidence_vt_is_cumprod_survival_not_per_slot_threshold():
    assert confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 6
    assert confidence_vt(SURVIVAL_RAWS, 0.7, 8) == 3
    assert confidence_vt(SURVIVAL_RAWS, 0.05, 8) == 8


def test_slot_arm_truncates_at_first_low_confidence_slot():
    assert slot_confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 8
    assert confidence_vt(SURVIVAL_RAWS, 0.5, 8) == 6
    tail = [logit(p) for p in (0.9, 0.9, 0.3, 0.9, 0.9, 0.9, 0.9)]
    assert slot_confidence_vt(tail, 0.5, 8) == 3
    assert slot_confidence_vt(tail, 0.95, 8) == 2


def test_confidence_vt_floor_and_cap():
    cold = [logit(0.1)] * 3
    assert confidence_vt(cold, 0.5, 8) == 2
    assert slot_confidence_vt(cold, 0.5, 8) == 2
    hot = [logit(0.99)] * 7
    assert confidence_vt(hot, 0.5, 5) == 5
    assert confidence_vt(hot, 0.5, 8) == 8
    assert slot_confidence_vt(hot, 0.5, 5) == 5
    assert confidence_vt([], 0.5, 8) == 2
    assert slot_confidence_vt([], 0.5, 8) == 2


def test_vt_policy_env_seam_parses_and_refuses():
    assert parse_verify_window(None, None, None) == LADDER
    assert parse_verify_window("", None, None) == LADDER
    assert parse_verify_window("ladder", None, "0") == LADDER
    assert parse_verify_window("confidence", None, None) == VerifyWindow("confidence", 0.5)
    assert parse_verify_window("confidence", "0.35", "1") == VerifyWindow("confidence", 0.35)
    assert parse_verify_window("confidence-slot", "0.6", None) == VerifyWindow("confidence-slot", 0.6)
    with pytest.raises(PolicyError, match="together with adapt='0'"):
        parse_verify_window("confidence-slot", None, "0")
    with pytest.raises(PolicyError, match="vt='static': unknown verify-window policy"):
        parse_verify_window("static", None, None)
    with pytest.raises(PolicyError):
        parse_verify_window("confidence", None, "0")
    for bad in ["0", "1", "1.5", "-0.1", "nan"]:
        with pytest.raises(PolicyError, match=f"tau='{bad}'"):
            parse_verify_window("confidence", bad, None)


def test_window_names_match_the_receipt_shape():
    assert str(LADDER) == "Ladder"
    assert str(VerifyWindow("confidence", 0.35)) == "Confidence{tau=0.35}"
    assert str(VerifyWindow("confidence-slot", 0.5)) == "ConfidenceSlot{tau=0.5}"
    assert LADDER.size_window([5.0], 8) is None
    assert VerifyWindow("confidence", 0.5).size_window(SURVIVAL_RAWS, 8) == 6


# ---------------------------------------------------------------- stricter than the spec


def test_a_bad_tau_is_refused_even_where_the_ladder_would_ignore_it():
    with pytest.raises(PolicyError, match="tau='1.5'"):
        resolve_verify_window(None, "1.5", None, False)


def test_adapt_values_are_validated():
    assert resolve_verify_window(None, None, "false", True) == LADDER
    assert resolve_verify_window(None, None, "1", True).kind == "confidence-slot"
    with pytest.raises(PolicyError, match="adapt='maybe'"):
        resolve_verify_window("ladder", None, "maybe", True)


def test_ladder_and_cap():
    assert [ladder_next(m, 8) for m in range(8)] == [3, 3, 4, 5, 6, 7, 8, 8]
    assert parse_verify_cap(None, 7) == 8
    assert parse_verify_cap("4", 7) == 4
    for bad in ("1", "9", "x"):
        with pytest.raises(PolicyError, match="verify_cap="):
            parse_verify_cap(bad, 7)


def test_accept_prefix_stops_at_first_miss_and_at_the_window():
    assert accept_prefix([0, 1, 2, 9, 4], [1, 2, 3, 4, 5], 5) == 2
    assert accept_prefix([0, 1, 2, 3, 4], [1, 2, 3, 4, 5], 3) == 2
    assert accept_prefix([0, 7], [1, 2], 2) == 0


def test_receipts_lines_and_json():
    r = resolve_receipts(PolicySettings(vt="confidence", tau="0.35"), True, True)
    assert r.lines() == [
        "[dspark] harvest=dspark (checkpoint census strategy_dspark=true, MEMRA_DSPARK_HARVEST unset)",
        "[dspark] verify-window=Confidence{tau=0.35} (accept-rate head present, MEMRA_DSPARK_VT set)",
    ]
    assert r.as_json() == {"harvest": "dspark", "verify_window": {"policy": "confidence", "tau": 0.35}}
    r = resolve_receipts(PolicySettings(harvest="dspark"), False, False)
    assert r.lines()[0].endswith("strategy_dspark=false, MEMRA_DSPARK_HARVEST set)")
    assert r.lines()[1] == "[dflash] verify-window=Ladder (accept-rate head ABSENT -> ladder, MEMRA_DSPARK_VT unset)"


# ---------------------------------------------------------------- properties

raws_st = st.lists(st.floats(-30, 30, allow_nan=False), max_size=16)
threshold_st = st.floats(0.001, 0.999)
cap_st = st.integers(2, 17)


@settings(max_examples=300, deadline=None)
@given(raws_st, threshold_st, cap_st)
def test_survival_window_never_exceeds_slot_window_and_stays_in_bounds(raws, threshold, cap):
    surv, slot = confidence_vt(raws, threshold, cap), slot_confidence_vt(raws, threshold, cap)
    assert 2 <= surv <= cap and 2 <= slot <= cap
    assert surv <= slot  # survival <= each slot's own sigmoid


@settings(max_examples=300, deadline=None)
@given(raws_st, threshold_st, threshold_st, cap_st)
def test_windows_shrink_as_the_threshold_grows(raws, t1, t2, cap):
    lo, hi = min(t1, t2), max(t1, t2)
    assert confidence_vt(raws, hi, cap) <= confidence_vt(raws, lo, cap)
    assert slot_confidence_vt(raws, hi, cap) <= slot_confidence_vt(raws, lo, cap)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=12), st.data())
def test_accept_prefix_is_the_longest_matching_prefix(cand, data):
    vam = data.draw(st.lists(st.integers(0, 3), min_size=len(cand), max_size=len(cand)))
    vt = data.draw(st.integers(1, len(cand)))
    m = accept_prefix(cand, vam, vt)
    assert 0 <= m <= vt - 1
    assert cand[1 : m + 1] == vam[:m]
    if m < vt - 1:
        assert cand[m + 1] != vam[m]
