"""`memra generate`: text and ids, --json, receipts first, streams equal plain greedy, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dspark = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    dflash = make_tiny_draft(root / "dflash", "zlab")
    return root, target, dspark, dflash


def run(*args, env=None):
    return runner.invoke(app, ["generate", *[str(a) for a in args]], env=env or {})


def _ref(target_dir, ids, n):
    eos = Qwen3Target.from_dir(target_dir).cfg.eos_token_ids
    return greedy_reference(Qwen3Target.from_dir(target_dir), ids, n, eos)


@pytest.mark.parametrize("which", ["dspark", "dflash", None])
def test_json_stream_equals_plain_greedy(pair, which):
    root, target, dspark, dflash = pair
    args = ["--target", target, "--prompt-ids", "5,17,42,99", "--max-new", "24", "--json"]
    if which:
        args += ["--draft", dspark if which == "dspark" else dflash]
    r = run(*args)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["tokens"] == _ref(target, [5, 17, 42, 99], 24)
    assert obj["mode"] == (which or "off")
    assert set(obj["stats"]) >= {"rounds", "drafted", "accepted", "tau", "tok_per_s", "phase_ms"}
    assert obj["stats"]["rounds"] >= 1 and obj["stats"]["tau"] >= 1.0
    if which == "dspark":
        assert obj["receipts"] == {"harvest": "dspark", "verify_window": {"policy": "confidence-slot", "tau": 0.5},
                                   "block_embedding": {"scaled": False, "scale": 1.0, "set": False}}
    elif which == "dflash":
        assert obj["receipts"]["harvest"] == "dflash" and obj["receipts"]["verify_window"]["policy"] == "ladder"
    else:
        assert obj["receipts"] is None


def test_text_prompt_streams_with_receipts_first(pair):
    root, target, dspark, _ = pair
    r = run("--target", target, "--draft", dspark, "--prompt", "def fibonacci(n):", "--max-new", "12", "--chat")
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("[dspark] harvest=dspark (checkpoint census strategy_dspark=true")
    assert err[1].startswith("[dspark] verify-window=ConfidenceSlot{tau=0.5}")
    assert err[-1].startswith("[dspark] tokens=12 rounds=") and "tau=" in err[-1] and "phase_ms:" in err[-1]
    assert r.stdout.strip()  # some text streamed


def test_spec_dflash_forces_ladder_and_names_it(pair):
    _, target, dspark, _ = pair
    r = run("--target", target, "--draft", dspark, "--spec", "dflash", "--prompt-ids", "1,2,3", "--max-new", "8", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["receipts"]["verify_window"]["policy"] == "ladder"
    assert obj["receipt_lines"][1].endswith("--spec dflash -> ladder)")
    r = run("--target", target, "--draft", dspark, "--vt", "confidence", "--tau", "0.3", "--prompt-ids", "1,2,3", "--max-new", "8", "--json")
    assert json.loads(r.stdout)["receipts"]["verify_window"] == {"policy": "confidence", "tau": 0.3}


def _mismatched(root, name, **kw):
    return make_tiny_draft(root / name, "zlab", **kw)


BAD = {
    "hidden size mismatch": (lambda root: ["--draft", _mismatched(root, "h", hidden=32, head_dim=8)], "drafter hidden_size 32"),
    "mask token outside target": (lambda root: ["--draft", _mismatched(root, "m", vocab=1024, mask_token_id=1000)], "mask_token_id 1000"),
    "tap outside target": (lambda root: ["--draft", _mismatched(root, "t", target_layer_ids=(0, 7), num_target_layers=8)], "target_layer_id 7"),
    "prompt id outside vocab": (lambda root: ["--prompt-ids", "1,99999"], "prompt token id 99999"),
    "empty prompt": (lambda root: ["--prompt-ids", ""], "prompt is empty"),
    "bad ids": (lambda root: ["--prompt-ids", "1,x"], "expected comma-separated integers"),
    "beyond positions": (lambda root: ["--prompt-ids", "1,2", "--max-new", "5000"], "exceeds max_position_embeddings 2048"),
    "dspark without draft": (lambda root: ["--spec", "dspark"], "--spec dspark needs a drafter"),
    "confidence without head": (lambda root: ["--draft", root / "dflash", "--spec", "dspark", "--vt", "confidence"], "needs a checkpoint with an accept-rate head"),
    "unknown spec": (lambda root: ["--spec", "fast"], "--spec fast: expected off|dflash|dspark|auto"),
    "both prompts": (lambda root: ["--prompt", "x"], "exactly one of --prompt"),
    "step width zero": (lambda root: ["--step-width", "0"], "--step-width 0: expected a positive integer"),
    "step width word": (lambda root: ["--step-width", "fixed"], "or 'variable'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(pair, case):
    root, target, _, _ = pair
    extra, message = BAD[case]
    args = ["--target", target, *extra(root)]
    if "--prompt-ids" not in args and "--prompt" not in args:
        args += ["--prompt-ids", "1,2,3"]
    elif case == "both prompts":
        args += ["--prompt-ids", "1"]
    r = run(*args)
    assert r.exit_code == 2, (case, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("vocab", [1024, 256], ids=["drafter-larger", "drafter-smaller"])
@pytest.mark.parametrize("spec", ["auto", "dspark", "dflash"])
def test_a_drafter_of_another_vocabulary_is_refused(pair, tmp_path, vocab, spec):
    """A drafter must index the target's vocabulary: one `error:` line naming the tensor and
    both sizes, exit 2, no traceback (MEMRA_DEBUG unset)."""
    _, target, _, _ = pair
    draft = make_tiny_draft(tmp_path / f"v{vocab}", "deepspec", vocab=vocab, mask_token_id=min(vocab, 512) - 1,
                            markov_rank=16, confidence="markov")
    r = run("--target", target, "--draft", draft, "--spec", spec, "--prompt-ids", "1,2,3", "--max-new", "4")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == (f"error: drafter tensor 'embed_tokens.weight' has {vocab} vocabulary rows ({draft}) but the "
                        f"target's vocabulary is 512 ({target / 'config.json'}): a drafter must share its target's "
                        "vocabulary")


def test_a_drafter_tapping_the_last_layer_is_warned_about(pair, tmp_path):
    _, target, _, _ = pair
    draft = make_tiny_draft(tmp_path / "last", "zlab", target_layer_ids=(0, 3))
    r = run("--target", target, "--draft", draft, "--prompt-ids", "1,2,3", "--max-new", "4", "--json")
    assert r.exit_code == 0, r.output
    assert any(w.startswith("drafter taps the target's last layer (3)") for w in json.loads(r.stdout)["warnings"])


@pytest.mark.parametrize("given, width", [(None, 16), ("4", 4), ("variable", None)])
def test_step_width_is_applied_reported_and_exact(pair, given, width):
    """The target's step width reaches the JSON and a stderr note, and the stream stays greedy."""
    root, target, dspark, _ = pair
    base = ["--target", target, "--draft", dspark, "--prompt-ids", "5,17,42,99", "--max-new", "24"]
    extra = [] if given is None else ["--step-width", given]
    obj = json.loads(run(*base, *extra, "--json").stdout)
    assert obj["step_width"] == width and obj["tokens"] == _ref(target, [5, 17, 42, 99], 24)
    r = run(*base, *extra)
    assert r.exit_code == 0, r.output
    note = next(line for line in r.stderr.splitlines() if line.startswith("note: target steps"))
    steps, graphs = note.split("; CUDA graphs ")
    assert ("default" in steps) == (given is None) and (str(width) in steps if width else "variable" in steps)
    assert graphs.startswith("off (default: not on CUDA") or torch.cuda.is_available()
    env = run(*base, "--json", env={"MEMRA_STEP_WIDTH": given or "16"})
    assert json.loads(env.stdout)["step_width"] == width


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graphs_refused_without_cuda(pair):
    _, target, _, _ = pair
    r = run("--target", target, "--prompt-ids", "1", "--cuda-graphs")
    assert r.exit_code == 2 and r.stderr.strip() == (
        "error: --cuda-graphs needs --device cuda and a fixed --step-width (device cpu, step width 16)")
    obj = json.loads(run("--target", target, "--prompt-ids", "1", "--no-cuda-graphs", "--json").stdout)
    assert obj["cuda_graphs"] is False
    for name in ("MEMRA_DRAFT_GRAPHS", "MEMRA_ROUND_GRAPHS"):
        for value, message in (("yes", f"error: {name}='yes': expected 0 or 1"),
                               ("1", f"error: {name}=1 needs the target's CUDA graphs on")):
            r = run("--target", target, "--prompt-ids", "1", env={name: value})
            assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
            assert r.stderr.startswith(message)
    assert run("--target", target, "--prompt-ids", "1", env={"MEMRA_ROUND_GRAPHS": "0"}).exit_code == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda(pair):
    _, target, _, _ = pair
    r = run("--target", target, "--prompt-ids", "1", "--device", "cuda")
    assert r.exit_code == 2 and r.stderr.strip() == "error: --device cuda: CUDA is not available on this machine"


def test_fresh_install_script_and_entry_point(tmp_path):
    """The README flow: tiny checkpoints from the module script, then the console entry."""
    subprocess.run([sys.executable, "-m", "memra_cli.tiny", str(tmp_path)], check=True, capture_output=True)
    r = subprocess.run(
        [sys.executable, "-m", "memra_cli", "generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "dspark"),
         "--prompt", "def add(a, b):", "--max-new", "8"],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("[dspark] harvest=dspark") and "tokens=8" in r.stderr
