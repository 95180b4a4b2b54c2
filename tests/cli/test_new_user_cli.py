"""What a new user meets on the embedded models and the tiny checkpoints: the messages, notes,
receipts and JSON fields they read (one test per finding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.tiny.__main__ import main as tiny_main

runner = CliRunner()
ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


def _one_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_chat_on_the_embedded_target_is_refused_in_one_line_and_documented():
    """The embedded target is a raw code model without a chat template: --chat says so and what
    it needs, for generate and bench alike, and --help says it up front."""
    for args in (["generate", "--chat", "--prompt", "x"], ["bench", "--chat"]):
        line = _one_error(runner.invoke(app, args))
        assert line.startswith("error: --chat: the target has no chat template (no chat_template in ")
        assert str(ASSETS / "target" / "tokenizer_config.json") in line and "needs a target made for chat" in line
    for command in ("generate", "bench"):
        help_text = " ".join(runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}).stdout.split())
        assert "Needs a target made for chat" in help_text and "the embedded target is a raw code model" in help_text


# ---------------------------------------------------------------- item 12: the smaller findings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """What `python -m memra_cli.tiny DIR` writes (target, dflash, dspark)."""
    root = tmp_path_factory.mktemp("tiny")
    assert tiny_main([str(root)]) == 0
    return root


def test_tiny_help_is_a_success(capsys):
    for flag in ("--help", "-h"):
        assert tiny_main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m memra_cli.tiny OUT_DIR") and "OUT_DIR/dspark" in out
    assert tiny_main([]) == 2 and tiny_main(["--frob"]) == 2


def test_tiny_checkpoints_load_together_without_a_warning(tiny):
    """The tiny DSpark drafter ships the tiny target's own tables, as a DeepSpec export of a
    drafter trained on that target does (no 'tables differ' warning), and taps short of the
    target's last layer (no last-layer warning)."""
    r = runner.invoke(app, ["generate", "--target", str(tiny / "target"), "--draft", str(tiny / "dspark"),
                            "--prompt-ids", "1,2,3", "--max-new", "4"])
    assert r.exit_code == 0, r.output
    assert "warning" not in r.stderr, r.stderr
    obj = json.loads(runner.invoke(app, ["generate", "--target", str(tiny / "target"), "--draft", str(tiny / "dspark"),
                                         "--prompt-ids", "1,2,3", "--max-new", "4", "--json"]).stdout)
    assert obj["warnings"] == []


def test_drafter_settings_under_plain_greedy_are_not_ignored_silently(tiny):
    base = ["generate", "--target", str(tiny / "target"), "--prompt-ids", "1,2,3", "--max-new", "2"]
    r = runner.invoke(app, base + ["--spec", "off", "--vt", "confidence"])
    assert r.exit_code == 0, r.output
    assert "warning: plain greedy drafts nothing, so --vt confidence has no effect" in r.stderr.splitlines()
    r = runner.invoke(app, base + ["--draft", str(tiny / "dspark"), "--spec", "off", "--json"], env={"MEMRA_DSPARK_VT_TAU": "0.3"})
    assert json.loads(r.stdout)["warnings"] == [
        f"plain greedy drafts nothing, so --tau / MEMRA_DSPARK_VT_TAU=0.3 (from the environment), --draft {tiny / 'dspark'} have no effect"]
    r = runner.invoke(app, base + ["--json"])  # auto without a drafter, nothing given: nothing to say
    assert json.loads(r.stdout)["warnings"] == []


def test_a_missing_draft_is_refused_before_any_note_and_the_note_names_only_defaults():
    r = runner.invoke(app, ["generate", "--draft", "/nope", "--prompt", "x"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == ["error: --draft /nope: no such file or directory"]
    r = runner.invoke(app, ["generate", "--draft", str(ASSETS / "dflash"), "--prompt-ids", "1,2", "--max-new", "1"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == f"note: using the embedded default target {ASSETS / 'target'}"


def test_receipts_are_tagged_with_the_program_that_runs(tiny):
    base = ["generate", "--target", str(tiny / "target"), "--prompt-ids", "1,2,3", "--max-new", "2", "--json"]
    lines = json.loads(runner.invoke(app, base + ["--draft", str(tiny / "dflash"), "--spec", "dflash"]).stdout)["receipt_lines"]
    assert lines[0].startswith("[dflash] harvest=dflash") and lines[1].startswith("[dflash] verify-window=Ladder")
    lines = json.loads(runner.invoke(app, base + ["--draft", str(tiny / "dflash"), "--spec", "dspark"]).stdout)["receipt_lines"]
    assert lines[0].startswith("[dspark] harvest=dflash")  # the dspark program, on a DFlash drafter
    lines = json.loads(runner.invoke(app, base + ["--draft", str(tiny / "dspark"), "--spec", "dflash"]).stdout)["receipt_lines"]
    assert lines[0].startswith("[dflash] harvest=dspark")
    census = runner.invoke(app, ["census", str(tiny / "dflash")]).stdout.splitlines()
    assert census[-2].startswith("[dflash] harvest=dflash")  # what --spec auto would run


def test_parity_puts_the_bound_beside_the_value_it_bounds(tiny, tmp_path):
    oracle = tmp_path / "o.npz"
    assert runner.invoke(app, ["parity", str(tiny / "dflash"), "--make-oracle", str(oracle), "--target", str(tiny / "target")]).exit_code == 0
    r = runner.invoke(app, ["parity", str(tiny / "dflash"), str(oracle), "--target", str(tiny / "target")])
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if line.split()[:2] == ["stage", "path"])
    assert header.split() == ["stage", "path", "rel", "L2", "rel", "L2", "bound", "argmax", "max-abs", "result"]
    assert "threshold" not in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.split()[:2] == ["hidden_out", "full"])
    assert row.split()[3] == "≤" and row.split()[4] == "1.00e-05"
    assert "pass: rel L2 within its bound; draft_logits also needs the oracle's argmax" in r.stdout
    assert "max-abs is information, not a criterion" in r.stdout


# ---------------------------------------------------------------- item 7: EOS is not text

END_OF_MODULE = '\n\nif __name__ == "__main__":\n    main()'  # the embedded target ends the file after this


@pytest.mark.parametrize("spec", ["off", "dspark"])
def test_the_eos_token_ends_the_text_without_being_printed(spec):
    args = ["generate", "--prompt", END_OF_MODULE, "--max-new", "24", "--spec", spec]
    obj = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert obj["tokens"] == [200, 0]  # "\n", then <|endoftext|> (id 0): the stream stopped at EOS
    assert obj["text"] == "\n"
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and r.stdout == "\n\n"  # the text, then the closing newline
    assert "<|endoftext|>" not in r.stdout


# ---------------------------------------------------------------- item 11: the docs say what the tools do

ROOT = ASSETS.parents[1]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_docs_give_the_embedded_drafters_census_counts():
    from memra_cli.cli.render import human_count
    from memra_cli.engine.formats.census import take_census

    rows = {line.split("|")[1].strip(): line for line in (ROOT / "docs" / "bench.md").read_text().splitlines()
            if line.startswith("| DSpark drafter") or line.startswith("| DFlash drafter")}
    for name, kind in (("DSpark drafter", "dspark"), ("DFlash drafter", "dflash")):
        count = human_count(take_census(ASSETS / kind).n_params)
        assert f"{count} params" in rows[name], (name, count)
    # and what is left without its copies of the target's embed_tokens and lm_head
    target = json.loads((ASSETS / "target" / "config.json").read_text())
    own = take_census(ASSETS / "dspark").n_params - 2 * target["vocab_size"] * target["hidden_size"]
    assert f"{human_count(own)} of its own" in rows["DSpark drafter"]


def test_readme_says_what_the_tiny_script_writes(tmp_path):
    assert tiny_main([str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["dflash", "dspark", "gemma4", "gemma4_dflash", "gemma4_dspark", "gemma4_moe", "gemma4_moe_dflash",
                       "llama",
                       "llama_dflash", "qwen3_5", "qwen3_5_dflash", "qwen3_5_moe", "qwen3_5_moe_dflash", "qwen3_moe",
                       "qwen3_moe_dflash", "target"]
    readme = _words((ROOT / "README.md").read_text())
    assert "every format" not in readme
    said = readme[readme.index("`python -m memra_cli.tiny DIR` writes sixteen tiny random checkpoints"):]
    said = said[:said.index(". ")]
    assert said.startswith("`python -m memra_cli.tiny DIR` writes sixteen tiny random checkpoints for experiments: "
                           "a Qwen3 target with a tokenizer, a z-lab DFlash drafter and a DeepSpec DSpark drafter "
                           "that ships the target's tables")
    for name in written:  # every other directory it writes is named in that sentence
        if name not in ("target", "dflash", "dspark"):
            assert f"(`{name}`)" in said, name


def test_bench_help_defines_tau_as_the_docs_do():
    help_text = _words(runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "400"}).stdout)
    assert "(accepted + rounds) / rounds" in help_text and "= accepted + 1" not in help_text
    assert "(accepted + rounds) / rounds" in (ROOT / "docs" / "bench.md").read_text()


def test_generate_reports_no_acceptance_for_plain_greedy_as_bench_does():
    args = ["generate", "--spec", "off", "--prompt-ids", "5,6,7", "--max-new", "3"]
    assert json.loads(runner.invoke(app, args + ["--json"]).stdout)["stats"]["acceptance"] is None
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and " acceptance=- " in r.stderr.splitlines()[-1]
    spec = json.loads(runner.invoke(app, ["generate", "--prompt-ids", "5,6,7", "--max-new", "3", "--json"]).stdout)
    assert isinstance(spec["stats"]["acceptance"], float)
