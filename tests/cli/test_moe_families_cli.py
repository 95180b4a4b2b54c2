"""The Qwen3.5 MoE hybrid and Gemma 4's MoE block through the CLI: `python -m memra_cli.tiny OUT`
writes each with a z-lab DFlash drafter; `memra generate` gives the plain stream (`--spec off`)
token for token and says why graphs are off (not on CUDA); `memra census` reads each drafter; `memra parity`
reads the target's tables; `memra bench` reports experts run per round; a config routing more
experts than it has exits 2 in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.base import load_target
from memra_cli.tiny.__main__ import GEMMA4_DRAFT_TAPS, QWEN35_DRAFT_TAPS, main as tiny_main

runner = CliRunner()
IDS = "5,17,42,99,3,250"
FAMILIES = {"qwen3_5_moe": QWEN35_DRAFT_TAPS, "gemma4_moe": GEMMA4_DRAFT_TAPS}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinymoe")
    assert tiny_main([str(root)]) == 0
    return root


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_spec_equals_plain_and_census_reads_the_drafter(tiny, family):
    target, draft = tiny / family, tiny / f"{family}_dflash"
    common = ("--target", target, "--draft", draft, "--prompt-ids", IDS, "--max-new", "32", "--json")
    spec, plain = run("generate", *common), run("generate", *common, "--spec", "off")
    assert spec.exit_code == 0 and plain.exit_code == 0, (spec.output, plain.output)
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["mode"] == "dflash" and s["tokens"] == p["tokens"] and len(s["tokens"]) == 32
    assert s["stats"]["drafted"] > 0 and s["cuda_graphs"] is False
    assert s["tokens"] == greedy_reference(load_target(target), [int(i) for i in IDS.split(",")], 32)
    text = run("generate", "--target", target, "--prompt-ids", IDS, "--max-new", "4", "--spec", "off")
    # capturable families: off here only because the CPU is not CUDA
    assert text.exit_code == 0 and "CUDA graphs off (default: not on CUDA" in text.stderr, text.output
    # the priced window on the ladder's prior (no accept-rate head), priced by the prompt's routing
    ids = IDS + ",7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26"
    priced = run("generate", "--target", target, "--draft", draft, "--prompt-ids", ids, "--max-new", "24", "--json",
                 "--vt", "priced", "--vt-cost", "routed")
    assert priced.exit_code == 0, priced.output
    obj = json.loads(priced.stdout)
    assert obj["tokens"] == greedy_reference(load_target(target), [int(i) for i in ids.split(",")], 24)
    assert obj["receipts"]["verify_window"]["survival"] == "accepted-runs"
    assert obj["stats"]["window_cost"]["model"] == "routed" and obj["stats"]["window_cost"]["experts_per_layer"][0] == 2
    census = run("census", draft, "--json")
    assert census.exit_code == 0, census.output
    obj = json.loads(census.stdout)
    assert obj["target_layer_ids"] == list(FAMILIES[family]) and obj["warnings"] == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bench_reports_experts_per_round(tiny, family, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    r = run("bench", "--target", tiny / family, "--draft", tiny / f"{family}_dflash", "--prompts", prompts,
            "--max-new", "16", "--warmup", "0", "--arm", "dflash", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exact"] is True
    arm = {a["name"]: a for a in obj["arms"]}["dflash"]
    # top-2 of 8 on every layer (5 layers): a call runs 2..8 experts, a round at least 5 * 2
    assert 2 <= arm["moe"]["experts_per_layer_step"] <= 8 and arm["moe"]["experts_per_round"] >= 10


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_reads_the_target_tables(tiny, family, tmp_path):
    target, draft = tiny / family, tiny / f"{family}_dflash"
    oracle = tmp_path / "o.npz"
    made = run("parity", draft, "--make-oracle", oracle, "--target", target, "--ctx", "6")
    assert made.exit_code == 0, made.output
    r = run("parity", draft, oracle, "--target", target, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["lm_head"] == f"target {target}"


@pytest.mark.parametrize("family,key", [("qwen3_5_moe", "num_experts_per_tok"), ("gemma4_moe", "top_k_experts")])
def test_more_routed_experts_than_experts_is_one_error_line(tiny, tmp_path, family, key):
    src, bad = tiny / family, tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (cfg.get("text_config") or cfg)[key] = 9
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run("generate", "--target", bad, "--prompt-ids", IDS, "--max-new", "4", "--spec", "off")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"{key} 9 is more than" in lines[0], r.stderr
    assert str(bad / "config.json") in lines[0]
