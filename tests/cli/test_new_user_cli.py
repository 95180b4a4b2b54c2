"""What a new user meets on the embedded models and the tiny checkpoints: the messages, notes,
receipts and JSON fields they read (one test per finding)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()
ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


def _one_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_chat_on_the_embedded_target_is_refused_in_one_line_and_documented():
    """The embedded target is a raw code model without a chat template: --chat says so and what
    it needs, for generate and bench alike, and --help says it up front."""
    for args in (["generate", "--chat", "--prompt", "x"], ["bench", "--chat"]):
        line = _one_error(runner.invoke(app, args))
        assert line.startswith("error: --chat: the target has no chat template (no chat_template in ")
        assert str(ASSETS / "target" / "tokenizer_config.json") in line and "needs a target made for chat" in line
    for command in ("generate", "bench"):
        help_text = " ".join(runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"}).stdout.split())
        assert "Needs a target made for chat" in help_text and "the embedded target is a raw code model" in help_text
