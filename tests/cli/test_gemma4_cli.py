"""The Gemma 4 target through the CLI: `python -m memra_cli.tiny OUT` writes a tiny Gemma 4 text
target (with the tiny tokenizer) and a z-lab DFlash drafter for it; `memra generate` / `memra bench`
run the pair and the speculative stream equals plain greedy (`--spec off`) token for token;
`memra census` reads the drafter; an MoE Gemma config routing more experts than it has and an
unknown layer type exit 2 with one `error:` line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.tiny.__main__ import GEMMA4_DRAFT_TAPS, main as tiny_main

runner = CliRunner()
IDS = "5,17,42,99,3,250,7,8,9,10,11,12"  # longer than the tiny target's window of 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyg4")
    assert tiny_main([str(root)]) == 0
    return root / "gemma4", root / "gemma4_dflash"


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={})


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_tiny_writes_the_gemma_pair(tiny):
    target, draft = tiny
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and (target / "tokenizer.json").is_file()
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["dflash_config"]["target_layer_ids"] == list(GEMMA4_DRAFT_TAPS)
    assert dcfg["num_target_layers"] == cfg["num_hidden_layers"] and dcfg["hidden_size"] == cfg["hidden_size"]


@pytest.mark.parametrize("width", [None, "variable"], ids=["default-16", "variable"])
def test_generate_spec_equals_plain(tiny, width):
    target, draft = tiny
    extra = ["--step-width", width] if width else []
    common = ["--target", target, "--draft", draft, "--prompt-ids", IDS, "--max-new", "40", "--json", *extra]
    spec, plain = run("generate", *common), run("generate", "--spec", "off", *common)
    assert spec.exit_code == 0 and plain.exit_code == 0, (spec.output, plain.output)
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["mode"] == "dflash" and p["mode"] == "off"
    assert s["tokens"] == p["tokens"] and len(s["tokens"]) == 40
    assert s["tokens"] == greedy_reference(Gemma4Target.from_dir(target), [int(i) for i in IDS.split(",")], 40)


def test_generate_text_and_census(tiny):
    target, draft = tiny
    r = run("generate", "--target", target, "--draft", draft, "--prompt", "def fibonacci(n):", "--max-new", "12")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[-1].startswith("[dflash] tokens=12 rounds=") and r.stdout.strip()
    c = run("census", draft, "--json")
    assert c.exit_code == 0, c.output
    assert json.loads(c.stdout)["target_layer_ids"] == list(GEMMA4_DRAFT_TAPS)


def test_bench_gate_passes(tiny, tmp_path):
    target, draft = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def add(a, b):", "The quick brown fox")) + "\n")
    r = run("bench", "--target", target, "--draft", draft, "--prompts", prompts, "--max-new", "16", "--warmup", "0",
            "--arm", "dflash", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exact"] is True and [a["name"] for a in obj["arms"]] == ["off", "plain", "dflash"]
    assert obj["arms"][2]["tokens"] == obj["arms"][0]["tokens"]


@pytest.mark.parametrize("change,want", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 8, "moe_intermediate_size": 16},
     "top_k_experts 8 is more than num_experts 4"),
    ({"layer_types": ["sliding_attention"] * 4 + ["bogus_attention"]},
     "layer_types has 'bogus_attention', a layer type Gemma 4 does not have"),
])
def test_bad_configs_are_one_error_line(tiny, tmp_path, change, want):
    target, _ = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in target.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = {**json.loads((target / "config.json").read_text()), **change}
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(run("generate", "--target", bad, "--prompt-ids", IDS, "--max-new", "4", "--spec", "off"))
    assert want in line and str(bad / "config.json") in line


def test_parity_reads_the_gemma_tables(tiny, tmp_path):
    """`memra parity --make-oracle` takes the noise rows and lm_head from a Gemma target (the raw
    embedding table; the multimodal checkpoint's under model.language_model.), and the drafter passes."""
    from memra_cli.tiny.gemma4 import make_tiny_gemma4

    target, draft = tiny
    mm = make_tiny_gemma4(tmp_path / "mm", layout="multimodal")
    for t in (target, mm):
        oracle = tmp_path / f"{t.name}.npz"
        made = run("parity", draft, "--make-oracle", oracle, "--target", t)
        assert made.exit_code == 0, made.output
        r = run("parity", draft, oracle, "--target", t)
        assert r.exit_code == 0 and "parity PASS" in r.stdout, r.output
    # a drafter whose hidden size differs from the target's: one error line
    from memra_cli.tiny.draft import make_tiny_draft

    narrow = make_tiny_draft(tmp_path / "narrow", "zlab", hidden=32, target_layer_ids=(-1, 1, 2), num_target_layers=5)
    line = one_error_line(run("generate", "--target", target, "--draft", narrow, "--prompt-ids", IDS, "--max-new", "4"))
    assert "drafter hidden_size 32" in line and "!= target hidden_size 64" in line


def test_deepspec_gemma4_dspark_drafter_is_one_error_line(tiny, tmp_path):
    """DeepSpec's Gemma 4 DSpark export is recognised and refused by name, before any weight is read."""
    target, draft = tiny
    bad = tmp_path / "gemma_dspark"
    bad.mkdir()
    for f in draft.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    cfg = {**json.loads((draft / "config.json").read_text()), "architectures": ["Gemma4DSparkModel"],
           "model_type": "gemma4_text", "block_size": 4, "mask_token_id": 1, "markov_rank": 0}
    (bad / "config.json").write_text(json.dumps(cfg))
    for args in (("census", bad), ("generate", "--target", target, "--draft", bad, "--prompt-ids", IDS, "--max-new", "4")):
        line = one_error_line(run(*args))
        assert "DeepSpec Gemma 4 DSpark drafter (Gemma4DSparkModel) is recognised but not implemented" in line
        assert str(bad / "config.json") in line
