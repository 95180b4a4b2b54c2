"""How many CPU threads each torch op may use (`generate`, `bench`), and the note that says so.

torch gives every op one thread per core by default. A small target's ops are tiny (the
embedded 5.8M-parameter target multiplies [16, 256] by [256, 768]): a second thread adds a
synchronisation per op and gains nothing, and when another process holds the other core every
op waits for a thread that is not running. On a shared 2-core machine a second thread won once
and lost up to 8x (docs/tuning.md#cpu-threads). Hence:

1. `--threads N` / MEMRA_THREADS, or OMP_NUM_THREADS, when the user set one;
2. on CUDA, torch's default (the CPU only launches work there);
3. a target under `SMALL_TARGET_PARAMS`: one thread;
4. a larger one: torch's default, less the cores other work already keeps busy (the 1-minute
   load average), at least one.

The value is checked as it is parsed (`ThreadsOpt`'s callback, `checks.check_threads`), so a
bad one is refused before torch loads. A command applies the choice with `use_threads`, which
restores torch's setting when the command ends: the CLI can run in-process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import typer

from memra_cli.cli.common import SETTINGS

SMALL_TARGET_PARAMS = 32_000_000  # at 29M a second thread won 1.25x at best and lost 5x beside other work


@dataclass(frozen=True)
class ThreadChoice:
    """Threads to set (None: leave torch's setting as it is) and the note that says why (None: nothing to say)."""

    threads: Optional[int]
    note: Optional[str]


@dataclass(frozen=True)
class ThreadsUsed:
    """What a command runs with: torch's intra-op thread count once the choice is applied, and its note."""

    threads: int
    note: Optional[str]


def choose_threads(requested: Optional[int], device_type: str, target_params: Optional[int], *,
                   env: Mapping[str, str], default: int, cores: int, load: float,
                   from_env: bool = False) -> ThreadChoice:
    """The policy above, from facts the caller gathers (so a test can give any of them).
    `target_params` None: not known (the load will say why); the target is taken as large."""
    if requested is not None:
        source = SETTINGS["threads"].env if from_env else SETTINGS["threads"].flag
        return ThreadChoice(requested, f"CPU threads: {requested} ({source})")
    if device_type != "cpu":
        return ThreadChoice(None, None)
    if env.get("OMP_NUM_THREADS"):  # torch read it when it started
        return ThreadChoice(None, f"CPU threads: {default} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})")
    size = "size unknown" if target_params is None else f"{target_params / 1e6:.1f}M params"
    if target_params is not None and target_params < SMALL_TARGET_PARAMS:
        return ThreadChoice(1, f"CPU threads: 1 (small target, {size}: a second thread only adds "
                               "synchronisation per op; --threads N to choose)")
    free = max(1, cores - round(load))
    threads = min(default, free)
    return ThreadChoice(threads, f"CPU threads: {threads} of {default} ({size}; 1-minute load {load:.1f} "
                                 f"on {cores} cores; --threads N to choose)")


def machine_facts() -> tuple[int, float]:
    """(cores this process may run on, 1-minute load average; 0 where the system has none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load


def target_params(target_dir: Path) -> int:
    """Parameters of a target directory, from its safetensors headers (nothing is loaded)."""
    from memra_cli.engine.formats.checkpoint import open_checkpoint

    return sum(t.numel for t in open_checkpoint(Path(target_dir)).tensors.values())


def decide(value: Optional[str], device: str, target_dir: Path, from_env: bool = False) -> ThreadChoice:
    """The choice for this machine and target: `value` as given (`--threads` / MEMRA_THREADS, or
    None), `device` as given (`auto` resolved here)."""
    import torch

    from memra_cli.cli.checks import check_threads
    from memra_cli.engine.api import resolve_device
    from memra_cli.engine.errors import MemraError

    check_threads(value)  # the option's callback did; this is the backstop for a Python caller
    requested = None if value is None else int(value)
    device_type = resolve_device(device).type
    params = None
    if requested is None and device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        try:
            params = target_params(target_dir)
        except MemraError:  # a checkpoint the load refuses, in its own words, next
            params = None
    cores, load = machine_facts()
    return choose_threads(requested, device_type, params, env=os.environ, default=torch.get_num_threads(),
                          cores=cores, load=load, from_env=from_env)


@contextmanager
def applied(choice: ThreadChoice):
    """Set the chosen thread count for the duration, and yield the count in effect (torch's
    setting is restored after)."""
    import torch

    before = torch.get_num_threads()
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def use_threads(value: Optional[str], *, device: str, target: Optional[Path], announce: bool = False) -> ThreadsUsed:
    """Decide and apply the thread count for the running command; torch's setting comes back
    when the command ends (its click context closes, error or not). `target` None: the embedded
    default target. `announce`: print the note now (else the caller prints `.note`)."""
    from memra_cli.cli.common import current_context, from_environment

    if target is None:
        from memra_cli.assets import default_pair

        target = default_pair()[0]
    ctx = current_context()
    choice = decide(value, device, Path(target), from_env=from_environment("threads", ctx))
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
    return ThreadsUsed(threads, choice.note)


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
                "for a target under 32M parameters (a second thread only adds synchronisation to its tiny ops), and "
                "for a larger one the cores the 1-minute load average leaves free (CUDA: torch's default). A note "
                "names the choice; --json reports it as threads.")
ThreadsOpt = typer.Option(None, "--threads", envvar=SETTINGS["threads"].env, help=THREADS_HELP, show_envvar=True,
                          callback=_check_option)
