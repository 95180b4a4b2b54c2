"""`memra parity`: make an oracle, pass it on both paths, fail a nudged one, refuse bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from memra_cli.cli import parity as parity_cli
from memra_cli.cli.app import app as memra_app
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

pytest.importorskip("transformers", reason="--make-oracle needs transformers (a test dependency)")

runner = CliRunner()
STAGES = ["ctx_features", "layer_out", "hidden_out", "draft_logits", "markov_tokens", "confidence_raw"]
RECEIPT_DSPARK = "[dspark] harvest=dspark (checkpoint census strategy_dspark=true, MEMRA_DSPARK_HARVEST unset)"


def _app() -> typer.Typer:
    """The memra app once `parity` is registered there; until then the same function alone."""
    if any(c.name == "parity" for c in memra_app.registered_commands):
        return memra_app
    local = typer.Typer(pretty_exceptions_enable=False)
    local.command(name="parity")(parity_cli.parity)

    @local.callback()
    def _root() -> None:
        """memra (test harness)."""

    return local


APP = _app()


def run(*args, env=None):
    return runner.invoke(APP, ["parity", *[str(a) for a in args]], env=env or {})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Tiny checkpoints (YaRN, a sliding layer with window < ctx, a -1 tap, markov + confidence)
    and oracles written by `memra parity --make-oracle`."""
    root = tmp_path_factory.mktemp("parity")
    target = make_tiny_qwen3(root / "target")
    zlab = make_tiny_draft(root / "zlab", "zlab", yarn=True, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=12, target_layer_ids=(0, 2))
    dspark = make_tiny_draft(root / "dspark", "deepspec", yarn=True, markov_rank=32, confidence="markov",
                             target_layer_ids=(-1, 1, 3), layer_types=("full_attention", "sliding_attention"),
                             sliding_window=12)
    r = run(zlab, "--make-oracle", root / "zlab.npz", "--target", target, "--ctx", 32, "--seed", 3)
    assert r.exit_code == 0, r.output
    r = run(dspark, "--make-oracle", root / "dspark.npz", "--ctx", 32, "--json")
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout)
    assert made["stages"] == STAGES and made["meta"]["format"] == "memra-oracle/1"
    assert made["receipt_lines"][0] == RECEIPT_DSPARK
    return root, target, zlab, dspark


def _one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def _nudged(src, dst, **change):
    with np.load(src, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    for key, fn in change.items():
        arrays[key] = fn(arrays[key]) if callable(fn) else fn
    for key in [k for k, v in change.items() if v is None]:
        arrays.pop(key)
    np.savez(dst, **arrays)
    return dst


def test_zlab_passes_both_paths_receipts_first(made):
    root, target, zlab, _ = made
    r = run(zlab, root / "zlab.npz", "--target", target)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("[dflash] harvest=dflash") and lines[1].startswith("[dflash] verify-window=Ladder")
    assert "parity PASS: 8/8 checks" in r.stdout
    # notes print whole under the table (80 columns), keyed by a marker in the row
    row = next(line for line in lines if line.split()[:2] == ["layer_out", "full"])
    assert row.rstrip().endswith("[1]") and "…" not in r.stdout
    assert any(line.startswith("[1] layer_out full: worst layer") for line in lines)


def test_deepspec_passes_with_its_own_lm_head(made):
    root, _, _, dspark = made
    r = run(dspark, root / "dspark.npz")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == RECEIPT_DSPARK
    assert "parity PASS: 12/12 checks" in r.stdout and "lm_head from checkpoint lm_head" in r.stdout


def test_json_shape(made):
    root, _, _, dspark = made
    r = run(dspark, root / "dspark.npz", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["pass"] is True and obj["failed"] == [] and obj["precision"] == "f32"
    assert obj["receipts"] == {"harvest": "dspark", "verify_window": {"policy": "confidence-slot", "tau": 0.5}}
    assert [(s["stage"], s["path"]) for s in obj["stages"]] == [(s, p) for s in STAGES for p in ("full", "cached")]
    for s in obj["stages"]:
        assert {"stage", "path", "max_abs", "rel_l2", "argmax_agree", "threshold", "pass"} <= set(s)
        assert s["pass"] is True
        if s["stage"] == "markov_tokens":
            assert s["threshold"] == "exact" and s["argmax_agree"] == 1.0 and s["rel_l2"] is None
        else:
            assert s["threshold"] == 1e-5 and s["rel_l2"] < 1e-5
    assert obj["oracle"]["meta"]["format"] == "memra-oracle/1"


@pytest.mark.parametrize("stage", STAGES)
def test_a_nudged_stage_fails_and_is_named(made, tmp_path, stage):
    root, _, _, dspark = made

    def nudge(a):
        if stage == "markov_tokens":
            a = a.copy()
            a[3] = (a[3] + 1) % 512
            return a
        return (a * np.float32(1 + 1e-3)).astype(np.float32)  # 1e-3 relative

    bad = _nudged(root / "dspark.npz", tmp_path / "nudged.npz", **{stage: nudge})
    # confidence_raw reads the oracle's chain as its previous ids, so a nudged chain fails it too
    failed = [stage, "confidence_raw"] if stage == "markov_tokens" else [stage]
    r = run(dspark, bad)
    assert r.exit_code == 1, r.output
    assert f"parity FAIL: {', '.join(failed)} ({2 * len(failed)} of 12 checks)" in r.stdout
    r = run(dspark, bad, "--json")
    assert r.exit_code == 1
    obj = json.loads(r.stdout)
    assert obj["pass"] is False and obj["failed"] == failed


@pytest.mark.parametrize("change,match", [
    ({"hidden_out": None}, "required key 'hidden_out' is missing"),
    ({"noise_embedding": None}, "required key 'noise_embedding' is missing"),
    ({"hidden_out": lambda a: a[:, :32]}, r"key 'hidden_out' has shape [8, 32], expected [8, 64]"),
    ({"meta": np.array(json.dumps({"format": "dflash-oracle", "source": "x", "block_size": 8, "ctx": 32, "anchor_token": 1}))},
     "meta 'format' is 'dflash-oracle', expected 'memra-oracle/1'"),
])
def test_bad_oracle_is_one_line_exit_2(made, tmp_path, change, match):
    root, _, _, dspark = made
    bad = _nudged(root / "dspark.npz", tmp_path / "bad.npz", **change)
    r = run(dspark, bad)
    assert r.exit_code == 2, r.output
    assert match in _one_error_line(r)


def test_oracle_of_another_drafter_exit_2(made):
    root, target, zlab, dspark = made
    r = run(dspark, root / "zlab.npz", "--target", target)
    assert r.exit_code == 2
    assert "'target_hidden' has shape [32, 128], expected [32, 192]" in _one_error_line(r)


def test_dump_writes_the_engine_arrays(made, tmp_path):
    root, _, _, dspark = made
    r = run(dspark, root / "dspark.npz", "--dump", tmp_path / "dump")
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert names == sorted(f"{p}.{s}.npy" for p in ("full", "cached") for s in STAGES)
    with np.load(root / "dspark.npz", allow_pickle=False) as npz:
        want = npz["hidden_out"]
    got = np.load(tmp_path / "dump" / "cached.hidden_out.npy", allow_pickle=False)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


def test_bf16_uses_its_own_bounds(made):
    root, _, _, dspark = made
    r = run(dspark, root / "dspark.npz", "--prec", "bf16", "--json")
    obj = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert obj["precision"] == "bf16" and obj["dtype"] == "bfloat16"
    floats = [s for s in obj["stages"] if s["stage"] != "markov_tokens"]
    assert all(s["threshold"] == 2.0 ** -5 and 1e-5 < s["rel_l2"] < 2.0 ** -5 for s in floats)
    assert all(s["threshold"] == "reported" for s in obj["stages"] if s["stage"] == "markov_tokens")


def test_quantized_prec_passes(made):
    root, _, _, dspark = made
    r = run(dspark, root / "dspark.npz", "--prec", "q8", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["precision"] == "q8" and obj["pass"] is True


@pytest.mark.parametrize("args,match", [
    ([], "give exactly one of ORACLE.npz"),
    (["ORACLE", "--make-oracle", "x.npz"], "give exactly one of ORACLE.npz"),
    (["ORACLE", "--ctx", "8"], "--ctx and --seed apply to --make-oracle only"),
    (["--make-oracle", "x.npz", "--dump", "d"], "--make-oracle computes in float64 on CPU"),
    (["ORACLE", "--dtype", "float16"], "--dtype float16: expected auto|float32|bfloat16"),
])
def test_flag_refusals(made, args, match):
    root, _, _, dspark = made
    args = [root / "dspark.npz" if a == "ORACLE" else a for a in args]
    r = run(dspark, *args)
    assert r.exit_code == 2, r.output
    assert match in _one_error_line(r)


def test_a_quantized_gguf_is_judged_by_its_own_policy(made, tmp_path):
    """Parity on a q8 GGUF without --prec uses the file's policy (and its bounds)."""
    from memra_cli.engine.quant.gguf_write import write_gguf

    root, _, _, dspark = made
    out = tmp_path / "d.q8.gguf"
    write_gguf(out, dspark, "q8")
    r = run(out, root / "dspark.npz", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["precision"] == "q8" and obj["pass"] is True
    hidden = [s for s in obj["stages"] if s["stage"] == "hidden_out"]
    assert all(1e-4 < s["rel_l2"] < s["threshold"] == 2.0 ** -4 for s in hidden)
