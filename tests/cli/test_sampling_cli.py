"""--temperature/--top-k/--top-p/--min-p/--seed on `generate` and `bench`: seeded speculative
streams equal plain sampling, --json says what ran, notes name the seed and the acceptance
rule, bad values are one `error:` line (exit 2)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from memra_cli.cli import bench as bench_cli
from memra_cli.cli.app import app
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

runner = CliRunner()
bench_app = typer.Typer(pretty_exceptions_enable=False)
bench_app.command(name="bench")(bench_cli.bench)


@bench_app.callback()
def _root() -> None:
    """test app"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling-cli")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dspark = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    dflash = make_tiny_draft(root / "dflash", "zlab")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Stack:"}\n')
    return target, dspark, dflash, prompts


def generate(*args):
    return runner.invoke(app, ["generate", *[str(a) for a in args]])


def tokens(*args) -> list[int]:
    r = generate(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["tokens"]


def test_seeded_generate_is_the_same_with_or_without_a_drafter(pair):
    target, dspark, dflash, _ = pair
    base = ["--target", target, "--prompt-ids", "5,17,42,99", "--max-new", "24"]
    for extra in (["--temperature", "0.8"], ["--temperature", "1.2", "--top-p", "0.9", "--seed", "7"],
                  ["--temperature", "0.5", "--top-k", "20", "--min-p", "0.05", "--seed", "-3"]):
        plain = tokens(*base, *extra)
        assert tokens(*base, *extra, "--draft", dspark) == plain
        assert tokens(*base, *extra, "--draft", dflash) == plain
        assert tokens(*base, *extra, "--draft", dspark, "--step-width", "variable") == plain
    assert tokens(*base, "--temperature", "0.8", "--seed", "1") != tokens(*base, "--temperature", "0.8")
    assert tokens(*base, "--temperature", "0.8", "--seed", "0") == tokens(*base, "--temperature", "0.8")  # default 0
    greedy = tokens(*base)
    assert tokens(*base, "--temperature", "0", "--top-p", "0.5", "--seed", "9", "--draft", dspark) == greedy


def test_json_and_notes_say_what_ran(pair):
    target, dspark, _, _ = pair
    base = ["--target", target, "--draft", dspark, "--prompt-ids", "1,2,3", "--max-new", "6"]
    obj = json.loads(generate(*base, "--temperature", "1", "--top-p", "0.9", "--json").stdout)
    assert obj["sampling"] == {
        "temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "seed": 0, "seed_source": "default",
        "sampler": "position-keyed",
        "acceptance": "position-keyed sampling (seed 0): a draft is kept while it equals the target's own sample at "
                      "its position; lossless, stream identical to plain sampling with the same seed",
        "identical_to_plain": True,
    }
    greedy = json.loads(generate(*base, "--json").stdout)["sampling"]
    assert greedy["sampler"] == "greedy" and greedy["temperature"] == 0.0 and greedy["seed"] is None
    r = generate(*base, "--temperature", "1", "--seed", "5")
    assert r.exit_code == 0, r.output
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert "note: sampling: temperature 1, seed 5 (--seed)" in notes
    assert "note: acceptance: position-keyed sampling (seed 5): a draft is kept while it equals the target's own " \
           "sample at its position; lossless, stream identical to plain sampling with the same seed" in notes
    r = generate(*base, "--temperature", "1", "--spec", "off")
    assert "note: sampling: temperature 1, seed 0 (default; --seed)" in r.stderr and "acceptance:" not in r.stderr
    assert "sampling" not in generate(*base).stderr  # greedy: the output as it always was


BAD = {
    "temperature below 0": (["--temperature", "-1"], "error: --temperature -1: expected a finite number >= 0 (0 = greedy)"),
    "temperature word": (["--temperature", "warm"], "error: --temperature warm: expected a finite number >= 0"),
    "top-p 0": (["--top-p", "0"], "error: --top-p 0: expected a number in (0, 1] (1 = off)"),
    "top-p above 1": (["--top-p", "1.01"], "error: --top-p 1.01: expected a number in (0, 1]"),
    "top-k below 0": (["--top-k", "-1"], "error: --top-k -1: expected an integer >= 0 (0 = off)"),
    "top-k float": (["--top-k", "2.5"], "error: --top-k 2.5: expected an integer >= 0"),
    "min-p 1": (["--min-p", "1"], "error: --min-p 1: expected a number in [0, 1) (0 = off)"),
    "seed float": (["--seed", "1.5"], "error: --seed 1.5: expected an integer"),
    "seed word": (["--seed", "abc"], "error: --seed abc: expected an integer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_one_line(pair, case):
    target, dspark, _, prompts = pair
    flags, message = BAD[case]
    for r in (generate("--target", target, "--draft", dspark, "--prompt-ids", "1,2", "--max-new", "2", *flags),
              runner.invoke(bench_app, ["bench", "--target", str(target), "--draft", str(dspark), "--prompts", str(prompts),
                                        "--max-new", "2", *flags])):
        assert r.exit_code == 2, (case, r.output)
        lines = r.stderr.strip().splitlines()
        assert lines == [message] or (len(lines) == 1 and lines[0].startswith(message)), r.stderr
        assert r.stdout == ""


def test_bench_gates_sampled_streams_and_reports_the_params(pair):
    target, dspark, dflash, prompts = pair
    args = ["bench", "--target", str(target), "--draft", str(dspark), "--prompts", str(prompts), "--max-new", "12",
            "--warmup", "0", "--arm", "dspark", "--arm", "dspark:vt=ladder", "--arm", f"dflash:draft={dflash}",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "3"]
    r = runner.invoke(bench_app, args + ["--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exact"] is True and all(a["exact"] for a in obj["arms"] if a["name"] != "plain")
    plain = next(a for a in obj["arms"] if a["name"] == "plain")  # the speed baseline samples with the same sampler
    assert plain["exact"] is None and plain["same_as_off"] == plain["n_prompts"]  # float32: its stream is off's
    assert obj["sampling"]["temperature"] == 0.9 and obj["sampling"]["seed"] == 3
    assert obj["sampling"]["acceptance"].startswith("position-keyed sampling (seed 3)")
    r = runner.invoke(bench_app, args)
    assert r.exit_code == 0, r.output
    assert "note: sampling: temperature 0.9, top-p 0.95, seed 3 (--seed)" in r.stderr
    assert "note: acceptance: position-keyed sampling (seed 3)" in r.stderr
    greedy = runner.invoke(bench_app, args[:-6] + ["--json"])
    assert json.loads(greedy.stdout)["sampling"]["sampler"] == "greedy"


def test_rejection_arms_are_measured_not_gated(pair):
    target, dspark, _, prompts = pair
    base = ["bench", "--target", str(target), "--draft", str(dspark), "--prompts", str(prompts), "--max-new", "10",
            "--warmup", "0", "--arm", "dspark", "--arm", "dspark:accept=rejection"]
    r = runner.invoke(bench_app, base + ["--temperature", "1", "--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    arms = {a["name"]: a for a in obj["arms"]}
    assert arms["dspark"]["exact"] is True and arms["dspark:accept=rejection"]["exact"] is None
    assert arms["dspark:accept=rejection"]["acceptance_rule"].startswith("rejection sampling (seed 0)")
    assert "NOT identical to plain sampling" in arms["dspark:accept=rejection"]["acceptance_rule"]
    assert arms["dspark"]["acceptance_rule"].startswith("position-keyed sampling (seed 0)")
    assert obj["exact"] is True  # (a rejection stream may even stop at another EOS: it is another sample)
    r = runner.invoke(bench_app, base + ["--temperature", "1"])
    assert r.exit_code == 0 and "n/a" in r.stdout
    assert "note: arm dspark:accept=rejection: acceptance: rejection sampling (seed 0)" in r.stderr
    r = runner.invoke(bench_app, base)  # greedy: nothing to sample drafts from
    assert r.exit_code == 2 and r.stderr.strip() == (
        "error: --arm 'dspark:accept=rejection': accept=rejection samples drafts: it needs --temperature > 0")
    r = runner.invoke(bench_app, base[:-1] + ["dspark:accept=sometimes"])
    assert r.exit_code == 2 and "accept=sometimes (expected keyed|rejection)" in r.stderr


def test_generate_with_rejection_sampling(pair):
    target, dspark, _, _ = pair
    base = ["--target", target, "--draft", dspark, "--prompt-ids", "5,17,42,99", "--max-new", "16", "--temperature", "1"]
    r = generate(*base, "--acceptance", "rejection", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert len(obj["tokens"]) == 16 and obj["sampling"]["sampler"] == "rejection"
    assert obj["sampling"]["identical_to_plain"] is False
    r = generate(*base, "--acceptance", "rejection")
    assert "note: sampling: temperature 1, seed 0 (default; --seed), rejection sampling (--acceptance)" in r.stderr
    assert "note: acceptance: rejection sampling (seed 0)" in r.stderr
    r = generate(*base, "--acceptance", "sometimes")
    assert r.exit_code == 2 and r.stderr.strip() == "error: --acceptance sometimes: expected keyed|rejection"
