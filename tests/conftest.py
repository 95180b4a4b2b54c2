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


# --------------------------------------------------------------------------- test tiers
#
# Two tiers (README "Test"): the quick default run, and `--exhaustive`, which runs exactly what
# the quick run leaves out, so the two together are the whole suite. What is left out:
# - tests marked `exhaustive` (end-to-end runs through Triton's interpreter whose behaviour
#   the quick tier already covers piece by piece);
# - the extra combinations of a test parametrised over several parameters:
#   the quick tier keeps a covering subset in which every value of every parameter runs at
#   least once (a kernel configuration, a dtype, a shape), and the exhaustive tier runs the
#   rest of the cross product.


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="run the exhaustive tier: the tests and parameter combinations the quick default "
                          "run leaves out (the two runs together are the whole suite)")


def _covering_subset(items) -> set[str]:
    """Node ids of a subset of one test function's parametrised items in which every
    (parameter, value) pair occurs at least once, picked greedily in collection order."""
    covered: set[tuple[str, str]] = set()
    keep: set[str] = set()
    pending = list(items)
    while pending:
        best = max(pending, key=lambda it: len(_pairs(it) - covered))
        new = _pairs(best) - covered
        if not new:
            break
        covered |= new
        keep.add(best.nodeid)
        pending.remove(best)
    return keep


def _pairs(item) -> set[tuple[str, str]]:
    return {(name, repr(value)) for name, value in item.callspec.params.items()}


def _exhaustive_only(items) -> set[str]:
    """Node ids the quick tier leaves out."""
    out = {it.nodeid for it in items if it.get_closest_marker("exhaustive")}
    by_function: dict[tuple[str, str], list] = {}
    for it in items:
        callspec = getattr(it, "callspec", None)
        if callspec is None or len(callspec.params) < 2:
            continue
        by_function.setdefault((str(it.path), it.originalname), []).append(it)
    for group in by_function.values():
        keep = _covering_subset(group)
        out |= {it.nodeid for it in group if it.nodeid not in keep}
    return out


def pytest_collection_modifyitems(config, items):
    exhaustive = _exhaustive_only(items)
    want_exhaustive = config.getoption("--exhaustive")
    selected = [it for it in items if (it.nodeid in exhaustive) == want_exhaustive]
    deselected = [it for it in items if (it.nodeid in exhaustive) != want_exhaustive]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
