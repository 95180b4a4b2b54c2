"""`memra census`: receipts, --json, and the bad-input matrix (one `error:` line, non-zero exit)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()


def run(args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env or {})


def test_dflash_without_heads_receipts(draft_dir):
    r = run(["census", draft_dir("zlab")])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[-2:] == [
        "[dflash] harvest=dflash (checkpoint census strategy_dspark=false, MEMRA_DSPARK_HARVEST unset)",
        "[dflash] verify-window=Ladder (accept-rate head ABSENT -> ladder, MEMRA_DSPARK_VT unset)",
    ]


def test_deepspec_with_confidence_head_receipts(draft_dir):
    d = draft_dir("deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3))
    r = run(["census", d])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-2:] == [
        "[dspark] harvest=dspark (checkpoint census strategy_dspark=true, MEMRA_DSPARK_HARVEST unset)",
        "[dspark] verify-window=ConfidenceSlot{tau=0.5} (accept-rate head present, MEMRA_DSPARK_VT unset)",
    ]
    r = run(["census", d], env={"MEMRA_DSPARK_VT": "confidence", "MEMRA_DSPARK_VT_TAU": "0.35"})
    assert r.stdout.strip().splitlines()[-1] == (
        "[dspark] verify-window=Confidence{tau=0.35} (accept-rate head present, MEMRA_DSPARK_VT set)"
    )
    # the flag and the env var are one setting
    r2 = run(["census", d, "--vt", "confidence", "--tau", "0.35"])
    assert r2.stdout.strip().splitlines()[-1] == r.stdout.strip().splitlines()[-1]


def test_json_output(draft_dir):
    d = draft_dir("deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3), yarn=True)
    r = run(["census", d, "--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["kind"] == "dspark" and obj["strategy_dspark"] is True
    assert (obj["block_size"], obj["mask_token_id"], obj["target_layer_ids"]) == (8, 511, [-1, 1, 3])
    assert (obj["n_layers"], obj["hidden_size"]) == (2, 64)
    assert obj["markov"] == {"rank": 32, "type": "vanilla"}
    assert obj["confidence"] == {"in_dim": 96, "with_markov": True}
    assert obj["rope"]["type"] == "yarn" and len(obj["rope"]["divisors"]) == 8
    assert obj["unknown_tensors"] == []
    assert obj["receipts"] == {"harvest": "dspark", "verify_window": {"policy": "confidence-slot", "tau": 0.5}}
    assert obj["receipt_lines"][0].startswith("[dspark] harvest=dspark")


def test_unknown_tensor_on_plain_dflash_warns_and_exits_zero(draft_dir):
    d = draft_dir("zlab", extra_tensors={"extra.weight": torch.zeros(2)})
    r = run(["census", d])
    assert r.exit_code == 0
    assert "extra.weight" in r.stderr and "warning" in r.stderr


def _rewrite(d, fn):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _config_edit(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-64])
    return d


def _empty_dir(d):
    d.mkdir()
    return d


def _bad_json(d):
    (d / "config.json").write_text("{oops")
    return d


def _no_weights(d):
    (d / "model.safetensors").unlink()
    return d


def _pickle_only(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    return d


BAD = {
    "not a directory": (lambda mk, tmp: tmp / "missing", {}, "no such file or directory"),
    "no config.json": (lambda mk, tmp: _empty_dir(tmp / "empty"), {}, "no config.json"),
    "config not JSON": (lambda mk, tmp: _bad_json(mk("zlab")), {}, "not valid JSON"),
    "required key missing": (lambda mk, tmp: _config_edit(mk("zlab"), lambda c: c.pop("hidden_size")), {}, "required key 'hidden_size' is missing"),
    "key of wrong type": (lambda mk, tmp: _config_edit(mk("zlab"), lambda c: c.update(num_hidden_layers="two")), {}, "key 'num_hidden_layers' must be an integer"),
    "no weights file": (lambda mk, tmp: _no_weights(mk("zlab")), {}, "no weights file"),
    "truncated safetensors": (lambda mk, tmp: _truncate(mk("zlab")), {}, "truncated"),
    "tensor missing": (lambda mk, tmp: _rewrite(mk("zlab"), lambda t: t.pop("norm.weight")), {}, "tensor 'norm.weight' is missing"),
    "tensor wrong shape": (lambda mk, tmp: _rewrite(mk("zlab"), lambda t: t.update({"norm.weight": torch.ones(63)})), {}, "'norm.weight' has shape [63], expected [64]"),
    "unknown tensor on DSpark": (lambda mk, tmp: mk("deepspec", extra_tensors={"what.weight": torch.zeros(1)}), {}, "unrecognized tensors on a DSpark-class export: what.weight"),
    "unsupported markov type": (lambda mk, tmp: mk("deepspec", markov_rank=8, markov_type="gated"), {}, "markov_head_type 'gated' is recognized but not implemented"),
    "impossible confidence width": (
        lambda mk, tmp: mk("deepspec", extra_tensors={"confidence_head.proj.weight": torch.zeros(1, 3), "confidence_head.proj.bias": torch.zeros(1)}, config_overrides={"enable_confidence_head": True}),
        {}, "in_dim 3, which matches neither hidden_size 64",
    ),
    "pickle checkpoint": (lambda mk, tmp: _pickle_only(mk("zlab")), {}, "memra never unpickles"),
    "harvest=shifted": (lambda mk, tmp: mk("zlab"), {"MEMRA_DSPARK_HARVEST": "shifted"}, "--harvest / MEMRA_DSPARK_HARVEST=shifted (from the environment): unknown harvest convention"),
    "vt=static": (lambda mk, tmp: mk("zlab"), {"MEMRA_DSPARK_VT": "static"}, "--vt / MEMRA_DSPARK_VT=static (from the environment): unknown verify-window policy"),
    "tau=1.5": (lambda mk, tmp: mk("deepspec", confidence="plain"), {"MEMRA_DSPARK_VT_TAU": "1.5"}, "--tau / MEMRA_DSPARK_VT_TAU=1.5 (from the environment): confidence threshold must be in (0,1)"),
    "confidence with adapt=0": (lambda mk, tmp: mk("deepspec", confidence="plain"), {"MEMRA_DSPARK_VT": "confidence", "MEMRA_DFLASH_ADAPT": "0"}, "contradictory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_matrix(case, draft_dir, tmp_path):
    make, env, message = BAD[case]
    target = make(draft_dir, tmp_path)
    r = run(["census", target], env=env)
    assert r.exit_code == 2, (case, r.output)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert message in err[0]
    assert "Traceback" not in r.output and r.stdout == ""


def test_real_entry_point_refuses_with_one_line(tmp_path):
    """Through the installed interpreter entry (`python -m memra_cli`), not the test runner."""
    r = subprocess.run([sys.executable, "-m", "memra_cli", "census", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such file or directory"]
    assert r.stdout == ""


def test_debug_env_keeps_the_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "memra_cli", "census", str(tmp_path / "nope")],
        capture_output=True, text=True, env={**__import__("os").environ, "MEMRA_DEBUG": "1"},
    )
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr
