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


@pytest.mark.parametrize("chain", ["numpy", pytest.param("torch", marks=pytest.mark.exhaustive)])  # numpy: the default
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


@pytest.mark.exhaustive  # a subprocess loading the pair and profiling a pass (~3 s): the quick tier is near its budget
def test_the_plain_arm_steps_and_profile_print_their_lines():
    """`--arm plain` times the one-row step as its round; `--steps` times both target steps with
    and without their weight matmuls; `--profile` prints each region's GEMM / attention / other
    split; a negative `--steps` is refused in one line."""
    proc = _run("--n", "1", "--max-new", "8", "--passes", "1", "--arm", "plain", "--steps", "3", "--profile")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    steps = re.findall(r"^(16-row fixed step|one-row plain step).*?: ([\d.]+) ms, ([\d.]+) ms of it outside", out, re.M)
    assert [s[0] for s in steps] == ["16-row fixed step", "one-row plain step"], out
    assert all(float(whole) > 0 and 0 < float(outside) < float(whole) for _, whole, outside in steps), out
    assert re.search(r"^pass 1: [\d.]+ ms/token, 8 rounds, 1\.00 tokens/round", out, re.M), out
    region = re.search(r"^\s+step\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert region and float(region.group(1)) > 0 and float(region.group(4)) > 0, out
    assert "the 15 costliest ops" in out
    proc = _run("--steps", "-1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "cpu_round_parts.py: error: --steps -1: expected an integer >= 0"
