"""The serve worker alone, over stand-in sessions: every live request gets one round per pass
(a long request does not starve a short one), admission is bounded, and a cancelled job's
session is closed on the next pass."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from memra_cli.serve.worker import Job, QueueFull, Worker


class FakeSession:
    """Commits one token per round, `n` rounds in all; records the order rounds ran in."""

    def __init__(self, name: str, n: int, log: list):
        self.name, self.n, self.log, self.tokens, self.closed, self.stats = name, n, log, [], False, object()

    @property
    def finished(self) -> bool:
        return self.closed or len(self.tokens) >= self.n

    def burst(self, k: int) -> list[int]:
        self.log.append(self.name)
        self.tokens.append(len(self.tokens))
        if self.finished:
            self.closed = True
        return self.tokens[-1:]

    def close(self) -> None:
        self.closed = True


async def _drain(job: Job) -> list:
    events = []
    while not events or events[-1][0] == "tokens":
        events.append(await asyncio.wait_for(job.events.get(), 10))
    return events


def _worker(sessions: dict, log: list, **kw) -> Worker:
    return Worker(lambda job: sessions.setdefault(job.prompt_ids[0], FakeSession(job.prompt_ids[0], job.max_new, log)),
                  contextlib.nullcontext, **kw)


def test_round_robin_and_bounded_admission():
    async def main():
        log, sessions = [], {}
        w = _worker(sessions, log, max_live=2, max_waiting=1)
        loop = asyncio.get_running_loop()
        jobs = [Job([name], n, None, loop) for name, n in (("long", 6), ("short", 2), ("late", 2))]
        for job in jobs:
            w.submit(job)
        with pytest.raises(QueueFull):  # two live + one waiting is the bound
            w.submit(Job(["refused"], 1, None, loop))
        w.start()
        try:
            results = await asyncio.gather(*(_drain(j) for j in jobs))
        finally:
            w.stop()
        return log, results

    log, results = asyncio.run(main())
    assert [len([e for e in r if e[0] == "tokens"]) for r in results] == [6, 2, 2]
    assert all(r[-1][0] == "done" for r in results)
    # one round each per pass; "late" waits for a free place and is admitted as soon as "short" ends
    assert log == ["long", "short", "long", "short", "long", "late", "long", "late", "long", "long"]


def test_a_cancelled_job_is_closed_on_the_next_pass():
    async def main():
        log, sessions = [], {}
        w = _worker(sessions, log, max_live=4, max_waiting=0)
        job = Job(["a"], 10 ** 9, None, asyncio.get_running_loop())
        w.submit(job)
        w.start()
        try:
            assert (await asyncio.wait_for(job.events.get(), 10))[0] == "tokens"
            w.cancel(job)
            for _ in range(500):
                if not w.live:
                    break
                await asyncio.sleep(0.01)
        finally:
            w.stop()
        return sessions["a"], w

    session, w = asyncio.run(main())
    assert session.closed and len(session.tokens) < 10 ** 9 and not w.live and w.pending == 0


def test_a_failing_session_ends_its_request_only():
    async def main():
        log, sessions = [], {}
        w = _worker(sessions, log, max_live=2, max_waiting=0)
        loop = asyncio.get_running_loop()
        bad, good = Job(["bad"], 3, None, loop), Job(["good"], 3, None, loop)
        sessions["bad"] = FakeSession("bad", 3, log)
        sessions["bad"].burst = lambda k: (_ for _ in ()).throw(RuntimeError("boom"))
        w.submit(bad)
        w.submit(good)
        w.start()
        try:
            return await _drain(bad), await _drain(good), sessions["bad"]
        finally:
            w.stop()

    bad, good, session = asyncio.run(main())
    assert bad == [("error", "RuntimeError: boom")] and session.closed
    assert good[-1][0] == "done" and len(good) == 4


@contextlib.contextmanager
def _failing_setup():
    raise RuntimeError("no such device")
    yield  # pragma: no cover


def test_a_worker_whose_setup_fails_refuses_at_start_and_on_submit():
    """A server must not listen with no thread to run its requests: start() raises the setup's
    error, and a later submit is refused with it instead of waiting forever."""
    from memra_cli.serve.worker import WorkerFailed

    async def main():
        w = Worker(lambda job: None, _failing_setup, max_live=2, max_waiting=2)
        queued = Job(["queued"], 3, None, asyncio.get_running_loop())
        w.submit(queued)  # submitted before start: it ends with the setup's error
        with pytest.raises(WorkerFailed, match="RuntimeError: no such device"):
            w.start()
        with pytest.raises(WorkerFailed, match="no such device"):
            w.submit(Job(["late"], 3, None, asyncio.get_running_loop()))
        return await _drain(queued), w

    events, w = asyncio.run(main())
    assert events == [("error", "the model thread failed: RuntimeError: no such device")]
    assert w.pending == 0 and w.failure == "RuntimeError: no such device"


def test_the_model_thread_gets_an_indexed_cuda_device(monkeypatch):
    """A bare `cuda` engine device is resolved, on the loading thread, to the index current there:
    torch.cuda.set_device on the worker thread refuses a bare `cuda` (torch's own index check
    stands in for the device here)."""
    import torch
    from torch.cuda._utils import _get_device_index

    from memra_cli.serve import app as serve_app

    with pytest.raises(ValueError, match="specified index"):  # what a bare `cuda` gets
        _get_device_index(torch.device("cuda"))
    assert serve_app.indexed_device(torch.device("cuda"), lambda: 3) == torch.device("cuda", 3)
    assert serve_app.indexed_device(torch.device("cuda", 1), lambda: 3) == torch.device("cuda", 1)
    assert serve_app.indexed_device(torch.device("cpu"), lambda: 3) == torch.device("cpu")

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    from memra_cli.engine.threads import ThreadChoice

    with serve_app._model_thread(serve_app.indexed_device(torch.device("cuda"), lambda: 2), ThreadChoice(None, None)):
        assert not torch.is_grad_enabled()
    assert chosen == [2]
