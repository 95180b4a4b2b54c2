"""Shared fixtures: a clean MEMRA_* environment for every test, tiny checkpoint makers."""

from __future__ import annotations

import os

import pytest
import torch

from memra_cli.hf_compat import protect_kernels_name

protect_kernels_name()  # before any test imports transformers (memra_cli/hf_compat.py says why)

from memra_cli.tiny.draft import make_tiny_draft  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_memra_env(monkeypatch):
    """Settings come from env vars too: no test may see the caller's."""
    for key in list(os.environ):
        if key.startswith("MEMRA_"):
            monkeypatch.delenv(key)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny matmuls: a second thread only adds contention on a busy 2-core CI box (a tiny-model
    token took 180 ms with two threads there, 9 ms with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def draft_dir(tmp_path):
    """make(fmt, name=..., **kw) -> Path of a tiny drafter written under tmp_path."""
    counter = iter(range(10_000))

    def make(fmt: str = "zlab", name: str | None = None, **kw):
        return make_tiny_draft(tmp_path / (name or f"{fmt}-{next(counter)}"), fmt, **kw)

    return make
