"""The expert-priced verify window (engine/spec/priced.py) and its simulation script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memra_cli.engine.spec.priced import (StepCost, accepted_runs_alpha, accepted_runs_survival, expected_committed,
                                          geometric_survival, priced_vt, qwen3_moe_cost, routed_unions,
                                          survival_from_raws)

ROOT = Path(__file__).resolve().parents[2]
A3B = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, num_experts=128, top_k=8,
           moe_intermediate=768)


def test_the_a3b_shape_reads_what_the_issue_computes():
    """128·(1 − (120/128)^16) ≈ 82.4 experts per layer at 16 rows; ~6.1 GB a plain step, ~39.8 GB
    a 16-row verify (bf16 weights; the issue's 6.0 / 39.7 GB round the attention differently)."""
    cost = qwen3_moe_cost(**A3B)
    assert cost.expected_union(1) == pytest.approx(8.0)
    assert cost.expected_union(16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert 6.0e9 < cost.bytes(1) < 6.2e9 and 39.6e9 < cost.bytes(16) < 40.0e9


def test_a_flat_cost_keeps_the_full_window():
    """Dense target: every row is free, so any draft with a chance to survive is worth its row —
    the fixed window at the cap, as the other policies assume."""
    dense = qwen3_moe_cost(**{**A3B, "num_experts": 0, "top_k": 0, "dense_intermediate": 6144})
    assert dense.is_flat and dense.bytes(1) == dense.bytes(16)
    for alpha in (0.2, 0.6, 0.95):
        assert priced_vt(geometric_survival(alpha, 15), dense, 16) == 16


def test_the_priced_window_is_the_best_rate_by_hand():
    cost = StepCost(fixed_bytes=10.0, expert_bytes=1.0, sparse_layers=1, num_experts=4, top_k=2)
    survival = [0.9, 0.5, 0.02]
    rates = {vt: expected_committed(survival, vt) / cost.bytes(vt) for vt in (2, 3, 4)}
    # bytes 10 + 4(1 − 0.5^vt) = 13, 13.5, 13.75; tokens 1.9, 2.4, 2.42: rates .146, .178, .176
    assert rates[3] > rates[4] > rates[2]
    assert priced_vt(survival, cost, 4) == 3
    assert priced_vt(survival, cost, 2) == 2  # the cap bounds it
    assert priced_vt([0.0, 0.0], cost, 3) == 2  # nothing survives: the narrowest window


def test_survival_from_raws_is_the_cumulative_sigmoid():
    s = survival_from_raws([0.0, 0.0, -1000.0])
    assert s == [0.5, 0.25, 0.0]


def test_the_accepted_runs_fit_counts_kept_drafts_against_rejecting_rounds():
    """Uniform prior: no rounds yet 1/2; 6 drafts kept over rounds of which 2 ended on a
    rejection: 7/10 (a round that kept all its drafts adds no rejection)."""
    assert accepted_runs_alpha(0, 0) == 0.5
    assert accepted_runs_alpha(6, 2) == pytest.approx(0.7)
    assert accepted_runs_survival(0, 0, 3) == [0.5, 0.25, 0.125]
    assert accepted_runs_alpha(100, 1) > 0.98 and accepted_runs_alpha(0, 100) < 0.01


def test_the_fitted_survival_prices_a_window_by_hand():
    cost = StepCost(fixed_bytes=10.0, expert_bytes=4.0, sparse_layers=1, num_experts=4, top_k=2)
    # bytes 10 + 16(1 - 0.5^vt): vt 2, 3, 4 -> 22, 24, 25. No runs (a = 1/2): tokens 1.5, 1.75,
    # 1.875, rates .0682, .0729, .0750: the widest. Runs fitting a = 1/11 (0 kept, 9 rejected):
    # tokens 1.0909, 1.0992, 1.0999, rates .0496, .0458, .0440: the narrowest
    assert priced_vt(accepted_runs_survival(0, 0, 3), cost, 4) == 4
    assert priced_vt(accepted_runs_survival(0, 9, 3), cost, 4) == 2
    assert priced_vt(accepted_runs_survival(3, 9, 15), StepCost(fixed_bytes=1.0), 16) == 16  # flat: the cap


def _unions_by_hand(routing, vt):
    """The mean union of vt consecutive tokens' expert sets, every window of every layer."""
    sizes = [len(set().union(*(set(row) for row in ids.tolist()[t:t + vt])))
             for ids in routing for t in range(ids.shape[0] - vt + 1)]
    return sum(sizes) / len(sizes)


def test_routed_unions_count_consecutive_tokens_of_each_layer():
    """Windows slide over tokens (axis 0) within a layer: a union over the k axis, across
    layers or over non-consecutive tokens gives other numbers here."""
    a = torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3], [0, 4]])
    b = torch.tensor([[5, 6], [7, 0], [5, 6], [7, 0], [5, 6]])
    got = routed_unions([a, b], 4)
    # vt = 2: layer a {0,1} {0,1,2,3} {2,3} {0,2,3,4} -> 2,4,2,4; layer b 4,4,4,4: mean 28/8
    assert got[0] == 2.0 and got[1] == 3.5
    assert list(got) == pytest.approx([_unions_by_hand([a, b], v) for v in range(1, 5)], rel=0, abs=1e-15)
    # the wrong axes give other numbers at vt = 2: windows over the k columns of a layer's
    # tokens read a's {0,1,2,3,4} and b's {0,5,6,7} (4.5); windows over the two layers at one
    # token read 4, 4, 4, 4, 4 (4.0); a union of one token per window (a stride) stays 2
    assert routed_unions([a[:2], b[:2]], 2)[1] == 3.0  # {0,1} and {0,5,6,7}: only the layer's own tokens
    with pytest.raises(ValueError, match="routing of 5 tokens cannot measure a 6-row union"):
        routed_unions([a], 6)


def test_neighbours_that_share_experts_read_fewer_than_independent_routing():
    """A router rigged so each run of 4 tokens shares its experts reads about a quarter of the
    union independent routing predicts at 16 rows; random routing matches the shape model."""
    e, k, n = 64, 4, 400
    gen = torch.Generator().manual_seed(0)
    independent = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    shared = independent[::4].repeat_interleave(4, dim=0)
    shape = StepCost(fixed_bytes=1.0, expert_bytes=1.0, sparse_layers=1, num_experts=e, top_k=k)
    free, tied = routed_unions([independent], 16), routed_unions([shared], 16)
    assert free[15] == pytest.approx(shape.expected_union(16), rel=0.05)
    assert tied[15] < 0.5 * free[15] and tied[3] < free[3]
    routed = StepCost(1.0, 1.0, 1, e, k, unions=tied)
    assert routed.model == "routed" and routed.bytes(16) == 1.0 + tied[15] < shape.bytes(16)


def test_the_simulation_script_prints_and_writes_its_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "sim.json"
    measured = ROOT / "docs" / "results" / "h100-moe-step-a3b-expert-grid.json"  # graphed step times
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_window_sim.py"), "--json", str(out),
                           "--measured", str(measured)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("SIMULATION")
    rows = json.loads(out.read_text())["rows"]
    moe = [r for r in rows if r["shape"] == "Qwen3-30B-A3B"]
    dense = [r for r in rows if r["shape"] == "Qwen3-8B (dense)"]
    timed = [r for r in rows if "measured" in r["shape"]]
    assert moe and dense and len(timed) == len(moe)
    for r in timed:  # priced by the measured curve: beats the ladder everywhere, fixed-16 where a
        sp = r["speedup"]  # wider window still costs more per token (the published drafters)
        assert sp["priced"] > sp["ladder"] and sp["priced"] >= sp["fixed-16"]
        if not r["profile"].startswith("synthetic"):
            assert sp["priced"] > sp["fixed-16"] and r["priced_vt"] < 16
    for r in moe:  # the issue's bar: the expert-priced window beats fixed-16 and the ladder, with
        sp = r["speedup"]  # a confidence head or without one (the window fitted to the accepted runs)
        assert sp["priced"] > max(sp["fixed-16"], sp["ladder"])
        assert sp["priced"] >= sp["priced-accepted-runs"] > max(sp["fixed-16"], sp["ladder"])
    # one round's run alone narrows a steep cost's window to 2 rows for good: a stronger drafter loses
    strong = next(r for r in moe if r["profile"].startswith("synthetic"))
    assert strong["speedup"]["priced-last-run"] < strong["speedup"]["ladder"] < strong["speedup"]["priced-accepted-runs"]
    for r in dense:  # flat cost: the priced window is the fixed one; without a head, the ladder
        assert r["priced_vt"] == 16 and r["speedup"]["priced"] == pytest.approx(r["speedup"]["fixed-16"])
        assert r["speedup"]["priced-accepted-runs"] == r["speedup"]["ladder"]
    assert json.loads((ROOT / "docs" / "results" / "moe-window-sim.json").read_text())["rows"] == rows


def test_a_measured_cost_curve_is_read_and_interpolated(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from moe_window_sim import MeasuredCost
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    good = tmp_path / "step.json"
    good.write_text(json.dumps({"rows": [{"vt": v, "graph_ms": 1.0 + v, "experts_per_layer": 2.0 * v}
                                         for v in (1, 4, 16)] + [{"vt": 2, "graph_ms": None, "experts_per_layer": 3},
                                                                 {"vt": 1, "width": 16, "graph_ms": 2.5,
                                                                  "experts_per_layer": 2.0}]}))
    cost = MeasuredCost.from_moe_step(good)  # the engine's fixed-width row wins where there is one
    assert cost.vts == (1, 4, 16) and cost.bytes(1) == 2.5 and cost.bytes(10) == pytest.approx(11.0)
    assert cost.expected_union(2) == pytest.approx(4.0) and not cost.is_flat
    assert cost.plain() == 2.5  # no plain round's step timed: a one-row verify's
    rows = json.loads(good.read_text())["rows"] + [{"vt": 1, "width": 16, "reads": 1, "graph_ms": 2.0,
                                                     "experts_per_layer": 2.0}]
    good.write_text(json.dumps({"rows": rows}))
    cost = MeasuredCost.from_moe_step(good)  # the plain round's step: the plain cost, never a verify's
    assert cost.bytes(1) == 2.5 and cost.plain() == 2.0
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"rows": [{"vt": 1, "graph_ms": 1.0, "experts_per_layer": 8}]}))
    with pytest.raises(ValueError, match="vt = 1 to 16"):
        MeasuredCost.from_moe_step(short)


def test_the_device_settle_prices_the_window_the_host_prices():
    """memra_kernels.settle_ref (the torch settle_round; the kernel is tested against it) against
    the host's policy (VerifyWindow.size_window / next_window) on random raws, runs, caps and
    expert shapes: the same window, and the runs carried on as the host's Session counts them."""
    from memra_cli.engine.spec.policy import VerifyWindow
    from memra_kernels.settle_ref import settle_round

    gen = torch.Generator().manual_seed(5)
    sel = torch.arange(17)
    seen = set()
    for trial in range(120):
        cap = (2, 3, 9, 17)[trial % 4]
        cost = StepCost(fixed_bytes=1.0 + 30 * float(torch.rand(1, generator=gen)), expert_bytes=1.0,
                        sparse_layers=2, num_experts=16, top_k=(1, 2, 4)[trial % 3])
        table = torch.tensor([cost.bytes(v) for v in range(1, cap + 1)], dtype=torch.float64)
        cand = torch.cat([sel[:1], sel[: 16]])  # every draft agrees: m is the window's
        raws = (torch.randn(16, generator=gen) * 2 + 2).float()
        priced = VerifyWindow("priced", 0.5, cost=cost)
        out = settle_round(cand, sel, raws, torch.tensor([0, 0, 0, 2, 1000]), None, kind="priced", cap=cap,
                           adapt=True, cost=table)
        assert int(out[-2]) == priced.size_window(raws.double().tolist(), cap), trial
        seen.add(int(out[-2]))
        fitted = VerifyWindow("priced", None, cost=cost, survival="accepted-runs")
        kept, rejected, vt = (int(x) for x in torch.randint(0, 30, (3,), generator=gen))
        vt = 2 + vt % (cap - 1)
        agree = int(torch.randint(0, vt, (1,), generator=gen))  # drafts 0..agree-1 accepted
        cand = sel.clone()[: cap + 1] + 100
        cand[1: agree + 1] = sel[:agree]
        inputs = torch.tensor([0, 0, 0, vt, 1000, kept, rejected])
        settle_round(cand, sel[: cap + 1], None, inputs, None, kind="priced-runs", cap=cap, adapt=True, cost=table)
        m = min(agree, vt - 1)
        runs = (kept + m, rejected + (m < vt - 1))
        assert inputs[5:].tolist() == list(runs)
        assert int(inputs[3]) == fitted.next_window(m, cap, runs=runs), trial
    assert len(seen) >= 4  # windows of several widths were compared
