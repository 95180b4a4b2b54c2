"""A model path that is not there is said to be not there, before anything looks for a file
inside it (not "no tokenizer.json" or "the arm needs a drafter")."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()
DSPARK = Path(__file__).resolve().parents[2] / "memra_cli" / "assets" / "dspark"


def _cases(tmp: Path) -> dict:
    nope, file, empty = tmp / "nope", tmp / "file.txt", tmp / "empty"
    return {
        "generate target": (["generate", "--target", nope, "--prompt", "x"], f"error: --target {nope}: no such directory"),
        "generate target ids": (["generate", "--target", nope, "--prompt-ids", "1"], f"error: --target {nope}: no such directory"),
        "bench target": (["bench", "--target", nope], f"error: --target {nope}: no such directory"),
        "bench draft": (["bench", "--draft", nope], f"error: --draft {nope}: no such file or directory"),
        "parity target": (["parity", DSPARK, "--make-oracle", tmp / "o.npz", "--target", nope], f"error: --target {nope}: no such directory"),
        "target is a file": (["generate", "--target", file, "--prompt", "x"],
                             f"error: --target {file}: not a directory (expected a model directory with config.json)"),
        "target is empty": (["bench", "--target", empty], f"error: --target {empty}: no config.json there (expected an HF Qwen3 or Qwen3.5 model directory)"),
    }


@pytest.mark.parametrize("case", list(_cases(Path("/x"))))
def test_a_missing_model_path_is_named(tmp_path, case):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    args, message = _cases(tmp_path)[case]
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [message]
