"""`memra quantize`: receipts first, the per-tensor table and totals, --json, census of the file,
`memra generate --draft FILE.gguf` / `--prec` streams equal plain greedy, and the bad-input list
(NaN weights, rows not whole blocks, existing / unwritable --out, interrupted write): one
`error:` line, non-zero exit, nothing left behind."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

runner = CliRunner()
DSPARK = dict(markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3))


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env or {})


def _one_error_line(r) -> str:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    target = make_tiny_qwen3(root / "target")
    dspark = make_tiny_draft(root / "dspark", "deepspec", dtype=torch.bfloat16, **DSPARK)
    dflash = make_tiny_draft(root / "dflash", "zlab", dtype=torch.bfloat16)
    return root, target, dspark, dflash


def test_quantize_report_receipts_first(made, tmp_path):
    _, _, dspark, _ = made
    out = tmp_path / "d.gguf"
    r = run("quantize", dspark, "--policy", "q8", "--out", out)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("memra quantize") and "(policy q8)" in lines[0]
    assert lines[1].startswith("source: dspark drafter, 2 layers × hidden 64, 31 tensors")
    assert lines[2] == "[dspark] harvest=dspark (checkpoint census strategy_dspark=true, MEMRA_DSPARK_HARVEST unset)"
    assert lines[3].startswith("[dspark] verify-window=ConfidenceSlot{tau=0.5}")
    table = r.stdout[r.stdout.index("tensors"):]
    for head in ("tensor", "shape", "type", "bytes before", "bytes after", "rel RMS err"):
        assert head in table
    row = next(l for l in lines if l.strip().startswith("layers.0.mlp.up_proj.weight"))
    assert row.split()[1:5] == ["128×64", "BF16→Q8_0", "16,384", "8,704"]
    assert float(row.split()[5]) < 1e-2
    assert next(l for l in lines if l.strip().startswith("norm.weight")).split()[1:3] == ["64", "BF16→F32"]
    total = next(l for l in lines if l.startswith("total: "))
    assert "31 tensors" in total and "ratio" in total and total.rstrip().endswith(" s")
    assert lines[-1] == f"wrote {out}"
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["d.gguf"]


def test_quantize_json(made, tmp_path):
    _, _, dspark, _ = made
    out = tmp_path / "d.gguf"
    r = run("quantize", dspark, "--policy", "mixed", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["policy"] == "mixed" and obj["out"] == str(out) and obj["source"] == str(dspark)
    assert obj["receipts"] == {"harvest": "dspark", "verify_window": {"policy": "confidence-slot", "tau": 0.5}}
    assert obj["receipt_lines"][0].startswith("[dspark] harvest=dspark")
    rows = {t["name"]: t for t in obj["tensors"]}
    assert len(rows) == 31
    up, q = rows["layers.1.mlp.up_proj.weight"], rows["layers.1.self_attn.q_proj.weight"]
    assert (up["type"], up["shape"], up["bytes_before"], up["bytes_after"]) == ("Q8_0", [128, 64], 16384, 8704)
    assert 1e-3 < up["rel_rms_error"] < 1e-2
    assert (q["type"], q["rel_rms_error"]) == ("BF16", 0.0)
    assert rows["markov_head.markov_w2.weight"]["type"] == "Q8_0"
    assert rows["markov_head.markov_w1.weight"]["type"] == "BF16"
    assert rows["confidence_head.proj.weight"]["type"] == "F32"
    t = obj["totals"]
    assert t["n_tensors"] == 31 and t["bytes_before"] == sum(x["bytes_before"] for x in obj["tensors"])
    assert t["bytes_after"] == sum(x["bytes_after"] for x in obj["tensors"])
    assert t["file_bytes"] == out.stat().st_size and t["ratio"] == t["bytes_before"] / t["bytes_after"]
    assert t["seconds"] > 0 and obj["kept_unquantized"] == []


def _census(path):
    r = run("census", path, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("which", ["dspark", "dflash"])
def test_census_of_the_gguf_is_the_source_census(made, tmp_path, which):
    root, _, dspark, dflash = made
    src = dspark if which == "dspark" else dflash
    out = tmp_path / f"{which}.gguf"
    assert run("quantize", src, "--policy", "q4", "--out", out).exit_code == 0
    a, b = _census(src), _census(out)
    assert b["checkpoint"] == {"format": "gguf", "files": [str(out)]} and b["path"] == str(out)
    assert b["n_bytes"] < a["n_bytes"]
    for key in ("path", "checkpoint", "n_bytes"):
        a.pop(key), b.pop(key)
    assert a == b
    r = run("census", out)
    assert r.exit_code == 0 and "gguf, 1 file(s)" in r.stdout and "Q4_0×" in r.stdout


# --------------------------------------------------------------------------- generate


def _ref(target_dir, ids, n):
    eos = Qwen3Target.from_dir(target_dir).cfg.eos_token_ids
    return greedy_reference(Qwen3Target.from_dir(target_dir), ids, n, eos)


@pytest.fixture(scope="module")
def files(made):
    root, _, dspark, dflash = made
    out = {}
    for name, src, policy in (("dspark-q8", dspark, "q8"), ("dspark-q4", dspark, "q4"), ("dflash-mixed", dflash, "mixed")):
        out[name] = root / f"{name}.gguf"
        assert run("quantize", src, "--policy", policy, "--out", out[name]).exit_code == 0
    return out


IDS = [5, 17, 42, 99]


@pytest.mark.parametrize("name", ["dspark-q8", "dspark-q4", "dflash-mixed"])
def test_generate_with_a_gguf_drafter_equals_plain_greedy(made, files, name):
    _, target, _, _ = made
    r = run("generate", "--target", target, "--draft", files[name], "--prompt-ids", "5,17,42,99", "--max-new", "20", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["tokens"] == _ref(target, IDS, 20)
    assert obj["mode"] == name.split("-")[0] and obj["precision"] == name.split("-")[1]
    assert obj["stats"]["rounds"] >= 1


@pytest.mark.parametrize("prec", ["q8", "mixed", "fc", "q4", "bf16", "f32"])
def test_generate_prec_equals_plain_greedy(made, prec):
    _, target, dspark, _ = made
    r = run("generate", "--target", target, "--draft", dspark, "--prec", prec, "--prompt-ids", "5,17,42,99", "--max-new", "20", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["tokens"] == _ref(target, IDS, 20) and obj["precision"] == prec


def test_generate_prec_env_and_gguf_equal_each_other(made, files):
    """--prec q8 (here through MEMRA_DFLASH_PREC) and the q8 GGUF are the same drafter: the same
    drafts, so the same rounds and acceptance, not only the same (greedy) tokens."""
    _, target, dspark, _ = made
    args = ["generate", "--target", target, "--prompt-ids", "5,17,42,99", "--max-new", "24", "--json"]
    a = run(*args, "--draft", dspark, env={"MEMRA_DFLASH_PREC": "q8"})
    b = run(*args, "--draft", files["dspark-q8"])
    c = run(*args, "--draft", files["dspark-q8"], env={"MEMRA_DFLASH_PREC": "q8"})  # repeating the policy is fine
    assert a.exit_code == b.exit_code == c.exit_code == 0, (a.output, b.output, c.output)
    oa, ob, oc = (json.loads(x.stdout) for x in (a, b, c))
    assert oa["precision"] == ob["precision"] == "q8"
    for k in ("rounds", "drafted", "accepted"):
        assert oa["stats"][k] == ob["stats"][k] == oc["stats"][k], k
    assert oa["tokens"] == ob["tokens"] == _ref(target, IDS, 24)


def test_generate_prec_human_output_names_it(made):
    _, target, dspark, _ = made
    r = run("generate", "--target", target, "--draft", dspark, "--prec", "q4", "--prompt-ids", "1,2,3", "--max-new", "4")
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("[dspark] harvest=") and err[3] == "note: drafter precision q4 (--prec / MEMRA_DFLASH_PREC)"


def test_generate_prec_reports_kept_tensors(made, tmp_path):
    _, target, _, _ = made
    d = make_tiny_draft(tmp_path / "r16", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    r = run("generate", "--target", target, "--draft", d, "--prec", "q8", "--prompt-ids", "1,2,3", "--max-new", "6", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert any("markov_head.markov_w2.weight" in w and "not a multiple of 32" in w for w in obj["warnings"])
    assert obj["tokens"] == _ref(target, [1, 2, 3], 6)


@pytest.mark.parametrize("args,env,match", [
    (["--prec", "q5"], {}, "error: --prec q5: unknown precision policy (expected f32|bf16|q8|mixed|fc|q4)"),
    ([], {"MEMRA_DFLASH_PREC": "int8"}, "error: --prec / MEMRA_DFLASH_PREC=int8 (from the environment): unknown precision policy"),
    (["--draft", "GGUF", "--prec", "q4"], {}, "error: --prec q4: {gguf} is a GGUF written under policy q8 and loads as written"),
    (["--draft", "GGUF"], {"MEMRA_DFLASH_PREC": "bf16"}, "error: --prec / MEMRA_DFLASH_PREC=bf16 (from the environment): {gguf} is a GGUF"),
])
def test_generate_prec_refusals(made, files, args, env, match):
    _, target, dspark, _ = made
    args = [files["dspark-q8"] if a == "GGUF" else a for a in args]
    if "--draft" not in args:
        args += ["--draft", dspark]
    r = run("generate", "--target", target, "--prompt-ids", "1,2", *args, env=env)
    assert r.exit_code == 2, r.output
    assert match.format(gguf=files["dspark-q8"]) in _one_error_line(r)


# --------------------------------------------------------------------------- bad input


def test_existing_out_needs_force(made, tmp_path):
    _, _, _, dflash = made
    out = tmp_path / "x.gguf"
    out.write_bytes(b"precious")
    r = run("quantize", dflash, "--out", out)
    assert r.exit_code == 2
    assert _one_error_line(r) == f"error: --out {out}: file exists (pass --force to overwrite)"
    assert r.stdout == "" and out.read_bytes() == b"precious"
    r = run("quantize", dflash, "--out", out, "--force", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy"] == "q8" and out.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


@pytest.mark.parametrize("where,match", [
    ("missing-dir", "does not exist (memra creates no directories)"),
    ("under-a-file", "is not a directory"),
    ("read-only-dir", "cannot write in"),
    ("not-gguf", "expected a .gguf file name"),
])
def test_unwritable_out(made, tmp_path, where, match):
    _, _, _, dflash = made
    (tmp_path / "afile").write_bytes(b"x")
    ro = tmp_path / "ro"
    ro.mkdir()
    out = {"missing-dir": tmp_path / "nope" / "x.gguf", "under-a-file": tmp_path / "afile" / "x.gguf",
           "read-only-dir": ro / "x.gguf", "not-gguf": tmp_path / "x.safetensors"}[where]
    if where == "read-only-dir":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        ro.chmod(0o500)
    try:
        r = run("quantize", dflash, "--out", out)
    finally:
        ro.chmod(0o700)
    assert r.exit_code == 2, r.output
    assert match in _one_error_line(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ro"] and list(ro.iterdir()) == []


def test_nan_weights(tmp_path):
    bad = torch.randn(128, 64)
    bad[3, 3] = float("nan")
    src = make_tiny_draft(tmp_path / "nan", "zlab", extra_tensors={"layers.0.mlp.gate_proj.weight": bad})
    r = run("quantize", src, "--out", tmp_path / "nan.gguf", "--policy", "q4")
    assert r.exit_code == 2
    assert "tensor 'layers.0.mlp.gate_proj.weight' has NaN/Inf values" in _one_error_line(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]


def test_rows_not_whole_blocks_are_kept_and_reported(tmp_path):
    src = make_tiny_draft(tmp_path / "r16", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    r = run("quantize", src, "--out", tmp_path / "r16.gguf")
    assert r.exit_code == 0, r.output
    warn = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
    assert warn == ["warning: tensor 'markov_head.markov_w2.weight' rows of 16 values are not a multiple of 32: "
                    "kept unquantized (as stored), not q8_0"]
    row = next(l for l in r.stdout.splitlines() if l.strip().startswith("markov_head.markov_w2.weight"))
    assert "F32→F32 (kept)" in row
    r = run("quantize", src, "--out", tmp_path / "r16.gguf", "--force", "--json")
    assert json.loads(r.stdout)["kept_unquantized"][0]["name"] == "markov_head.markov_w2.weight"


@pytest.mark.parametrize("exc,code,match", [
    (KeyboardInterrupt, 130, "error: interrupted"),
    (OSError, 2, "cannot write (No space left on device)"),
])
def test_interrupted_write_leaves_no_partial_file(made, tmp_path, monkeypatch, exc, code, match):
    _, _, dspark, _ = made
    real = gguf.GGUFWriter.write_tensor_data
    calls = []

    def flaky(self, tensor, *a, **k):
        calls.append(1)
        if len(calls) == 7:  # mid-way: header and 6 tensors already on disk
            raise exc(28, "No space left on device") if exc is OSError else exc()
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", flaky)
    r = run("quantize", dspark, "--out", tmp_path / "half.gguf")
    assert r.exit_code == code, r.output
    assert match in _one_error_line(r)
    assert len(calls) == 7 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,match", [
    (["--policy", "q5"], "--policy: unknown precision policy 'q5' (expected q8|mixed|fc|q4)"),
    (["--policy", "bf16"], "--policy: unknown precision policy 'bf16'"),
])
def test_flag_refusals(made, tmp_path, args, match):
    _, _, dspark, _ = made
    r = run("quantize", dspark, "--out", tmp_path / "x.gguf", *args)
    assert r.exit_code == 2
    assert match in _one_error_line(r)


def test_source_refusals(made, files, tmp_path):
    root, _, _, _ = made
    r = run("quantize", files["dspark-q8"], "--out", tmp_path / "x.gguf")
    assert r.exit_code == 2 and "already a GGUF" in _one_error_line(r)
    r = run("quantize", tmp_path / "nowhere", "--out", tmp_path / "x.gguf")
    assert r.exit_code == 2 and "no such file or directory" in _one_error_line(r)
    r = run("quantize", root / "target", "--out", tmp_path / "x.gguf")  # a target, not a drafter
    assert r.exit_code == 2 and _one_error_line(r)
    assert list(tmp_path.iterdir()) == []


def test_gguf_bytes_equal_the_gguf_package(made, files):
    """The CLI's file, read back with the gguf package: every quantized tensor equals
    gguf.quants.quantize of the source values."""
    from memra_cli.engine.formats.checkpoint import open_checkpoint

    _, _, dspark, _ = made
    src = open_checkpoint(dspark)
    reader = gguf.GGUFReader(files["dspark-q4"])
    n = 0
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            want = gguf.quants.quantize(src.load(t.name, torch.float32).numpy(), gguf.GGMLQuantizationType.Q4_0)
            assert np.array_equal(np.asarray(t.data).reshape(-1), want.reshape(-1)), t.name
            n += 1
    assert n == 2 * 7 + 2  # 7 per layer, fc, markov w2
