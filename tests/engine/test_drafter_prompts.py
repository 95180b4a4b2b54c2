"""`python -m memra_cli.assets.drafter_prompts`: the embedded pair's drafter prompts as a
`memra train` prompt file: function heads of the drafter-prompt files only, never a bench prompt,
refused on a stdlib other than the one the models were built from."""

from __future__ import annotations

import json

import pytest

from memra_cli.assets import ASSETS
from memra_cli.assets.build import SMOKE
from memra_cli.assets.drafter_prompts import drafter_prompt_rows, main
from memra_cli.engine.errors import ConfigError
from memra_cli.engine.prompts import load_prompts


def test_smoke_rows_are_function_heads_and_never_bench_prompts(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main([str(out), "--smoke"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    bench = set(load_prompts("stdlib").texts)
    assert rows and all(r["prompt"].startswith(("def ", "async def ")) and r["prompt"] not in bench for r in rows)
    assert main([str(out), "--smoke"]) == 2  # an existing file is not replaced


def test_another_stdlib_is_refused():
    with pytest.raises(ConfigError, match="not the corpus the embedded models were built from"):
        drafter_prompt_rows(SMOKE, ASSETS / "target" / "tokenizer.json", corpus_sha256="0" * 64)
