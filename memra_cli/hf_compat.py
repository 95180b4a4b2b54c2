"""Keep this repository's `kernels/` folder from shadowing Hugging Face's `kernels` package.

transformers 5.25 depends on the `kernels` distribution (Hugging Face's hub kernels) and, when
it is installed, runs `from kernels import CUDAProperties, ...` at import. This repository keeps
its Triton kernels in a top-level `kernels/` folder, installed as `memra_kernels`. Run from the
repository root with `python -m ...` (pytest, `python -m memra_cli.assets.build`), the current
directory is first on `sys.path`, so `kernels` names our folder and importing transformers fails
with `ImportError: cannot import name 'CUDAProperties' from 'kernels'`.

`protect_kernels_name()` imports the installed package under its own name first, with this
repository's root out of `sys.path` for that one import, so `sys.modules["kernels"]` is the real
one and transformers (which looks there before searching the path) finds it. It does nothing
when `kernels` is already imported, when the name does not resolve to our folder, or when no
other `kernels` is installed. Call it before importing transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_OURS = _REPO / "kernels"


def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == _REPO
    except OSError:  # pragma: no cover - an unreadable path entry
        return False


def protect_kernels_name() -> None:
    """Import the installed `kernels` package (if any) before our folder can take its name."""
    if "kernels" in sys.modules:
        return
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != _OURS:
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not _is_repo_root(p)]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved
