"""Files a user asked for: the permissions they get, and the one overwrite rule.

Outputs are written to a temporary file beside the destination and renamed into place. A
temporary file from `tempfile.mkstemp` is private (mode 0600); the file the user asked for gets
what any new file of theirs gets (0666 less the umask: 0644 under the usual umask), as `open()`
would have given it.

A signal that ends the command (Ctrl-C, SIGTERM, SIGHUP: the CLI turns them into exceptions)
must find the temporary file's name already recorded, or the cleanup cannot remove it: the
creation runs under `signals_held()`, inside the `try` whose cleanup removes the file.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
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


class OutputPathError(MemraError):
    """An output cannot be written where the user asked: its directory is missing, is not a
    directory, or takes no new file."""


def refuse_existing(path: Path, force: bool, flag: str) -> None:
    """The overwrite rule of every output flag: an existing file needs --force."""
    if path.is_dir():
        raise OutputExistsError(f"{flag} {path}: is a directory (expected a file name)")
    if path.exists() and not force:
        raise OutputExistsError(f"{flag} {path}: file exists (pass --force to overwrite)")


def check_output(path: Path, flag: str, *, force: bool = False, directory: bool = False) -> None:
    """The one rule of every output, checked before any work: a file output is a file name (not a
    directory) and an existing one needs --force; a directory output (`directory=True`) is a
    directory or a new name, never a file. Either way the directory it goes in must exist (memra
    creates none but a directory output itself) and must take a new file: probed by creating
    and removing one, since `os.access` says yes to root anywhere (/sys, a read-only mount)."""
    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            raise OutputExistsError(f"{flag} {path}: exists and is not a directory (expected a directory)")
        home = path if path.is_dir() else path.parent
    else:
        refuse_existing(path, force, flag)
        home = path.parent
    if not home.exists():
        raise OutputPathError(f"{flag} {path}: directory {home} does not exist (memra creates no directories)")
    if not home.is_dir():
        raise OutputPathError(f"{flag} {path}: {home} is not a directory")
    _probe_writable(home, path, flag)


def _probe_writable(home: Path, path: Path, flag: str) -> None:
    import tempfile

    try:
        with signals_held():  # created and removed before a signal can leave it behind
            fd, probe = tempfile.mkstemp(prefix=".memra-probe-", dir=home)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write in {home} ({exc.strerror or exc})") from None


_HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


_deferred: list[int] = []  # signals a handler deferred while held, first first
_holding = 0  # depth of signals_held blocks running now


def defer_signal(signum: int) -> bool:
    """For a Python signal handler: inside `signals_held()`, record the signal and return True
    (the handler returns without acting; it is delivered again when the block ends); outside,
    False. Blocking alone is not enough: a process-directed signal can be taken by another
    thread (torch's, OpenMP's) that does not block it, and Python then runs the handler in the
    main thread at its next bytecode, inside the block."""
    if _holding:
        _deferred.append(signum)
        return True
    return False


@contextmanager
def signals_held():
    """Hold SIGINT / SIGTERM / SIGHUP for the few statements inside (create a temporary file and
    record its name): one that arrives meanwhile is delivered when they are done, so its
    exception is raised where the caller's cleanup already knows the file. The signals are
    blocked for this thread (where `pthread_sigmask` exists) and, for a handler that asks
    `defer_signal`, deferred at the Python level too."""
    global _holding
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD) if hasattr(signal, "pthread_sigmask") else None
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if not _holding and _deferred:
            signum = _deferred[0]
            _deferred.clear()
            signal.raise_signal(signum)  # delivered to this thread: the handler runs now, past the block
