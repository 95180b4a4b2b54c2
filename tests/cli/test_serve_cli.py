"""`memra serve` as a command: refusals in one line before anything loads, and a real process
that prints its receipts and address once, serves, and stops cleanly on SIGINT / SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
runner = CliRunner()


@pytest.mark.parametrize("args, line", [
    (["--port", "70000"], "error: --port 70000: expected 0..65535 (0: a free port the system picks)"),
    (["--target", "/nonexistent/t"], "error: --target /nonexistent/t: no such directory"),
    (["--spec", "fast"], "error: --spec fast: expected off|dflash|dspark|auto"),
    (["--max-sessions", "0"], "error: --max-sessions 0: expected an integer >= 1"),
])
def test_refusals_are_one_line(args, line):
    r = runner.invoke(app, ["serve", *args])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [line], r.output


def test_a_target_without_a_tokenizer_is_refused(tmp_path):
    from memra_cli.tiny.target import make_tiny_qwen3

    target = make_tiny_qwen3(tmp_path / "t")  # no tokenizer.json
    r = runner.invoke(app, ["serve", "--target", str(target), "--port", "0"])
    assert r.exit_code == 2 and r.stderr.strip() == (
        f"error: {target / 'tokenizer.json'}: no such file (memra serve reads and writes text with the target's own "
        "tokenizer)"), r.output


def test_a_taken_port_is_refused_before_anything_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = runner.invoke(app, ["serve", "--port", str(port)])
    assert r.exit_code == 2 and r.stderr.strip() == (
        f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"), r.output


def _start(*args):
    proc = subprocess.Popen([sys.executable, "-m", "memra_cli", "serve", "--port", "0", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("note: serving "):
            return proc, lines, line.split(" at ")[1].split()[0].removesuffix("/v1")
    proc.kill()
    raise AssertionError("\n".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_then_stops_cleanly(sig):
    proc, lines, url = _start("--max-tokens", "64")
    try:
        assert lines[0].startswith("note: using the embedded default models")
        assert any(line.startswith("[dspark] harvest=dspark") for line in lines)  # receipts, once, at start-up
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "memra-embedded", "prompt": "def f(", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert proc.returncode == 0, err
    assert err.strip().splitlines()[-1] == f"note: stopped ({name}): every session closed"
    assert out == ""  # nothing on stdout: receipts and notes go to stderr
    assert not [line for line in lines if "Traceback" in line]


def test_a_model_thread_that_cannot_start_is_an_error_line(monkeypatch):
    """The worker starts before the server listens: its failure is one error line, no traceback."""
    import contextlib

    from memra_cli.serve import app as serve_app

    @contextlib.contextmanager
    def refused(device, threads):
        raise ValueError(f"cannot use {device}")
        yield  # pragma: no cover

    monkeypatch.setattr(serve_app, "_model_thread", refused)
    r = runner.invoke(app, ["serve", "--port", "0"])
    assert r.exit_code != 0
    assert r.output.strip().splitlines()[-1] == \
        "error: memra serve: the model thread failed to start: ValueError: cannot use cpu", r.output
    assert "Traceback" not in r.output and "serving " not in r.output
