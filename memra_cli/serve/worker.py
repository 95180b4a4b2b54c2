"""The one thread that runs every model computation of `memra serve`.

Sessions of one engine share its target, runner, drafter and storage pool, none of which is
made to be driven from two threads at once; and torch's grad mode is per thread. So every
session is created, advanced and closed here, on one thread, and the HTTP side only hands jobs
in and reads events out. The live sessions are interleaved a round at a time (`session.burst(1)`
runs exactly one round: every round commits at least one token), in a fixed rotation: each live
request gets one round per pass, whatever its length, so a long request cannot starve a short
one. Each session has its own state and sampler keyed by its own seed and positions, so a
stream is what the same request gives alone.

Admission is bounded: at most `max_live` sessions interleave, at most `max_waiting` more wait in
arrival order, and `submit` refuses past that (the HTTP side answers 429). A job whose client
went away is cancelled: its session is closed on the next pass, and its storages go back to the
engine's pool.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class QueueFull(Exception):
    """More requests than the server admits (live + waiting)."""


class WorkerFailed(Exception):
    """The worker thread is gone (its setup or its loop raised): no request can run."""


@dataclass
class Job:
    """One request's decode: what to run, and the events its client reads.

    Events, posted in order to `events` (an asyncio.Queue on the HTTP side's loop):
    `("tokens", [ids])` per round, then `("done", stats)` or `("error", message)`."""

    prompt_ids: list[int]
    max_new: int
    sampler: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: Any = None

    def post(self, kind: str, value: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    """Owns the model work: `start()`, `submit(job)` from any thread, `cancel(job)`, `stop()`.

    `open_session(job)` makes the job's session (the engine's `session(...)`); `setup()` is
    entered on the worker thread for its lifetime (inference mode, the CPU thread count)."""

    def __init__(self, open_session: Callable[[Job], Any], setup: Callable[[], Any], *, max_live: int,
                 max_waiting: int):
        self.open_session, self.setup = open_session, setup
        self.max_live, self.max_waiting = max_live, max_waiting
        self.waiting: deque[Job] = deque()
        self.live: list[Job] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.rounds = 0  # rounds run, all sessions together (for /health)
        self.failure: Optional[str] = None  # why the worker thread ended, if it failed
        self._ready = threading.Event()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self.waiting) + len(self.live)

    def start(self) -> None:
        """Start the worker thread (once: a second call only waits) and return once its setup
        has run; raise `WorkerFailed` if the setup raised (a server must not listen with no one
        to run its requests)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memra-serve-worker", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self.failure is not None:
            raise WorkerFailed(f"the model thread failed to start: {self.failure}")

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self.failure is not None:
                raise WorkerFailed(f"the model thread has failed ({self.failure}); restart the server")
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(self.live) >= self.max_live + self.max_waiting:
                raise QueueFull(f"{len(self.live)} requests running and {len(self.waiting)} waiting: the queue is full")
            self.waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away (or has all it wants): close the session on the next pass."""
        job.cancelled.set()
        with self._cv:
            self._cv.notify()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - reported to every job and to start()/submit()
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()

    def _fail(self, why: str) -> None:
        """The thread is ending on an error: every job it held ends with that error."""
        with self._cv:
            self.failure = why
            jobs = list(self.live) + list(self.waiting)
            self.live.clear()
            self.waiting.clear()
        for job in jobs:
            job.post("error", f"the model thread failed: {why}")

    def _serve(self) -> None:
        with self.setup():
            self._ready.set()
            while True:
                with self._cv:
                    while not self._stopping and not self.live and not self.waiting:
                        self._cv.wait()
                    if self._stopping:
                        break
                    while self.waiting and len(self.live) < self.max_live:
                        self.live.append(self.waiting.popleft())
                    jobs = list(self.live)
                for job in jobs:  # one round each, in rotation
                    if not self._advance(job):
                        with self._cv:
                            self.live.remove(job)
            self._close_all()

    def _advance(self, job: Job) -> bool:
        """One round of `job`; False once it is over (finished, cancelled or failed)."""
        try:
            if job.cancelled.is_set():
                return self._close(job)
            if job.session is None:
                job.session = self.open_session(job)
            new = job.session.burst(1)
            self.rounds += 1
            job.post("tokens", new)
            if job.session.finished:  # the session closed itself: its storages are back
                job.post("done", job.session.stats)
                job.session = None
                return False
            return True
        except Exception as exc:  # a failure of one request ends that request, not the server
            job.post("error", f"{type(exc).__name__}: {exc}")
            return self._close(job)

    @staticmethod
    def _close(job: Job) -> bool:
        """Close the job's session (pooled storages back to the pool) and drop it (the rest is freed)."""
        if job.session is not None:
            job.session.close()
            job.session = None
        return False

    def _close_all(self) -> None:
        with self._cv:
            jobs = list(self.live) + list(self.waiting)
            self.live.clear()
            self.waiting.clear()
        for job in jobs:
            self._close(job)
            job.post("error", "the server is shutting down")

