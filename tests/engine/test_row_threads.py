"""A step's CPU thread count follows its rows (engine/threads.py `for_rows`): inside an applied
choice with a wide count, the target's steps of `WIDE_ROWS`+ rows, its prompt, the drafter's block
and a wide ingest run at that count, a one-row step at the narrow one; the count is this thread's
own; and a wide step's bits, hence every stream, are the same at one and two threads."""

from __future__ import annotations

import threading

import pytest
import torch

from memra_cli.assets import default_pair
from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
from memra_cli.engine.threads import WIDE_ROWS, ThreadChoice, applied, for_rows

WIDE = ThreadChoice(1, None, 2)
PROMPT = [11, 230, 5, 99, 1024, 7, 7, 300, 12, 45, 46, 47]


def test_for_rows_takes_the_wide_count_from_wide_rows_on_and_only_inside_applied():
    torch.set_num_threads(1)
    with for_rows(64):
        assert torch.get_num_threads() == 1  # no choice applied: left as it is
    with applied(WIDE):
        for rows, want in ((1, 1), (WIDE_ROWS - 1, 1), (WIDE_ROWS, 2), (16, 2)):
            with for_rows(rows):
                assert torch.get_num_threads() == want, rows
            assert torch.get_num_threads() == 1, rows  # and back after
        seen = []
        other = threading.Thread(target=lambda: seen.append(_count_in(for_rows(16))))
        other.start()
        other.join()
        assert seen == [torch.get_num_threads()]  # another thread applied nothing: no switch there
        with applied(ThreadChoice(3, None)):  # an inner choice without a wide count: every step at 3
            with for_rows(16):
                assert torch.get_num_threads() == 3
        with for_rows(16):
            assert torch.get_num_threads() == 2  # the outer choice again
    assert torch.get_num_threads() == 1


def _count_in(ctx) -> int:
    with ctx:
        return torch.get_num_threads()


@pytest.fixture(scope="module")
def pair():
    return default_pair()


def _record(monkeypatch, owner, name: str, label: str, seen: list) -> None:
    inner = getattr(owner, name)

    def recording(*args, **kwargs):
        seen.append((label, torch.get_num_threads()))
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)


def test_wide_work_runs_at_the_wide_count_and_one_row_steps_at_the_narrow(pair, monkeypatch):
    target_dir, drafts = pair
    torch.set_num_threads(1)
    engine = Engine.load(EngineConfig(target=target_dir, device="cpu", dtype="float32", threads=1))
    arm = engine.arm(ArmConfig(draft=drafts["dspark"], mode="dspark"))
    seen: list = []
    _record(monkeypatch, engine.target, "static_step", "fixed step", seen)
    _record(monkeypatch, engine.target, "forward", "forward", seen)
    _record(monkeypatch, arm.drafter, "forward_round", "block", seen)
    with torch.inference_mode(), applied(WIDE):
        with engine.session(PROMPT, 24, arm, eos_ids=()) as s:
            s.prime()
            s.run()
        assert {("fixed step", 2), ("forward", 2), ("block", 2)} <= set(seen)  # verify, prompt, block
        assert {n for label, n in seen if label in ("fixed step", "block")} == {2}
        seen.clear()
        plain = engine.fastest_plain()  # variable-width one-row steps
        with plain.session(PROMPT, 8, None, eos_ids=()) as s:
            s.prime()
            s.run()
        assert seen[0] == ("forward", 2) and set(seen[1:]) == {("forward", 1)}  # the prompt, then one-row steps
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_wide_step_has_the_same_bits_at_one_and_two_threads(pair, dtype):
    """The fixed 16-row step's logits, bit for bit; and the speculative stream under the wide
    choice equals the plain fixed-width stream at one thread."""
    target_dir, drafts = pair
    torch.set_num_threads(1)
    engine = Engine.load(EngineConfig(target=target_dir, device="cpu", dtype=dtype, threads=1))
    ids = torch.tensor(PROMPT)
    logits = {}
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            state = engine.runner.new_state(64)
            engine.runner.prefill(ids, state)
            logits[threads] = engine.runner.step(torch.tensor([5, 6, 7]), len(PROMPT), state)[0]
        torch.set_num_threads(1)
        assert logits[1].shape[0] == 3 and torch.equal(logits[1], logits[2])
        with engine.session(PROMPT, 48, None, eos_ids=()) as s:
            s.prime()
            reference = list(s.run())
        arm = engine.arm(ArmConfig(draft=drafts["dspark"], mode="dspark"))
        with applied(WIDE), engine.session(PROMPT, 48, arm, eos_ids=()) as s:
            s.prime()
            assert list(s.run()) == reference
