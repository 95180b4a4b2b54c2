"""`python -m benchmarks.gpu.hybrid_step --tiny`: the GPU benchmark's every section runs on the CPU at toy
shapes (no graphs) and writes its JSON, so the lead's H200 run does not fail on plumbing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.exhaustive  # a GPU benchmark script's CPU smoke (quick-tier time; the suite runs it for real)
def test_hybrid_bench_tiny_smoke(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.hybrid_step", "--tiny", "--json", str(out), "--ckpt",
                    str(tmp_path / "ck")], cwd=ROOT, check=True, capture_output=True, text=True, env=env, timeout=120)
    d = json.loads(out.read_text())
    for name in ("plain", "verify", "rounds", "exact", "transformers"):
        assert "error" not in d[name], (name, d[name])
    assert d["exact"]["all_exact"] is True and d["summary"]["exact"] is True
    assert {"width1", "width16"} <= set(d["plain"]) and "replay_k8" in d["verify"] and "stash_k1" in d["verify"]
    # one real row padded to 16: its padding rows' recurrence skipped, beside the same with them run
    assert d["plain"]["width16_padded"]["exact"] is True and d["summary"]["w16_step_token_ms_padding_run"] > 0
    # rounds with the rollback inside the round (replay mode): picks and states exact, every k
    assert d["rounds"]["mode"] == "replay" and d["rounds"]["all_exact"] is True
    assert all(d["rounds"][f"k{k}"]["state_exact"] and d["rounds"][f"k{k}"]["rounds"] == 4 for k in (1, 8, 16))
    # and with a window of k known before the verify (its rows past the window skip the recurrence)
    assert d["rounds"]["k8_window"]["exact"] and d["rounds"]["k8_window"]["rounds"] == 4
    # and with the lm_head and its argmax as two step ops (the A/B of static_step_picks): the same picks
    assert d["rounds"]["k8_unfused_picks"]["exact"] and d["rounds"]["k8_unfused_picks"]["rounds"] == 4
    # a timing's value is the GPU run's to report (docs/perf.md); here only that it was measured
    assert math.isfinite(d["transformers"]["token_ms"]) and d["summary"]["transformers_agree_prefix"] >= 0
