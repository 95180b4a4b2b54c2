"""`python -m benchmarks.gpu.drafter_round` on the CPU (`--tiny`): every section runs, the JSON carries
the keys the GPU run is read for, and speculative == plain greedy."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.gpu.drafter_round"  # run as a module from the repo root, as on the GPU
KEYS = ("draft_ingest_ms", "propose_ms", "ingest_ms", "plain_step_ms", "verify_step_ms", "round_ms",
        "round_over_plain", "q8_0_bw_frac", "q4_0_bw_frac", "quant_bw", "drafter_bytes", "floor_ms", "exact",
        "copy_bw", "lm_head_bytes")


@pytest.mark.exhaustive  # a GPU benchmark script's CPU smoke (quick-tier time; the suite runs it for real)
def test_tiny_run_writes_every_key_and_is_exact(tmp_path):
    out = tmp_path / "round.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", MODULE, "--tiny", "--prompts", "2", "--draft-vocab", "100", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    for key in KEYS:
        assert key in d, key
    assert d["errors"] == {}, d["errors"]
    assert d["exact"] is True and d["exact_prompts"] == "2/2"
    for prec in ("bf16", "q8", "q4"):
        assert d["draft_ingest_ms"][prec] > 0 and d["floor_ms"][prec] > 0
    # quantized weights are fewer bytes than the compute-dtype ones
    assert d["drafter_bytes"]["q4"] < d["drafter_bytes"]["q8"] < d["drafter_bytes"]["bf16"]
    assert d["plain_step_ms"] > 0 and d["verify_step_ms"] > 0 and d["round_ms"] > 0
    assert "skipped" in d["quant_bw"]  # the kernels are timed on the GPU only
    # every precision's layers fuse at load: 4 weight-matmul launches a layer a block forward, 1 an ingest
    for prec in ("bf16", "q8", "q4"):
        n = d["matmul_launches"][prec]
        assert n == {"round": 4 * n["layers"], "ingest": n["layers"] + 1, "layers": n["layers"]}, (prec, n)
    assert d["launched_shapes"]["bf16"] == []  # no quantized weight: no quantized launch to time
    gate_up = [s for s in d["launched_shapes"]["q8"] if s[2]]
    assert len(gate_up) == 1 and d["launched_shapes"]["q4"] == d["launched_shapes"]["q8"]
    assert "exact: True" in proc.stdout  # the table is printed
    vocab = d["draft_vocab"]  # the drafter again with a 100-token draft vocabulary: exact at both precisions
    assert vocab["size"] == 100 and vocab["exact"] is True and vocab["exact_prompts"] == {"bf16": "2/2", "q8": "2/2"}
    assert all(vocab["draft_ingest_ms"][p] > 0 and vocab["round_ms"][p] > 0 for p in ("bf16", "q8"))


@pytest.fixture
def script_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # `benchmarks` is a package of the repo, not installed
    return importlib.import_module(MODULE)


def test_a_failing_section_is_recorded_and_the_report_still_written(script_module, tmp_path):
    rep = script_module.Report(tmp_path / "r.json", {"value": None})
    with rep.section("broken"):
        raise RuntimeError("boom")
    with rep.section("fine"):
        rep.data["value"] = 3
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["errors"] == {"broken": "RuntimeError: boom"} and d["value"] == 3
    assert set(d["section_s"]) == {"broken", "fine"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present: the round would run")
def test_quant_tuned_table_replaces_the_kernels_tiles_or_is_refused(script_module, tmp_path, capsys):
    """`--quant-tuned` loads a sweep's table into quant_tuning.TUNED before anything runs (on the CPU
    the run then stops: no CUDA device), and a bad entry is a one-line usage error naming it."""
    from memra_kernels import quant_tuning

    saved = dict(quant_tuning.TUNED)
    try:
        good = tmp_path / "quant_tuned.json"
        good.write_text(json.dumps({"q8_0 64x256": {"block_m": 16, "block_n": 32, "split_k": 2}}))
        assert script_module.main(["--quant-tuned", str(good), "--json", str(tmp_path / "r.json")]) == 1
        assert quant_tuning.TUNED == {("q8_0", 64, 256): quant_tuning.KernelConfig(block_m=16, block_n=32, split_k=2)}
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"q8_0 64by256": {}}))
        with pytest.raises(SystemExit) as exc:
            script_module.main(["--quant-tuned", str(bad)])
        assert exc.value.code == 2 and "entry 'q8_0 64by256'" in capsys.readouterr().err
    finally:
        quant_tuning.TUNED.clear()
        quant_tuning.TUNED.update(saved)
        quant_tuning._CONFIG_CACHE.clear()
