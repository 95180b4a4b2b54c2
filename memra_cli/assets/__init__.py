"""The embedded default model pair: a tiny Qwen3 target trained on the CPython stdlib, with a
DFlash (z-lab format) and a DSpark (DeepSpec format) drafter trained on its own greedy output.

Built by `python -m memra_cli.assets.build` (see build.py and build_info.json for the recipe,
corpus hash, losses and per-slot acceptance); shipped as package data in bf16.
"""

from __future__ import annotations

from pathlib import Path

from memra_cli.engine.errors import MemraError

ASSETS = Path(__file__).resolve().parent
DRAFTERS = ("dflash", "dspark")


def default_pair() -> tuple[Path, dict[str, Path]]:
    """(target directory, {"dflash": dir, "dspark": dir}) of the embedded models."""
    target = ASSETS / "target"
    drafts = {name: ASSETS / name for name in DRAFTERS}
    missing = [p for p in (target, *drafts.values()) if not (p / "config.json").is_file()]
    if missing:
        raise MemraError(
            f"the embedded default models are missing from this installation ({missing[0]}); "
            "pass --target/--draft, or build them with `python -m memra_cli.assets.build`"
        )
    return target, drafts
