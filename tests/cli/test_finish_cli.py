"""Small things a new user meets: a closed pipe ends quietly with the closed-pipe code; tiny
checkpoints get one set of file permissions; `--version` stands alone; help shows value
placeholders and whole sentences; notes wrap at word boundaries on a terminal and not at all
when piped."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

from rich.console import Console
from typer.testing import CliRunner

from memra_cli.cli import render
from memra_cli.cli.app import app, command_help
from memra_cli.cli.common import CLOSED_PIPE_EXIT
from memra_cli.cli.generate import generate
from memra_cli.tiny.__main__ import main as tiny_main

runner = CliRunner()


def test_a_closed_pipe_ends_quietly_with_its_code():
    memra = [sys.executable, "-c", "from memra_cli.cli.app import main; main()"]
    proc = subprocess.Popen([*memra, "generate", "--prompt", "def f(", "--max-new", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)  # the stream started; the reader leaves
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == CLOSED_PIPE_EXIT == 141
    assert "Traceback" not in err and "error:" not in err and "Exception ignored" not in err, err


def test_tiny_files_share_the_usual_permissions(tmp_path):
    assert tiny_main([str(tmp_path / "tiny")]) == 0
    mask = os.umask(0)
    os.umask(mask)
    for model in ("target", "dspark", "qwen3_5"):
        for name in ("config.json", "model.safetensors"):
            assert stat.S_IMODE((tmp_path / "tiny" / model / name).stat().st_mode) == 0o666 & ~mask, (model, name)


def test_version_stands_alone():
    r = runner.invoke(app, ["--version", "extra"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: --version takes no other arguments (see 'memra --help')"]
    assert runner.invoke(app, ["--version"]).exit_code == 0


def test_help_shows_placeholders_and_sentences():
    for command in ([], ["generate"], ["parity"], ["census"], ["bench"], ["quantize"]):
        r = runner.invoke(app, [*command, "--help"], terminal_width=100)
        assert r.exit_code == 0, r.output
        for junk in ("<bool>", "<str>", "<path>", "<int>", "{ckpt}"):
            assert junk not in r.stdout, (command, junk)
    assert "Usage: memra parity [OPTIONS] CKPT [ORACLE]" in runner.invoke(app, ["parity", "--help"]).stdout
    paragraphs = command_help(generate.__doc__).split("\n\n")
    assert len(paragraphs) == 2 and all("\n" not in p for p in paragraphs)
    assert "only proposes, the target's own selection decides" in paragraphs[1]


def _note_on(console: Console, message: str, monkeypatch) -> list[str]:
    monkeypatch.setattr(render, "err_console", console)
    render.note(message)
    return console.file.getvalue().splitlines()


def test_notes_wrap_at_words_on_a_terminal_and_not_when_piped(monkeypatch):
    message = "using the embedded default models: target /a/long/path/to/the/target, drafter /b/dspark"
    tty = Console(file=io.StringIO(), force_terminal=True, width=40, color_system=None)
    lines = _note_on(tty, message, monkeypatch)
    assert len(lines) > 1 and " ".join(line.strip() for line in lines) == f"note: {message}"  # words kept whole
    piped = Console(file=io.StringIO(), force_terminal=False, width=40)
    assert _note_on(piped, message, monkeypatch) == [f"note: {message}"]
