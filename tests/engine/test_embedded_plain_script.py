"""`python -m benchmarks.gpu.embedded_plain` on the CPU (`--device cpu`): it loads the embedded target,
times one-row and 16-row steps through the runner and whole plain sessions, and writes its JSON
(the GPU-only parts, graph replay and the kernel profile, are left out there)."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.gpu.embedded_plain"  # run as a module from the repo root


@pytest.mark.exhaustive  # a GPU benchmark script's CPU smoke (quick-tier time; the suite runs it for real)
def test_cpu_run_writes_its_report(tmp_path):
    out = tmp_path / "plain.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"  # one intra-op thread, as the tests' own process runs (conftest): no fight for 2 cores
    proc = subprocess.run([sys.executable, "-m", MODULE, "--device", "cpu", "--prompts", "2", "--max-new", "4",
                           "--reps", "2", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["device"] == "cpu"
    assert d["one_row"]["width"] is None and d["fixed16"]["width"] == 16  # CPU: plain is variable width
    for key in ("one_row", "fixed16"):
        assert d[key]["step_call_ms"] > 0
        assert "replay_gpu_ms" not in d[key] and "round_run_ms" not in d[key]  # no graphs on the CPU
    sessions = d["session_ms_per_token"]
    assert set(sessions) == {"plain (Engine.fastest_plain)", "off (fixed 16-row steps)",
                             "plain, rounds after the prefill"}
    assert all(v > 0 for v in sessions.values())
