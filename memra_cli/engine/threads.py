"""How many CPU threads each torch op may use: the policy every front end shares.

torch gives every op one thread per core by default. A small target's one-row ops are tiny (the
embedded 5.8M-parameter target multiplies [1, 256] by [256, 768]): a second thread adds a
synchronisation per op and gains nothing, and when another process holds the other core every
op waits for a thread that is not running. A step of many rows (a 16-row verify, the drafter's
block, a prompt) is arithmetic enough for a second thread to pay, when a core is idle for it
(the measurements: docs/tuning.md#cpu-threads). Hence:

1. a requested count (the front end's `--threads` / MEMRA_THREADS), or OMP_NUM_THREADS, when set:
   every op;
2. on CUDA, torch's default (the CPU only launches work there);
3. a target under `SMALL_TARGET_PARAMS`: one thread, and for a step of `WIDE_ROWS` rows or more
   the cores idle at load (sampled over `IDLE_SAMPLE_S`), at most `WIDE_MAX` and torch's default;
4. a larger one: torch's default, less the cores other work already keeps busy (the 1-minute
   load average), at least one.

`Engine.load` decides once, from the device it resolved and the checkpoint it opened
(`engine.threads`); a front end applies the choice for as long as it runs (`applied`), and the
engine's steps take the wide count inside `for_rows` (StepRunner's steps and prefill, the
drafter's block and ingest). Within a session the count is a function of a step's rows, so a
fixed-width step always runs at one count; the CPU step's ops give the same bits at one and two
threads besides (tests/engine/test_row_threads.py).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Mapping, Optional

SMALL_TARGET_PARAMS = 32_000_000  # where a second thread stops paying: docs/tuning.md#cpu-threads
WIDE_ROWS = 8  # a step this wide is arithmetic enough for a second thread: docs/tuning.md#cpu-threads
IDLE_SAMPLE_S = 0.05  # the window the idle cores are counted over (/proc/stat ticks are 10 ms)
IDLE_KEEP_S = 30.0  # a process's loads within this long reuse one sample
WIDE_MAX = 2  # the most threads a small target's wide step takes: more is unmeasured (docs/tuning.md#cpu-threads)


@dataclass(frozen=True)
class ThreadChoice:
    """Threads to set (None: leave torch's setting as it is) and the note that says why (None: nothing to say)."""

    threads: Optional[int]
    note: Optional[str]
    wide: Optional[int] = None  # for a step of WIDE_ROWS+ rows (`for_rows`); None: `threads` for every step


def choose_threads(requested: Optional[int], device_type: str, target_params: Optional[int], *,
                   env: Mapping[str, str], default: int, cores: int, load: float,
                   idle: Optional[float] = None, source: str = "--threads") -> ThreadChoice:
    """The policy above, from facts the caller gathers (so a test can give any of them).
    `target_params` None: not known (the load will say why); the target is taken as large.
    `idle`: cores idle just now (None: not known, then `cores - load`).
    `source`: how the front end names a requested count in the note (its flag or variable)."""
    if requested is not None:
        return ThreadChoice(requested, f"CPU threads: {requested} ({source})")
    if device_type != "cpu":
        return ThreadChoice(None, None)
    if env.get("OMP_NUM_THREADS"):  # torch read it when it started
        return ThreadChoice(None, f"CPU threads: {default} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})")
    size = "size unknown" if target_params is None else f"{target_params / 1e6:.1f}M params"
    if target_params is not None and target_params < SMALL_TARGET_PARAMS:
        idle_now = float(cores) - load if idle is None else idle
        wide = min(default, cores, WIDE_MAX, max(1, int(idle_now + 0.5)))
        if wide > 1:
            return ThreadChoice(1, f"CPU threads: 1, {wide} for steps of {WIDE_ROWS}+ rows (small target, {size}: "
                                   f"a second thread pays only on wide steps; {idle_now:.1f} of {cores} cores idle; "
                                   "--threads N to choose)", wide)
        return ThreadChoice(1, f"CPU threads: 1 (small target, {size}: a second thread only adds "
                               f"synchronisation per op; {_idle_words(idle_now, cores, default)}--threads N to choose)")
    free = max(1, cores - round(load))
    threads = min(default, free)
    return ThreadChoice(threads, f"CPU threads: {threads} of {default} ({size}; 1-minute load {load:.1f} "
                                 f"on {cores} cores; --threads N to choose)")


def _idle_words(idle_now: float, cores: int, default: int) -> str:
    """Why the small-target note gives wide steps no second thread, where the machine has one to give."""
    return "" if min(cores, default) < 2 else f"{max(0.0, idle_now):.1f} of {cores} cores idle for wide steps; "


_IDLE_SAMPLE: list = [None]  # (monotonic time, idle cores) of this process's last sample


def idle_cores(cores: int, window: float = IDLE_SAMPLE_S, stat: str = "/proc/stat") -> Optional[float]:
    """Cores idle over `window` seconds just now, from `stat`'s all-CPU line (this process
    sleeps meanwhile, so its own work does not count): the idle share of every CPU's ticks times
    the machine's CPUs, at most `cores` (those this process may run on); None where there is no
    such file. A sample is reused for `IDLE_KEEP_S` (a test session loads hundreds of engines)."""
    last = _IDLE_SAMPLE[0]
    if last is not None and time.monotonic() - last[0] < IDLE_KEEP_S:
        return last[1]
    before = _stat_ticks(stat)
    if before is None:
        return None
    time.sleep(window)
    after = _stat_ticks(stat)
    if after is None or after[0] <= before[0]:
        return None
    idle = (after[1] - before[1]) / (after[0] - before[0]) * (os.cpu_count() or cores)
    idle = min(float(cores), idle)
    _IDLE_SAMPLE[0] = (time.monotonic(), idle)
    return idle


def _stat_ticks(stat: str) -> Optional[tuple[int, int]]:
    """(all ticks, idle + iowait ticks) of /proc/stat's first line (`cpu user nice system idle
    iowait irq softirq steal ...`), or None where it cannot be read."""
    try:
        with open(stat) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    return sum(fields[:8]), fields[3] + fields[4]


def cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> Optional[int]:
    """The CPUs a cgroup v2 quota allows this process (`quota period` in `cpu.max`, rounded up),
    or None where there is no quota: a container's /proc shows the host's cores."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def machine_facts() -> tuple[int, float]:
    """(cores this process may run on: its affinity, at most a cgroup quota's CPUs; 1-minute
    load average, 0 where the system has none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpus()
    if quota is not None:
        cores = min(cores, quota)
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

    env = os.environ if env is None else env
    cores, load = machine_facts()
    small = target_params is not None and target_params < SMALL_TARGET_PARAMS
    idle = idle_cores(cores) if needs_size(requested, device_type, env) and small and cores > 1 else None
    return choose_threads(requested, device_type, target_params, env=env,
                          default=torch.get_num_threads(), cores=cores, load=load, idle=idle, source=source)


_APPLIED = threading.local()  # .choices: the choices `applied` holds in this thread, innermost last


@contextmanager
def applied(choice: ThreadChoice):
    """Set the chosen thread count for the duration, and yield the count in effect (torch's
    setting is restored after). Inside, `for_rows` gives a wide step the choice's `wide` count.
    (torch's intra-op setting is per thread, so is this: a server's model thread applies its own.)"""
    import torch

    before = torch.get_num_threads()
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    stack = _APPLIED.__dict__.setdefault("choices", [])
    stack.append(choice)
    try:
        yield torch.get_num_threads()
    finally:
        stack.pop()
        torch.set_num_threads(before)


_UNCHANGED = nullcontext()  # what `for_rows` returns where a step keeps torch's setting (reusable)


def for_rows(rows: int):
    """A context running a step of `rows` rows at the applied choice's count for it: its `wide`
    count from `WIDE_ROWS` rows on; torch's setting as it is below that, outside `applied`, and
    for a choice without a wide count (CUDA, a requested count), where it costs one lookup (it
    wraps every step and every drafter round)."""
    stack = getattr(_APPLIED, "choices", None)
    wide = stack[-1].wide if stack else None
    if wide is None or rows < WIDE_ROWS:
        return _UNCHANGED
    return _at_threads(wide)


@contextmanager
def _at_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
