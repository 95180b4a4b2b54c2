"""benchmarks/gpu/train_throughput.py --tiny: the GPU benchmark runs end to end on the CPU at the
small shape and writes its JSON, so the H200 run does not fail on plumbing."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.exhaustive  # a GPU benchmark script's CPU smoke (quick-tier time; the suite runs it for real)
def test_train_throughput_tiny_smoke(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.train_throughput", "--tiny", "--json", str(out)], cwd=ROOT,
                   check=True, capture_output=True, text=True, env=env, timeout=120)
    d = json.loads(out.read_text())
    assert d["geometry"]["taps"] == [0, 2] and d["seq_len"] == 48
    assert d["step_ms"] > 0 and 0 < d["taps_ms"] and d["target_tokens_per_s"] > 0
    # the batched taps beside the one-sequence-at-a-time loop, and how far apart they are (rounding)
    assert d["taps_batched"] is True and d["taps_one_at_a_time_ms"] > 0 and 0 <= d["taps_max_rel_diff"] < 1e-4
    assert d["checkpoint_bytes"] > 0 and d["cache_bytes_per_token"] == 2 * 128 * 2  # 2 taps x hidden 128 x bf16
