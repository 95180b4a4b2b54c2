"""benchmarks/cpu_round_parts.py on a tiny run: it times the DSpark round's pieces inside sessions,
the numpy chain by default and torch's loop with `--chain torch` (the A/B of docs/perf.md), and
refuses a count below 1 in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.cpu_round_parts"  # run as a module from the repo root


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("chain", ["numpy", "torch"])
def test_times_each_piece_and_switches_the_chain(chain):
    proc = _run("--n", "1", "--max-new", "16", "--passes", "1", "--chain", chain)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pieces = {m.group(1).strip(): float(m.group(2))
              for m in re.finditer(r"^\s+(\S.*?)\s+([\d.]+) ms/round", proc.stdout, re.M)}
    for name in ("propose", "ingest", "block forward", "lm_head (verify + draft)", "markov chain", "confidence head"):
        assert pieces[name] > 0, (name, proc.stdout)
    assert ("(of which the numpy loop)" in pieces) == (chain == "numpy"), proc.stdout
    assert re.search(r"^median [\d.]+ ms/token$", proc.stdout, re.M)


def test_refuses_a_count_below_one():
    proc = _run("--passes", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "cpu_round_parts.py: error: --passes 0: expected an integer >= 1"
