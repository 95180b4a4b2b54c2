"""`memra bench` through typer: JSON shape, table, default pair hook, exactness gate exit, plot,
one-line refusals. The command is registered on a local app (app.py wiring is the lead's)."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import typer
from typer.testing import CliRunner

from memra_cli.cli import bench as bench_cli
from memra_cli.bench import runner as eb
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

runner = CliRunner()
app = typer.Typer(pretty_exceptions_enable=False)
app.command(name="bench")(bench_cli.bench)


@app.callback()
def _root() -> None:
    """test app"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-cli")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    drafters = {
        "dflash": make_tiny_draft(root / "dflash", "zlab"),
        "dspark": make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3)),
    }
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"turns": ["def add(a, b):", "a second turn, ignored"]},
        {"prompt": "class Stack:\n    def push(self, item):"},
        {"turns": ["The quick brown fox"]},
    ]) + "\n")
    return root, target, drafters, prompts


@pytest.fixture
def embedded(monkeypatch, pair):
    """memra_cli.assets.default_pair() -> the tiny pair (what the embedded assets will provide)."""
    _, target, drafters, _ = pair
    mod = types.ModuleType("memra_cli.assets")
    mod.default_pair = lambda: (target, dict(drafters))
    monkeypatch.setitem(sys.modules, "memra_cli.assets", mod)
    return pair


def run(*args):
    return runner.invoke(app, ["bench", *[str(a) for a in args]])


def test_json_over_three_prompts_with_the_default_pair(embedded):
    _, target, drafters, prompts = embedded
    r = run("--prompts", prompts, "--max-new", "8", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert set(obj) >= {"arms", "prompts", "max_new", "device", "dtype", "exact", "warmup", "mismatches"}
    assert obj["exact"] is True and obj["max_new"] == 8 and obj["device"] == "cpu" and obj["dtype"] == "float32"
    assert obj["step_width"] == 16 and obj["cuda_graphs"] is False  # defaults on CPU: 16-row steps, no graphs
    assert obj["round_graphs"] is False and obj["pipelined"] is False  # (both need graphs)
    assert obj["prompts"]["n"] == 3 and obj["prompts"]["set"] == str(prompts) and obj["target"] == str(target)
    assert [a["name"] for a in obj["arms"]] == ["off", "plain", "dflash", "dspark"]
    assert [a["drafter"] for a in obj["arms"]] == [None, None, str(drafters["dflash"]), str(drafters["dspark"])]
    for a in obj["arms"]:
        assert set(a) >= {"name", "tau", "acceptance", "tok_per_s", "speedup", "speedup_vs_off", "steps", "exact",
                          "phase_ms", "tau_hist", "n_prompts", "tokens"}
        assert a["exact"] is (None if a["name"] == "plain" else True)
        assert a["n_prompts"] == 3 and a["tokens"] == obj["arms"][0]["tokens"]
        assert a["tau"] >= 1.0 and a["tok_per_s"] > 0 and a["speedup"] > 0
        assert a["speedup"] == pytest.approx(a["tok_per_s"] / obj["arms"][1]["tok_per_s"])
        assert a["speedup_vs_off"] == pytest.approx(a["tok_per_s"] / obj["arms"][0]["tok_per_s"])
    # what each baseline was; the CPU default times phases (perf_counter: no synchronization)
    assert obj["speedup_baseline"] == "plain"
    assert obj["baselines"]["plain"]["steps"] == "one-row steps (variable width), eager" == obj["arms"][1]["steps"]
    assert obj["baselines"]["off"]["steps"] == "fixed 16-row steps, eager" == obj["arms"][0]["steps"] == obj["arms"][2]["steps"]
    assert obj["baselines"]["plain"]["same_as_off"] == obj["arms"][1]["same_as_off"] == 3  # float32: the same stream
    assert obj["phase_times"] is True and obj["phase_clock"] == "perf_counter, no device synchronization"
    assert obj["arms"][3]["receipts"] == {"harvest": "dspark", "verify_window": {"policy": "confidence-slot", "tau": 0.5},
                                          "block_embedding": {"scaled": False, "scale": 1.0, "set": False}}
    assert obj["arms"][2]["receipt_lines"][0].startswith("[dflash] harvest=dflash (checkpoint census strategy_dspark=false")


def test_table_receipts_and_plot(pair, tmp_path):
    _, target, drafters, prompts = pair
    png = tmp_path / "bench.png"
    r = run("--target", target, "--draft", drafters["dspark"], "--prompts", prompts, "--n", "2", "--max-new", "6",
            "--warmup", "0", "--arm", "dspark", "--arm", "dspark:vt=confidence,tau=0.3", "--arm", "dspark:harvest=dflash",
            "--plot", png)
    assert r.exit_code == 0, r.output
    assert "arm dspark:vt=confidence,tau=0.3: dspark program, drafter" in r.stderr
    assert "[dspark] verify-window=Confidence{tau=0.3} (accept-rate head present, MEMRA_DSPARK_VT set)" in r.stderr
    assert "[dspark] harvest=dflash (checkpoint census strategy_dspark=true, MEMRA_DSPARK_HARVEST set)" in r.stderr
    assert "note: target steps: 16 rows (default; --step-width); CUDA graphs off (default: not on CUDA" in r.stderr
    assert "note: arm off (the exactness reference): fixed 16-row steps, eager" in r.stderr
    assert "note: arm plain (the speedup baseline, not gated): one-row steps (variable width), eager" in r.stderr
    for name in ("off", "plain", "dspark", "dspark:vt=confidence,tau=0.3", "dspark:harvest=dflash", "speedup", "vs off",
                 "verify", "rollback", "tau histogram"):
        assert name in r.stdout
    out = " ".join(r.stdout.split())
    assert "speedup = tok/s over plain's; plain: the fastest plain decoding here, one-row steps (variable width), eager" in out
    assert "vs off = tok/s over off's; off: the exactness reference, fixed 16-row steps, eager" in out
    assert "plain is not gated; its stream equalled off's on 2 of 2 prompts" in out
    assert "phases: timed (perf_counter, no device synchronization)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in r.stdout.splitlines()  # as quantize and parity say what they wrote
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]  # no temp file left behind


def test_mismatch_is_loud_and_exits_1(embedded, monkeypatch):
    _, _, _, prompts = embedded
    real = eb.generate_one

    def corrupt(arm, ids, max_new, timed):
        tokens, stats, wall = real(arm, ids, max_new, timed)
        if arm.name == "dflash":
            tokens[-1] += 1
        return tokens, stats, wall

    monkeypatch.setattr(eb, "generate_one", corrupt)
    r = run("--prompts", prompts, "--max-new", "5", "--warmup", "0")
    assert r.exit_code == 1, r.output
    assert "dflash" in r.stdout and "NO" in r.stdout  # the table came first
    lines = [l for l in r.stderr.splitlines() if l.startswith("EXACTNESS GATE FAILED")]
    assert len(lines) == 3 and all("arm 'dflash' differs from off on prompt" in l for l in lines)
    assert re.search(r"at token \d+: off=\d+, dflash=\d+", lines[0])
    r = run("--prompts", prompts, "--max-new", "5", "--warmup", "0", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["exact"] is False


def test_help_documents_the_whole_grammar():
    r = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "400"})
    help_text = " ".join(r.stdout.split())
    for key, values in eb.ARM_KEYS.items():
        assert f"{key}=" in help_text
        for v in values.split("|"):
            if v.isidentifier() or v in ("confidence-slot", "0", "1"):
                assert v in help_text, (key, v)
    for name in eb.ARM_NAMES:
        assert name in help_text


@pytest.mark.parametrize("case", ["no pair", "bad arm", "bad file", "prec", "needs drafter", "missing plot dir", "arm policy"])
def test_refusals_are_one_line(pair, monkeypatch, tmp_path, case):
    _, target, drafters, prompts = pair
    monkeypatch.setitem(sys.modules, "memra_cli.assets", None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"text": "no"}\n')
    base = ["--target", target, "--draft", drafters["dspark"], "--prompts", prompts, "--max-new", "4"]
    args, message = {
        "no pair": ([], "error: no embedded default model pair in this build: pass --target DIR and --draft PATH"),
        "bad arm": (base + ["--arm", "dspark:vt=wide"], "error: --arm 'dspark:vt=wide': vt=wide (expected ladder|confidence|confidence-slot|priced)"),
        "bad file": (base[:4] + ["--prompts", bad], f"error: {bad}:2: expected"),
        "prec": (base + ["--arm", "dspark:prec=q5"], "error: --arm 'dspark:prec=q5': prec=q5"),
        "needs drafter": (["--target", target, "--prompts", prompts, "--arm", "dflash"], "error: --arm 'dflash' needs a drafter: pass --draft PATH"),
        "missing plot dir": (base + ["--plot", tmp_path / "nope" / "x.png"], "does not exist"),
        "arm policy": (base + ["--arm", "dspark:vt=confidence,adapt=0"], "error: --arm 'dspark:vt=confidence,adapt=0': vt=confidence together with adapt=0 is contradictory"),
    }[case]
    r = run(*args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("vocab", [1024, 256], ids=["drafter-larger", "drafter-smaller"])
def test_a_drafter_of_another_vocabulary_is_refused(pair, monkeypatch, tmp_path, vocab):
    """Refused while the arms load, before any prompt runs: one `error:` line naming the arm, the
    tensor and both sizes, exit 2, no traceback."""
    _, target, _, prompts = pair
    monkeypatch.setitem(sys.modules, "memra_cli.assets", None)
    draft = make_tiny_draft(tmp_path / f"v{vocab}", "deepspec", vocab=vocab, mask_token_id=min(vocab, 512) - 1,
                            markov_rank=16, confidence="markov")
    r = run("--target", target, "--draft", draft, "--prompts", prompts, "--n", "1", "--max-new", "4", "--warmup", "0",
            "--arm", "dspark")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == (f"error: --arm 'dspark': drafter tensor 'embed_tokens.weight' has {vocab} vocabulary rows "
                        f"({draft}) but the target's vocabulary is 512 ({target / 'config.json'}): a drafter must "
                        "share its target's vocabulary")


def test_chat_off_only_and_ignored_policy_env(pair):
    _, target, _, prompts = pair
    base = ["bench", "--target", str(target), "--prompts", str(prompts), "--n", "1", "--max-new", "2", "--arm", "off", "--warmup", "0"]
    plain = json.loads(runner.invoke(app, base + ["--json"]).stdout)
    chat = json.loads(runner.invoke(app, base + ["--json", "--chat"]).stdout)
    assert [a["name"] for a in plain["arms"]] == ["off", "plain"] and plain["exact"] is True
    assert chat["prompts"]["chat"] is True and chat["prompts"]["prompt_tokens"] > plain["prompts"]["prompt_tokens"]
    r = runner.invoke(app, base, env={"MEMRA_DSPARK_VT": "ladder"})
    assert r.exit_code == 0 and "warning: MEMRA_DSPARK_VT is set; bench arms ignore it" in r.stderr


def test_no_phase_times_says_so_in_the_table_and_the_json(pair):
    _, target, drafters, prompts = pair
    base = ["--target", target, "--draft", drafters["dspark"], "--prompts", prompts, "--n", "1", "--max-new", "4",
            "--warmup", "0", "--arm", "dspark", "--no-phase-times"]
    obj = json.loads(run(*base, "--json").stdout)
    assert obj["phase_times"] is False and obj["phase_clock"] is None
    assert all(a["phase_ms"] is None and a["phase_total_ms"] is None for a in obj["arms"])
    r = run(*base)
    assert r.exit_code == 0, r.output
    assert "phases: not timed (--phase-times times them" in r.stdout and "prefill" not in r.stdout


def test_stdlib_prompts_and_their_absence(pair, monkeypatch, tmp_path):
    from memra_cli.engine import prompts as pr

    _, target, drafters, _ = pair
    monkeypatch.setattr(pr, "STDLIB_JSONL", tmp_path / "stdlib.jsonl")
    base = ["--target", target, "--draft", drafters["dspark"], "--prompts", "stdlib", "--max-new", "4", "--warmup", "0",
            "--arm", "dspark"]
    r = run(*base)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == (f"error: --prompts stdlib: {tmp_path / 'stdlib.jsonl'} is missing (the embedded models' "
                                "build writes it: python -m memra_cli.assets.build)")
    rows = [{"turns": ["def quote(s):\n    \"\"\"Return a shell-escaped version of s.\"\"\"\n"], "source": "shlex.py:quote",
             "python": "3.12.3"},
            {"turns": ["def dedent(text):\n    \"\"\"Remove common leading whitespace.\"\"\"\n"], "source": "textwrap.py:dedent",
             "python": "3.12.3"}]
    (tmp_path / "stdlib.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = run(*base, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["prompts"]["set"] == "stdlib" and obj["prompts"]["n"] == 2 and obj["exact"] is True
    assert obj["prompts"]["source"].startswith("held-out CPython 3.12.3 standard-library functions")


def test_the_plain_arm_takes_no_keys(pair):
    _, target, drafters, prompts = pair
    r = run("--target", target, "--draft", drafters["dspark"], "--prompts", prompts, "--arm", "plain:cap=3")
    assert r.exit_code == 2 and r.stderr.strip().startswith(
        "error: --arm 'plain:cap=3': the plain arm (the fastest plain decoding on the device) takes no keys, got cap")
