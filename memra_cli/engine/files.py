"""Files a user asked for: the permissions they get, and the one overwrite rule.

Outputs are written to a temporary file beside the destination and renamed into place. A
temporary file from `tempfile.mkstemp` is private (mode 0600); the file the user asked for gets
what any new file of theirs gets (0666 less the umask: 0644 under the usual umask), as `open()`
would have given it.
"""

from __future__ import annotations

import os
from pathlib import Path

from memra_cli.engine.errors import MemraError


class OutputExistsError(MemraError):
    """An output file is already there and the user did not ask to overwrite it."""


def default_mode() -> int:
    """0666 less the process umask: the mode `open(path, "w")` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish(tmp: Path | str, path: Path | str) -> None:
    """Give a finished temporary file the usual permissions and rename it to `path`."""
    os.chmod(tmp, default_mode())
    os.replace(tmp, path)


def refuse_existing(path: Path, force: bool, flag: str) -> None:
    """The overwrite rule of every output flag: an existing file needs --force."""
    if path.is_dir():
        raise OutputExistsError(f"{flag} {path}: is a directory (expected a file name)")
    if path.exists() and not force:
        raise OutputExistsError(f"{flag} {path}: file exists (pass --force to overwrite)")
