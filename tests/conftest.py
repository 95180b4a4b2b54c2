"""Shared fixtures: a clean MEMRA_* environment for every test, tiny checkpoint makers."""

from __future__ import annotations

import os

import pytest

from memra_cli.tiny.draft import make_tiny_draft


@pytest.fixture(autouse=True)
def _clean_memra_env(monkeypatch):
    """Settings come from env vars too: no test may see the caller's."""
    for key in list(os.environ):
        if key.startswith("MEMRA_"):
            monkeypatch.delenv(key)


@pytest.fixture
def draft_dir(tmp_path):
    """make(fmt, name=..., **kw) -> Path of a tiny drafter written under tmp_path."""
    counter = iter(range(10_000))

    def make(fmt: str = "zlab", name: str | None = None, **kw):
        return make_tiny_draft(tmp_path / (name or f"{fmt}-{next(counter)}"), fmt, **kw)

    return make
