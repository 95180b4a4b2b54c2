"""One convention for every bad input: a single `error:` line on stderr, exit 2, no box, no
traceback — typer's own usage errors (bad values, unknown options and commands) included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
DSPARK = ROOT / "memra_cli" / "assets" / "dspark"

CASES = {
    "negative max-new": (["generate", "--max-new", "-5"], {}, "error: --max-new -5: expected an integer >= 0"),
    "bench n 0": (["bench", "--n", "0"], {}, "error: --n 0: expected an integer >= 1"),
    "bench max-new 0": (["bench", "--max-new", "0"], {}, "error: --max-new 0: expected an integer >= 1"),
    "bench warmup -1": (["bench", "--warmup", "-1"], {}, "error: --warmup -1: expected an integer >= 0"),
    "parity ctx 0": (["parity", str(DSPARK), "--make-oracle", "x.npz", "--ctx", "0"], {}, "error: --ctx 0: expected an integer >= 1"),
    "adapt maybe": (["census", str(DSPARK)], {"MEMRA_DFLASH_ADAPT": "maybe"},
                    "error: --adapt / MEMRA_DFLASH_ADAPT=maybe (from the environment): expected 1 or 0 (or true/false, yes/no, on/off)"),
    "markov 2": (["generate", "--prompt", "x"], {"MEMRA_DFLASH_MARKOV": "2"},
                 "error: --markov / MEMRA_DFLASH_MARKOV=2 (from the environment): expected 1 or 0"),
    "unknown command": (["frob"], {}, "error: No such command 'frob' (see '"),
    "unknown option": (["generate", "--frob"], {}, "error: No such option: --frob (see '"),
    "missing argument": (["census"], {}, "error: Missing argument"),
    "not an integer": (["generate", "--max-new", "abc"], {}, "error: Invalid value for '--max-new'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_usage_errors_are_one_line_and_exit_2(case):
    args, env, message = CASES[case]
    r = runner.invoke(app, args, env=env)
    assert r.exit_code == 2, (case, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert "╭" not in r.output and "Usage:" not in r.output and r.stdout == ""


def test_through_the_entry_point():
    """`python -m memra_cli` (what a user runs), not just the test runner."""
    r = subprocess.run([sys.executable, "-m", "memra_cli", "frob"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: No such command 'frob' (see 'python -m memra_cli --help')"]


def test_help_and_version_still_exit_0_and_no_arguments_still_shows_the_help():
    assert runner.invoke(app, ["--version"]).exit_code == 0
    r = runner.invoke(app, ["generate", "--help"])
    assert r.exit_code == 0 and "--max-new" in r.stdout
    r = runner.invoke(app, [])
    assert r.exit_code == 2 and "census" in r.output and "error:" not in r.output
