"""A run that drafted nothing (`--max-new 0` or `1`: the prefill picks the only token) has no
acceptance rate: `-` in the summary line and null in --json, as the `off` arm reports it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()


@pytest.mark.parametrize("max_new", ["0", "1"])
def test_no_acceptance_without_drafts(max_new):
    r = runner.invoke(app, ["generate", "--prompt", "def f(", "--max-new", max_new, "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["drafted"] == 0 and stats["acceptance"] is None
    r = runner.invoke(app, ["generate", "--prompt", "def f(", "--max-new", max_new])
    assert r.exit_code == 0, r.output
    summary = r.stderr.strip().splitlines()[-1]
    assert summary.startswith("[dspark] ") and " acceptance=- " in summary, summary
