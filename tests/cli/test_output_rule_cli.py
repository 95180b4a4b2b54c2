"""Every output follows one rule, checked before any work (the README says it):
a file output is a file name and an existing one needs --force; a directory output is a
directory or a new name; the directory it goes in must exist (memra creates none) and must take
a file. Every size a user gives has a bound from the model or the machine, named in the
refusal. Each refusal is one `error:` line, exit 2, nothing created."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()
DSPARK = Path(__file__).resolve().parents[2] / "memra_cli" / "assets" / "dspark"
TARGET = DSPARK.parent / "target"
UNWRITABLE = Path("/sys")  # takes no new file, not even root's (root's os.access says it would)
needs_sys = pytest.mark.skipif(not UNWRITABLE.is_dir(), reason="needs Linux's /sys")


def _cases(tmp: Path) -> dict:
    made, existing = tmp / "made.npz", tmp / "existing.txt"
    return {
        "plot unwritable": (["bench", "--plot", UNWRITABLE / "x.png"], "error: --plot /sys/x.png: cannot write in /sys ("),
        "oracle unwritable": (["parity", DSPARK, "--make-oracle", UNWRITABLE / "o.npz"],
                              "error: --make-oracle /sys/o.npz: cannot write in /sys ("),
        "oracle missing dir": (["parity", DSPARK, "--make-oracle", tmp / "nope" / "o.npz"],
                               f"error: --make-oracle {tmp / 'nope' / 'o.npz'}: directory {tmp / 'nope'} does not exist "
                               "(memra creates no directories)"),
        "oracle ctx": (["parity", DSPARK, "--make-oracle", made, "--ctx", "100000000"],
                       "error: --ctx 100000000: expected at most 4081 (the drafter's max_position_embeddings 4096 less its block of 15)"),
        "oracle seed": (["parity", DSPARK, "--make-oracle", made, "--seed", "123456789012345678901234567890"],
                        "error: --seed 123456789012345678901234567890: expected an integer from 0 to 2^64-1"),
        "dump onto a file": (["parity", DSPARK, tmp / "o.npz", "--dump", existing],
                             f"error: --dump {existing}: exists and is not a directory (expected a directory)"),
        "step width": (["generate", "--target", TARGET, "--prompt", "x", "--step-width", "100000"],
                       "error: --step-width 100000: expected at most the target's max_position_embeddings (4096)"),
        "threads": (["generate", "--target", TARGET, "--prompt", "x", "--threads", "100000"],
                    f"error: --threads 100000: expected at most this machine's {os.cpu_count()} CPU cores"),
    }


@needs_sys
@pytest.mark.parametrize("case", list(_cases(Path("/x"))))
def test_refused_in_one_line_before_any_work(tmp_path, case):
    (tmp_path / "existing.txt").write_text("x")
    args, message = _cases(tmp_path)[case]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.txt"]  # nothing created


@needs_sys
@pytest.mark.parametrize("where", ["file", "proc", "missing"])
def test_tiny_refuses_an_out_dir_it_cannot_make(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    out = {"file": tmp_path / "afile", "proc": Path("/proc/x"), "missing": tmp_path / "nope" / "x"}[where]
    r = subprocess.run([sys.executable, "-m", "memra_cli.tiny", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: OUT_DIR {out}: "), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
