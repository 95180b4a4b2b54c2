"""Files a user asks for (--out, --plot, --make-oracle): the usual permissions, one overwrite
rule, nothing left behind however the write ends, and the reason when it fails."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (a test dependency)")
pytest.importorskip("transformers", reason="--make-oracle needs transformers (a test dependency)")

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dspark = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    return target, dspark, prompts


@pytest.fixture
def umask():
    """set(mask) for the test; the process umask is restored afterwards."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _bench(pair, *extra):
    target, dspark, prompts = pair
    return runner.invoke(app, ["bench", "--target", str(target), "--draft", str(dspark), "--prompts", str(prompts),
                               "--max-new", "2", "--warmup", "0", "--arm", "off", *map(str, extra)])


def _oracle(pair, out, *extra):
    _, dspark, _ = pair
    return runner.invoke(app, ["parity", str(dspark), "--make-oracle", str(out), "--ctx", "4", *map(str, extra)])


def _gguf(pair, out, *extra):
    _, dspark, _ = pair
    return runner.invoke(app, ["quantize", str(dspark), "--out", str(out), *map(str, extra)])


# ---------------------------------------------------------------- item 3: permissions


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_outputs_get_the_usual_permissions(pair, tmp_path, umask, mask, mode):
    umask(mask)
    png, npz, gguf = tmp_path / "b.png", tmp_path / "o.npz", tmp_path / "d.gguf"
    assert _bench(pair, "--plot", png).exit_code == 0
    assert _oracle(pair, npz).exit_code == 0
    assert _gguf(pair, gguf).exit_code == 0
    assert {p.name: oct(_mode(p)) for p in (png, npz, gguf)} == {p.name: oct(mode) for p in (png, npz, gguf)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png", "d.gguf", "o.npz"]


# ---------------------------------------------------------------- item 10: one overwrite rule, honest suffixes


def _one_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_every_output_flag_refuses_an_existing_file_without_force(pair, tmp_path):
    png, npz, gguf = tmp_path / "b.png", tmp_path / "o.npz", tmp_path / "d.gguf"
    for path in (png, npz, gguf):
        path.write_bytes(b"precious")
    for run, flag, path in ((lambda *a: _bench(pair, "--plot", png, *a), "--plot", png),
                            (lambda *a: _oracle(pair, npz, *a), "--make-oracle", npz),
                            (lambda *a: _gguf(pair, gguf, *a), "--out", gguf)):
        assert _one_error(run()) == f"error: {flag} {path}: file exists (pass --force to overwrite)"
        assert path.read_bytes() == b"precious"
        assert run("--force").exit_code == 0 and path.read_bytes() != b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.png", "d.gguf", "o.npz"]


def test_force_without_an_output_is_refused(pair):
    assert _one_error(_bench(pair, "--force")) == "error: --force applies to --plot (overwrite an existing plot file)"
    _, dspark, _ = pair
    r = runner.invoke(app, ["parity", str(dspark), "o.npz", "--force"])
    assert _one_error(r) == "error: --force applies to --make-oracle (overwrite an existing oracle file)"


def test_the_plot_suffix_names_its_format(pair, tmp_path):
    for name, magic in (("p.svg", b"<?xml"), ("p.pdf", b"%PDF"), ("p.png", b"\x89PNG")):
        assert _bench(pair, "--plot", tmp_path / name).exit_code == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    jpg = tmp_path / "p.jpg"
    assert _one_error(_bench(pair, "--plot", jpg)) == (
        f"error: --plot {jpg}: expected a .png, .svg or .pdf file name (the suffix names the format)")
    txt = tmp_path / "o.txt"
    assert _one_error(_oracle(pair, txt)) == f"error: --make-oracle {txt}: expected a .npz file name (a memra-oracle/1 file is an .npz)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pdf", "p.png", "p.svg"]


# ---------------------------------------------------------------- item 4: any catchable termination cleans up

# The real entry point, with every tensor write slowed down (timing only), so that the signal
# lands while the temporary file is being written.
SLOW_QUANTIZE = """
import sys, time
import gguf
real = gguf.GGUFWriter.write_tensor_data
def slow(self, *args, **kwargs):
    time.sleep(0.05)
    return real(self, *args, **kwargs)
gguf.GGUFWriter.write_tensor_data = slow
from memra_cli.cli.app import main
sys.argv = ["memra", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGHUP, 129, "SIGHUP"),
                                              (signal.SIGINT, 130, None)])
def test_a_signal_during_quantize_leaves_no_file(pair, tmp_path, sig, code, name):
    _, dspark, _ = pair
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's memra_cli, whatever is installed
    proc = subprocess.Popen([sys.executable, "-c", SLOW_QUANTIZE, "quantize", str(dspark), "--out", str(out / "d.gguf")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not list(out.glob(".d.gguf.*.part")):  # the write has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert list(out.iterdir()) == [], err  # neither the .part nor a half file
    assert err.strip().splitlines()[-1] == (f"error: terminated ({name})" if name else "error: interrupted")


# ---------------------------------------------------------------- item 5: a failed write says why


def _full_disk_write(self, tensor, *args, **kwargs):
    """What GGUFWriter.write_tensor_data meets on a full disk: numpy's tofile into a device
    that is out of space (it raises a short-write OSError without an errno)."""
    with open("/dev/full", "wb") as full:
        tensor.tofile(full)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_named_and_debug_keeps_the_cause(pair, tmp_path, monkeypatch):
    import gguf
    import shutil

    from memra_cli.engine.quant.gguf_write import GGUFWriteError

    out = tmp_path / "d.gguf"
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", _full_disk_write)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=4096))  # what is left
    line = _one_error(_gguf(pair, out))
    assert line.startswith(f"error: --out {out}: cannot write (No space left on device: ") and "requested and" in line
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", real_usage)  # space left: a short write, said as it is
    line = _one_error(_gguf(pair, out))
    assert line.startswith(f"error: --out {out}: cannot write (") and line.endswith(" requested and 0 written)")
    monkeypatch.setenv("MEMRA_DEBUG", "1")
    r = _gguf(pair, out)
    assert isinstance(r.exception, GGUFWriteError) and isinstance(r.exception.__cause__, OSError)


def test_a_failed_write_with_an_errno_gives_its_reason(pair, tmp_path, monkeypatch):
    import errno

    import gguf

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", no_space)
    out = tmp_path / "d.gguf"
    assert _one_error(_gguf(pair, out)) == f"error: --out {out}: cannot write (No space left on device)"
    assert list(tmp_path.iterdir()) == []


# Native code can catch the exception a signal handler raises inside it and raise its own error
# (a safetensors read turned Terminated into "ValueError: could not determine the shape ..."),
# or clear it. The command must still end as the signal asked, with nothing left behind.
NATIVE_QUANTIZE = """
import os, signal, sys, time
import gguf
real = gguf.GGUFWriter.write_tensor_data
calls = []
def native(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # the third tensor: the signal lands inside 'native' code
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except BaseException:
            if sys.argv[1] == "converts":
                raise ValueError("native code's own error") from None
            # "clears": the exception is gone
    return real(self, *args, **kwargs)
gguf.GGUFWriter.write_tensor_data = native
from memra_cli.cli.app import main
sys.argv = ["memra", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("native", ["converts", "clears"])
def test_a_signal_turned_into_another_error_by_native_code_still_terminates_cleanly(pair, tmp_path, native):
    _, dspark, _ = pair
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", NATIVE_QUANTIZE, native, "quantize", str(dspark), "--out", str(tmp_path / "d.gguf")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM)" and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


# The signal can also land between the temporary file's creation and the moment its name is
# known to the cleanup (a busy machine deschedules the process there): the creation is held.
EARLY_SIGNAL_QUANTIZE = """
import os, signal, sys, tempfile
real = tempfile.mkstemp
def mkstemp(*args, **kwargs):
    made = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # the file exists, its name is not yet returned
    return made
tempfile.mkstemp = mkstemp
from memra_cli.cli.app import main
sys.argv = ["memra", *sys.argv[1:]]
main()
"""


def test_a_signal_as_the_temporary_file_is_created_leaves_no_file(pair, tmp_path):
    _, dspark, _ = pair
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", EARLY_SIGNAL_QUANTIZE, "quantize", str(dspark), "--out", str(out / "d.gguf")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    assert list(out.iterdir()) == []
