"""The LLaMA target through the CLI: `python -m memra_cli.tiny OUT` writes a tiny LLaMA target
(llama3 rope scaling, a tokenizer) and a z-lab DFlash drafter tapping it; `memra census` reads
the drafter, `memra generate` runs the pair (speculative == `--spec off` == the model's plain
greedy, token for token), `memra bench` gates it exact; a LLaMA config with a switch memra does
not implement exits 2 with one `error:` line."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.llama import LlamaTarget
from memra_cli.tiny.__main__ import LLAMA_DRAFT_TAPS, main as tiny_main

runner = CliRunner()
IDS = "5,17,42,99,3,250"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyllama")
    assert tiny_main([str(root)]) == 0
    return root / "llama", root / "llama_dflash"


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={})


def test_tiny_writes_the_llama_pair(tiny):
    target, draft = tiny
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and (target / "tokenizer.json").is_file()
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["dflash_config"]["target_layer_ids"] == list(LLAMA_DRAFT_TAPS)
    assert dcfg["num_target_layers"] == cfg["num_hidden_layers"]


def test_census_of_the_llama_drafter(tiny):
    _, draft = tiny
    r = run("census", draft, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exporter"] == "zlab-dflash" and obj["target_layer_ids"] == list(LLAMA_DRAFT_TAPS)


@pytest.mark.parametrize("width", [None, "variable"], ids=["default-16", "variable"])
def test_generate_spec_equals_plain(tiny, width):
    target, draft = tiny
    extra = ["--step-width", width] if width else []
    common = ["--target", target, "--draft", draft, "--prompt-ids", IDS, "--max-new", "80", "--json", *extra]
    spec, plain = run("generate", *common), run("generate", "--spec", "off", *common)
    assert spec.exit_code == 0 and plain.exit_code == 0, (spec.output, plain.output)
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["mode"] == "dflash" and p["mode"] == "off" and s["stats"]["drafted"] > 0
    # 6 + 80 positions: past the tiny config's 64 original positions of llama3 scaling
    assert s["tokens"] == p["tokens"] == greedy_reference(LlamaTarget.from_dir(target),
                                                          [int(i) for i in IDS.split(",")], 80)


def test_generate_text_with_the_tokenizer(tiny):
    target, draft = tiny
    r = run("generate", "--target", target, "--draft", draft, "--prompt", "def fibonacci(n):", "--max-new", "12",
            "--chat")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0].startswith("[dflash] harvest=dflash")


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


@pytest.mark.parametrize("edit,want", [
    ({"attention_bias": True}, "attention_bias=true is not implemented for model_type 'llama'"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not implemented (expected 'silu')"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
     "rope_parameters.rope_type='longrope' is not implemented (supported: default, yarn, llama3)"),
])
def test_unimplemented_switches_are_one_line_errors(tiny, tmp_path, edit, want):
    target, _ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
    r = run("generate", "--target", bad, "--spec", "off", "--prompt-ids", IDS, "--max-new", "4")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], r.stderr


def test_census_reports_a_drafters_llama3_rope(tmp_path):
    from memra_cli.tiny.draft import make_tiny_draft
    from memra_cli.tiny.target import LLAMA3

    draft = make_tiny_draft(tmp_path / "d", "zlab", config_overrides={"rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    r = run("census", draft, "--json")
    assert r.exit_code == 0, r.output
    rope = json.loads(r.stdout)["rope"]
    assert (rope["type"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]) == ("llama3", 8.0, 1.0, 4.0, 64)
    table = run("census", draft)
    assert table.exit_code == 0 and "low/high freq factor" in table.stdout and "1.0/4.0" in table.stdout, table.output


def test_parity_reads_the_llama_tables(tiny, tmp_path):
    target, draft = tiny
    oracle = tmp_path / "o.npz"
    made = run("parity", draft, "--make-oracle", oracle, "--target", target, "--ctx", "6")
    assert made.exit_code == 0, made.output
    r = run("parity", draft, oracle, "--target", target, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["lm_head"] == f"target {target}"
