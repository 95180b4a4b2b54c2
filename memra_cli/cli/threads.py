"""`--threads` / MEMRA_THREADS for `generate`, `bench` and `serve`: the option, its check, and
applying the engine's choice for as long as the command runs.

The policy itself (how many threads for which target on which device, and the note that says
why) is the engine's (`engine/threads.py`): `Engine.load` decides once, from the device it
resolved and the checkpoint it opened. Here the value is checked as it is parsed
(`ThreadsOpt`'s callback, `checks.check_threads`), so a bad one is refused before torch loads;
`threads_setting` turns it into the engine's settings, and `use_threads` applies the engine's
choice until the command ends (torch's setting comes back after: the CLI can run in-process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import typer

from memra_cli.cli.common import SETTINGS
from memra_cli.engine.threads import SMALL_TARGET_PARAMS, ThreadChoice, applied  # noqa: F401  (the policy's names, for callers)


@dataclass(frozen=True)
class ThreadsUsed:
    """What a command runs with: torch's intra-op thread count once the choice is applied, the
    count its steps of `WIDE_ROWS`+ rows take, and the note."""

    threads: int
    note: Optional[str]
    wide: int


def _source(from_env: bool) -> str:
    """How the note names a requested count: the flag, or the variable it came from."""
    return SETTINGS["threads"].env if from_env else SETTINGS["threads"].flag


def choose_threads(requested: Optional[int], device_type: str, target_params: Optional[int], *,
                   env: Mapping[str, str], default: int, cores: int, load: float,
                   idle: Optional[float] = None, from_env: bool = False) -> ThreadChoice:
    """The engine's policy (`engine.threads.choose_threads`) with the note naming the CLI's flag or variable."""
    from memra_cli.engine.threads import choose_threads as policy

    return policy(requested, device_type, target_params, env=env, default=default, cores=cores, load=load,
                  idle=idle, source=_source(from_env))


def threads_setting(value: Optional[str], ctx=None) -> dict:
    """`--threads` / MEMRA_THREADS as given -> the engine's settings (`EngineConfig.threads`,
    `.threads_source`)."""
    from memra_cli.cli.checks import check_threads
    from memra_cli.cli.common import current_context, from_environment

    check_threads(value)  # the option's callback did; this is the backstop for a Python caller
    ctx = ctx or current_context()
    return {"threads": None if value is None else int(value),
            "threads_source": _source(from_environment("threads", ctx))}


def decide(value: Optional[str], device: str, target_dir: Path, from_env: bool = False) -> ThreadChoice:
    """The choice for this machine and target outside a load (a Python caller): `value` as given
    (`--threads` / MEMRA_THREADS, or None), `device` as given (`auto` resolved here). A command
    gets the same choice from `Engine.load` (`engine.threads`), which opens the checkpoint once."""
    from memra_cli.cli.checks import check_threads
    from memra_cli.engine.api import resolve_device
    from memra_cli.engine.errors import MemraError
    from memra_cli.engine.formats.checkpoint import open_checkpoint
    from memra_cli.engine.threads import checkpoint_params, needs_size, thread_choice

    check_threads(value)
    requested = None if value is None else int(value)
    device_type = resolve_device(device).type
    params = None
    if needs_size(requested, device_type, os.environ):
        try:
            params = checkpoint_params(open_checkpoint(Path(target_dir)))
        except MemraError:  # a checkpoint the load refuses, in its own words, next
            params = None
    return thread_choice(requested, device_type, params, source=_source(from_env))


def use_threads(choice: ThreadChoice, *, announce: bool = False) -> ThreadsUsed:
    """Apply the engine's thread choice (`engine.threads`) for the running command; torch's
    setting comes back when the command ends (its click context closes, error or not).
    `announce`: print the note now (else the caller prints `.note`)."""
    from memra_cli.cli.common import current_context

    ctx = current_context()
    if ctx is not None:
        threads = ctx.with_resource(applied(choice))
    else:  # a Python caller outside a command: the setting stays, as torch.set_num_threads leaves it
        import torch

        if choice.threads is not None:
            torch.set_num_threads(choice.threads)
        threads = torch.get_num_threads()
    if announce and choice.note:
        from memra_cli.cli.render import note

        note(choice.note)
    return ThreadsUsed(threads, choice.note, threads if choice.wide is None else choice.wide)


def _check_option(ctx: typer.Context, param: typer.CallbackParam, value: Optional[str]) -> Optional[str]:
    """Refuse a bad value as it is parsed: before the command runs, so before torch loads. The
    refusal names the setting as the user gave it (the context that knows is at hand here, and
    gone by the time the app prints the error)."""
    from memra_cli.cli.checks import check_threads
    from memra_cli.cli.common import describe
    from memra_cli.engine.errors import ConfigError, SettingError

    try:
        check_threads(value)
    except SettingError as exc:
        raise ConfigError(describe(exc, ctx)) from None
    return value


THREADS_HELP = ("CPU threads per op (torch intra-op), a positive integer. Unset: OMP_NUM_THREADS when set; else one "
                "for a target under 32M parameters (a second thread only adds synchronisation to its tiny ops) and, "
                "for its steps of 8+ rows (a verify, the drafter's block, the prompt), the cores idle at load; "
                "for a larger one the cores the 1-minute load average leaves free (CUDA: torch's default). A note "
                "names the choice; --json reports it as threads (and threads_wide).")
ThreadsOpt = typer.Option(None, "--threads", envvar=SETTINGS["threads"].env, help=THREADS_HELP, show_envvar=True,
                          callback=_check_option)
