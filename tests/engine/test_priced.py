"""The expert-priced verify window (engine/spec/priced.py) and its simulation script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memra_cli.engine.spec.priced import (StepCost, expected_committed, geometric_survival, priced_vt,
                                          qwen3_moe_cost, survival_from_raws)

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


def test_the_simulation_script_prints_and_writes_its_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_window_sim.py"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("SIMULATION")
    rows = json.loads(out.read_text())["rows"]
    moe = [r for r in rows if r["shape"] == "Qwen3-30B-A3B"]
    dense = [r for r in rows if r["shape"] != "Qwen3-30B-A3B"]
    assert moe and dense
    for r in moe:  # the issue's bar: the expert-priced window beats fixed-16 and the ladder
        assert r["speedup"]["priced"] > max(r["speedup"]["fixed-16"], r["speedup"]["ladder"])
    for r in dense:  # flat cost: the priced window is the fixed one
        assert r["priced_vt"] == 16 and r["speedup"]["priced"] == pytest.approx(r["speedup"]["fixed-16"])
    assert json.loads((ROOT / "docs" / "results" / "moe-window-sim.json").read_text())["rows"] == rows
