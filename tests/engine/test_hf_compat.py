"""Our top-level kernels/ folder must not shadow an installed `kernels` package (transformers
>= 5.25 imports Hugging Face's by that name): memra_cli/hf_compat.py."""

from __future__ import annotations

import sys
from pathlib import Path

from memra_cli import hf_compat

REPO = Path(hf_compat.__file__).resolve().parents[1]


def _fake_installed(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the installed one'\n")
    return site


def test_the_installed_package_wins_over_the_folder(tmp_path, monkeypatch):
    site = _fake_installed(tmp_path)
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    # as under `python -m pytest` from the repository root: the root first, the install after
    monkeypatch.setattr(sys, "path", [str(REPO), str(site), *sys.path])
    hf_compat.protect_kernels_name()
    mod = sys.modules["kernels"]
    assert Path(mod.__file__).resolve().parent == site / "kernels"
    assert mod.CUDAProperties == "the installed one"
    assert sys.path[0] == str(REPO)  # the path is given back as it was


def test_our_folder_is_never_imported_under_that_name(monkeypatch):
    """Whatever is installed: the name resolves to our folder first, and after the call
    `kernels` is either absent or not our folder."""
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    hf_compat.protect_kernels_name()
    mod = sys.modules.get("kernels")
    assert mod is None or Path(mod.__file__).resolve().parent != REPO / "kernels"


def test_an_imported_kernels_is_left_alone(monkeypatch):
    sentinel = type(sys)("kernels")
    monkeypatch.setitem(sys.modules, "kernels", sentinel)
    hf_compat.protect_kernels_name()
    assert sys.modules["kernels"] is sentinel
