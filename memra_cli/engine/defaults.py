"""The embedded default pair as every front end applies it: no target given -> the embedded
target and the drafter its program names, and the note that says so.

Kept out of `api.py`'s imports: the embedded models are package data built by
`memra_cli.assets`, which the runtime never imports (tests/engine/test_layout.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def default_models(target: Optional[Path], draft: Optional[Path], spec: str) -> tuple[Path, Optional[Path], Optional[str]]:
    """(target, draft, note or None). No `target`: the embedded pair (its DSpark drafter, or
    DFlash for `spec` dflash; none for `spec` off), with a note naming what is used; a `draft`
    given alone keeps it and only the target is a default."""
    if target is not None:
        return target, draft, None
    from memra_cli.assets import default_pair

    target, drafts = default_pair()
    if draft is not None:  # the user's drafter: only the target is a default
        return target, draft, f"using the embedded default target {target}"
    if spec != "off":
        draft = drafts["dflash" if spec == "dflash" else "dspark"]
    return target, draft, f"using the embedded default models: target {target}" + (f", drafter {draft}" if draft else "")
