"""benchmarks/moe_hybrid_step.py on the tiny shape on the CPU: it builds a random Qwen3.5 MoE
hybrid in memory, prefills a context, times fixed steps of several widths on the torch step ops,
counts the experts each ran and writes its table; the kernels (CUDA only) refused on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.exhaustive  # the whole script on a tiny hybrid MoE, twin and kernels (quick-tier time)
def test_times_hybrid_steps_and_counts_their_experts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "hybrid.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe_hybrid_step", "--shape", "tiny", "--device", "cpu",
                           "--dtype", "float32", "--iters", "1", "--vts", "1,16", "--context", "40", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    obj = json.loads(out.read_text())
    rows = obj["rows"]
    # the kernels need CUDA; vt=1 also as the engine's 16-row step with one live row, a verify's and
    # the plain round's (one row read)
    assert [(r["ops"], r["vt"], r["width"], r.get("reads")) for r in rows] == [
        ("torch", 1, None, None), ("torch", 1, 16, None), ("torch", 1, 16, 1), ("torch", 16, None, None)]
    assert rows[0]["experts_per_layer"] == rows[1]["experts_per_layer"] == rows[2]["experts_per_layer"] == 2.0
    assert 2.0 < rows[3]["experts_per_layer"] <= 8.0  # 16 random rows run a wider union
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows) and obj["fixed_gb"] > 0
    assert rows[3]["floor_gb"] > rows[0]["floor_gb"]  # the wider union reads more expert bytes


def test_the_kernels_off_cuda_are_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_hybrid_step import main

    assert main(["--shape", "tiny", "--device", "cpu", "--ops", "triton"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --ops 'triton': expected torch and/or triton (triton needs --device cuda)"]


def test_a_profile_off_cuda_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_hybrid_step import main

    assert main(["--shape", "tiny", "--device", "cpu", "--ops", "torch", "--profile"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --profile: needs --device cuda, a triton variant in --ops and --width >= 1"]
