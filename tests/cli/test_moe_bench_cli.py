"""`memra bench` over a Qwen3-MoE target reports rows verified and experts run per round beside
tau; over a dense target it reports none. Registered on a local app (app.py wiring is the lead's)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from memra_cli.cli import bench as bench_cli
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
from memra_cli.tiny.target import make_tiny_qwen3

app = typer.Typer(pretty_exceptions_enable=False)
app.command(name="bench")(bench_cli.bench)
app.command(name="unused")(lambda: None)  # two commands: typer keeps `bench` as a subcommand


def test_bench_reports_rows_and_experts_per_round_for_an_moe_target_only(tmp_path):
    draft = make_tiny_draft(tmp_path / "dflash", "zlab")
    arms = {}
    for name, make in (("moe", make_tiny_qwen3_moe), ("dense", make_tiny_qwen3)):
        target = make(tmp_path / name, tokenizer=True)
        r = CliRunner().invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--arm", "dflash",
                                     "--arm", "dflash:vt=priced,vt_cost=routed",
                                     "--prompts", "mbpp", "--n", "2", "--max-new", "24", "--warmup", "0", "--json"])
        assert r.exit_code == 0, r.output
        arms[name] = {a["name"]: a for a in json.loads(r.stdout)["arms"]}
    assert all(a["moe"] is None for a in arms["dense"].values())
    arm = arms["moe"]["dflash"]
    m = arm["moe"]
    assert m["rows_per_round"] == pytest.approx((arm["drafted"] + arm["rounds"]) / arm["rounds"])
    # the tiny MoE routes top-2 of 8 on 3 sparse layers: a call runs 2..8 experts, a round >= 3 * 2
    assert 2 <= m["experts_per_layer_step"] <= 8 and m["experts_per_round"] >= 6
    assert arms["moe"]["plain"]["moe"]["rows_per_round"] is None  # plain has no rounds to verify
    # the priced arm on the ladder's prior, each prompt priced by its own routing; on the dense
    # target the same arm is the ladder (flat cost) and measures nothing
    priced = arms["moe"]["dflash:vt=priced,vt_cost=routed"]
    assert priced["exact"] is True and priced["window_costs"] == {"routed": 2}
    assert "survival=accepted-runs,cost=routed" in priced["receipt_lines"][1]
    dense = arms["dense"]["dflash:vt=priced,vt_cost=routed"]
    assert dense["window_costs"] is None and "priced -> ladder (flat step cost" in dense["receipt_lines"][1]
