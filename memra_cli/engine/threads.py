"""How many CPU threads each torch op may use: the policy every front end shares.

torch gives every op one thread per core by default. A small target's ops are tiny (the
embedded 5.8M-parameter target multiplies [16, 256] by [256, 768]): a second thread adds a
synchronisation per op and gains nothing, and when another process holds the other core every
op waits for a thread that is not running (the measurements: docs/tuning.md#cpu-threads).
Hence:

1. a requested count (the front end's `--threads` / MEMRA_THREADS), or OMP_NUM_THREADS, when set;
2. on CUDA, torch's default (the CPU only launches work there);
3. a target under `SMALL_TARGET_PARAMS`: one thread;
4. a larger one: torch's default, less the cores other work already keeps busy (the 1-minute
   load average), at least one.

`Engine.load` decides once, from the device it resolved and the checkpoint it opened
(`engine.threads`); a front end applies the choice for as long as it runs (`applied`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping, Optional

SMALL_TARGET_PARAMS = 32_000_000  # where a second thread stops paying: docs/tuning.md#cpu-threads


@dataclass(frozen=True)
class ThreadChoice:
    """Threads to set (None: leave torch's setting as it is) and the note that says why (None: nothing to say)."""

    threads: Optional[int]
    note: Optional[str]


def choose_threads(requested: Optional[int], device_type: str, target_params: Optional[int], *,
                   env: Mapping[str, str], default: int, cores: int, load: float,
                   source: str = "--threads") -> ThreadChoice:
    """The policy above, from facts the caller gathers (so a test can give any of them).
    `target_params` None: not known (the load will say why); the target is taken as large.
    `source`: how the front end names a requested count in the note (its flag or variable)."""
    if requested is not None:
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


def needs_size(requested: Optional[int], device_type: str, env: Mapping[str, str]) -> bool:
    """Whether the policy reads the target's size (only for an unrequested count on the CPU)."""
    return requested is None and device_type == "cpu" and not env.get("OMP_NUM_THREADS")


def checkpoint_params(ckpt) -> int:
    """Parameters of an opened checkpoint (`formats.checkpoint.Checkpoint`), from its headers."""
    return sum(t.numel for t in ckpt.tensors.values())


def thread_choice(requested: Optional[int], device_type: str, target_params: Optional[int], *,
                  source: str = "--threads", env: Mapping[str, str] | None = None) -> ThreadChoice:
    """The choice for this machine: `choose_threads` with torch's default, the cores and the load read here."""
    import torch

    cores, load = machine_facts()
    return choose_threads(requested, device_type, target_params, env=os.environ if env is None else env,
                          default=torch.get_num_threads(), cores=cores, load=load, source=source)


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
