"""What the docs say about GGUF precision and piped bench output is what the commands do: parity
judges a GGUF by its own policy without --prec; a --prec that differs from the file's is refused
by generate and parity in the one message docs/quantize.md quotes; piped tables keep their
titles on one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.tiny.__main__ import main as tiny_main

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    assert tiny_main([str(root / "tiny")]) == 0
    out = root / "d.gguf"
    r = runner.invoke(app, ["quantize", str(root / "tiny" / "dspark"), "--out", str(out), "--policy", "q8"])
    assert r.exit_code == 0, r.output
    oracle = root / "o.npz"
    r = runner.invoke(app, ["parity", str(out), "--make-oracle", str(oracle), "--target", str(root / "tiny" / "target")])
    assert r.exit_code == 0, r.output
    return root / "tiny", out, oracle


def _one_error(args: list[str]) -> str:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_parity_on_a_gguf_needs_no_prec(gguf):
    tiny, path, oracle = gguf
    r = runner.invoke(app, ["parity", str(path), str(oracle), "--target", str(tiny / "target"), "--json"])
    assert r.exit_code == 0, r.output
    assert '"precision": "q8"' in r.stdout


def test_one_prec_mismatch_message_as_the_docs_quote_it(gguf):
    tiny, path, oracle = gguf
    from_generate = _one_error(["generate", "--target", str(tiny / "target"), "--draft", str(path), "--prec", "q4",
                                "--prompt", "x"])
    from_parity = _one_error(["parity", str(path), str(oracle), "--target", str(tiny / "target"), "--prec", "q4"])
    assert from_generate == from_parity
    quoted = re.search(r"`(error: --prec q4: d\.gguf is a GGUF[^`]*)`", " ".join((DOCS / "quantize.md").read_text().split()))
    assert quoted is not None
    assert from_parity == quoted.group(1).replace("d.gguf", str(path))


def test_piped_bench_tables_keep_their_titles_whole():
    r = runner.invoke(app, ["bench", "--n", "1", "--max-new", "8", "--warmup", "0", "--arm", "dspark"])
    assert r.exit_code == 0, r.output
    assert "tau histogram: rounds by tokens committed (accepted + 1)" in r.stdout.splitlines()
