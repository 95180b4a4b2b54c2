"""benchmarks/moe_step.py on the tiny shape on the CPU: it builds a random MoE target in memory,
times steps of several widths, counts the experts each ran and writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_times_steps_and_counts_their_experts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_step.py"), "--shape", "tiny", "--device",
                           "cpu", "--dtype", "float32", "--iters", "1", "--vts", "1,16", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["vt"] for r in rows] == [1, 16]
    assert rows[0]["experts_per_layer"] == 2.0  # one row runs exactly its top-2
    assert 2.0 < rows[1]["experts_per_layer"] <= 8.0  # 16 random rows run a wider union
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
