"""`generate` on the embedded default models names them in a note only once the run was
accepted: a refusal that comes after tokenization (the prompt, --max-new, the device, the
kernels setting) stays the README's one `error:` line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()

REFUSED = {
    "empty prompt": (["--prompt", ""], {}),
    "out-of-vocab id": (["--prompt-ids", "999999"], {}),
    "max-new past the positions": (["--prompt", "x", "--max-new", "100000"], {}),
    "cuda graphs on cpu": (["--prompt", "x", "--device", "cpu", "--cuda-graphs"], {}),
    "kernels setting": (["--prompt", "x"], {"MEMRA_KERNELS": "banana"}),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refusal_after_tokenization_is_one_line(case):
    args, env = REFUSED[case]
    r = runner.invoke(app, ["generate", *args], env=env)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines


def test_an_accepted_run_names_the_defaults():
    r = runner.invoke(app, ["generate", "--prompt", "x", "--max-new", "2"])
    assert r.exit_code == 0, r.output
    assert any(line.startswith("note: using the embedded default models: target ") for line in r.stderr.splitlines())
