"""The speculative round loop: exactness, exact acceptance accounting, stops, bursts, refusals.

- `OracleProposer` stands behind the same `Proposer` protocol as `DrafterProposer`: it knows the
  target's greedy continuation and proposes it, with planted errors at scheduled slots (and
  scheduled confidence raws). Accepted counts per round are then known in advance: the tests
  pin `accept_hist`, `accepted`, `drafted` and `rounds` exactly, by hand for a few schedules
  and against a small independent model of the round (ladder, confidence window, budget) for
  hypothesis-drawn ones. The oracle also checks what the round feeds back: the drafter context
  is ingested contiguously, and the ingested taps are the target's own taps of the stream.
- The real `DrafterProposer` (tiny random drafters; the DSpark ones carry a planted markov head
  that knows most of the target's bigrams, so acceptance is partial) reproduces
  `greedy_reference` token for token over programs x harvests x windows x markov x blocks
  x caps x adapt, resolved and loaded through `Engine.arm`, run through `Engine.session`.
- EOS inside an accepted block, as an anchor, as the very first token; `max_new` mid-block,
  0 and 1; `Session.burst` semantics; the pipeline's refusals.
- A `gpu`-marked variant repeats a small matrix in float32 on CUDA.

Stream positions: the anchor `last` of a round sits at position `start` = committed target
length; with a prompt of P tokens it is stream token `start - P` (stream[0] comes from prefill).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memra_cli.engine.formats.census import take_census
from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.errors import ConfigError, MemraError, PolicyError, SettingError
from memra_cli.engine.api import Arm, ArmConfig, Engine, resolve_program
from memra_cli.engine.spec.policy import LADDER, Harvest, PolicySettings, VerifyWindow
from memra_cli.engine.spec.proposer import DrafterProposer, Program, Proposal, SpecError
from memra_cli.engine.spec.session import Session
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

VOCAB, HIDDEN, MASK = 512, 64, 511
N_TRUTH = 64  # greedy tokens known per prompt (max_new + a block stays below this)
MAX_NEW = 24
PROMPT_LENS = (5, 12, 21)
ORACLE_TAPS = (-1, 1, 3)


@dataclass
class World:
    root: Path
    target_dir: Path
    target: Qwen3Target
    prompts: list[list[int]]
    truths: list[list[int]]  # greedy_reference(prompt, N_TRUTH), no EOS


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("spec")
    target_dir = make_tiny_qwen3(root / "target")
    target = Qwen3Target.from_dir(target_dir)
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    truths = [greedy_reference(target, p, N_TRUTH) for p in prompts]
    return World(root, target_dir, target, prompts, truths)


# --------------------------------------------------------------------------- the oracle


class OracleProposer:
    """Proposes the target's true greedy continuation, wrong at scheduled slots.

    `wrong(round) -> set of draft slots` to corrupt (slot k = the k-th draft, 0-based);
    `raws(round) -> [nd] floats` for confidence windows. Records every ingest.
    """

    def __init__(self, truth: Sequence[int], prompt_len: int, n_drafts: int, device,
                 wrong: Callable[[int], set[int]] | Sequence[set[int]] = (),
                 raws: Callable[[int], Sequence[float]] | None = None):
        self.truth, self.p, self.nd, self.device = list(truth), prompt_len, n_drafts, device
        self.wrong = wrong if callable(wrong) else (lambda r, s=list(wrong): s[r] if r < len(s) else set())
        self.raws = raws
        self.reset(0)
        self.released = 0  # Session.release calls (once, when the stream ends)

    def release(self) -> None:
        self.released += 1

    def reset(self, capacity: int) -> None:
        self.round, self.ingested, self.taps, self.capacity = 0, 0, [], capacity

    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        want = torch.arange(self.ingested, self.ingested + taps.shape[0])
        assert torch.equal(positions.cpu(), want), "drafter context must grow contiguously"
        self.ingested += taps.shape[0]
        assert self.ingested <= self.capacity
        self.taps.append(taps.detach().cpu())

    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal:
        i = start - self.p
        assert self.ingested == start, "every committed row is in the drafter context"
        assert int(last) == self.truth[i], "the anchor is the target's own token"
        drafts = [self.truth[j] if j < len(self.truth) else 0 for j in range(i + 1, i + 1 + self.nd)]
        for slot in self.wrong(self.round):
            drafts[slot] = (drafts[slot] + 1) % VOCAB
        raws = None
        if want_raws:
            assert self.raws is not None
            raws = torch.tensor(list(self.raws(self.round)), dtype=torch.float32, device=self.device)
        self.round += 1
        return Proposal(torch.tensor(drafts, dtype=torch.long, device=self.device), raws)


def oracle_session(world: World, pi: int, max_new: int, wrong=(), *, block: int = 8,
                   harvest: Harvest = Harvest.DFLASH, cap: int | None = None, adapt: bool = True,
                   window: VerifyWindow = LADDER, raws=None, eos: Sequence[int] = (),
                   target: Qwen3Target | None = None, truth=None) -> tuple[Session, OracleProposer]:
    target = target or world.target
    nd = harvest.n_drafts(block)
    program = Program(harvest, window, False, cap or nd + 1, adapt, block)
    oracle = OracleProposer(truth or world.truths[pi], len(world.prompts[pi]), nd, target.device, wrong, raws)
    session = Session(StepRunner(target), world.prompts[pi], max_new, proposer=oracle, program=program,
                      taps=ORACLE_TAPS, eos_ids=eos)
    return session, oracle


@dataclass
class Expected:
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    hist: Counter = field(default_factory=Counter)


def simulate(first_wrong: Callable[[int], int], max_new: int, cap: int, adapt: bool,
             window: Callable[[int], int] | None = None) -> Expected:
    """The round's bookkeeping, written out: vt from the ladder (or this round's confidence
    window), never past the budget; m = accepted run; the ladder moves to clamp(m+2, 3, cap)."""
    e, tokens, vt = Expected(), 0, cap
    while tokens < max_new:
        v = window(e.rounds) if window else vt
        v = min(v, max_new - tokens)
        m = min(first_wrong(e.rounds), v - 1)
        e.hist[m] += 1
        e.accepted += m
        e.drafted += v - 1
        tokens += m + 1
        vt = min(max(m + 2, 3), cap) if adapt else cap
        e.rounds += 1
    return e


def check_stats(session: Session, want: Expected) -> None:
    s = session.stats
    assert (s.rounds, s.accepted, s.drafted) == (want.rounds, want.accepted, want.drafted)
    assert +s.accept_hist == +want.hist
    assert s.tokens == len(session.tokens)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check_ingested_taps(world: World, pi: int, session: Session, oracle: OracleProposer) -> None:
    """The rows ingested are the target's own taps of prompt + stream (a fresh forward)."""
    got = torch.cat(oracle.taps)
    n = got.shape[0]
    assert len(world.prompts[pi]) <= n <= session.position
    ids = (world.prompts[pi] + session.tokens)[:n]
    target = session.target
    cache = target.new_state(n)
    _, want = target.forward(torch.tensor(ids, device=target.device), 0, cache, ORACLE_TAPS)
    assert got.shape == want.shape
    assert rel_err(got, want.cpu()) < 1e-5


# --------------------------------------------------------------------------- oracle: exact counts


def test_oracle_full_acceptance(world):
    """b=8, dflash harvest (7 drafts, cap 8): every round commits the whole block."""
    session, oracle = oracle_session(world, 0, MAX_NEW)
    assert session.run() == world.truths[0][:MAX_NEW]
    check_stats(session, Expected(rounds=3, accepted=21, drafted=21, hist=Counter({7: 3})))
    assert session.stats.tau == 8.0 and session.position == len(world.prompts[0]) + MAX_NEW
    check_ingested_taps(world, 0, session, oracle)


def test_oracle_zero_acceptance(world):
    """Slot 0 always wrong: one token per round; the ladder drops from 8 to 3 after round 0,
    and the budget clips the last two windows to 2 and 1 (remaining 2, then 1)."""
    session, oracle = oracle_session(world, 1, MAX_NEW, lambda r: {0})
    assert session.run() == world.truths[1][:MAX_NEW]
    check_stats(session, Expected(rounds=24, accepted=0, drafted=7 + 21 * 2 + 1 + 0, hist=Counter({0: 24})))
    check_ingested_taps(world, 1, session, oracle)


PARTIAL = [{3}, {0}, {5}, set(), {1, 4}]  # then always right


def test_oracle_partial_acceptance_adaptive_ladder(world):
    # round: vt -> m (tokens):  8->3 (4), 5->0 (5), 3->2 (8), 4->3 (12), 5->1 (14),
    #                           3->2 (17), 4->3 (21), budget 3 -> 2 (24)
    session, oracle = oracle_session(world, 2, MAX_NEW, PARTIAL)
    assert session.run() == world.truths[2][:MAX_NEW]
    check_stats(session, Expected(rounds=8, accepted=16, drafted=27, hist=Counter({3: 3, 2: 3, 0: 1, 1: 1})))
    check_ingested_taps(world, 2, session, oracle)


def test_oracle_partial_acceptance_fixed_window(world):
    # adapt off, vt stays 8:  3 (4), 0 (5), 5 (11), 7 (19), budget 5 -> 1 (21), budget 3 -> 2 (24)
    session, _ = oracle_session(world, 2, MAX_NEW, PARTIAL, adapt=False)
    assert session.run() == world.truths[2][:MAX_NEW]
    check_stats(session, Expected(rounds=6, accepted=18, drafted=34,
                                  hist=Counter({3: 1, 0: 1, 5: 1, 7: 1, 1: 1, 2: 1})))


def test_oracle_dspark_harvest_and_cap(world):
    """b=4, dspark harvest: 4 drafts, cap 5; cap 2 (below the ladder floor 3) stays 2."""
    session, _ = oracle_session(world, 0, 10, block=4, harvest=Harvest.DSPARK)
    assert session.run() == world.truths[0][:10]
    check_stats(session, Expected(rounds=2, accepted=8, drafted=8, hist=Counter({4: 2})))
    session, _ = oracle_session(world, 0, 10, block=4, harvest=Harvest.DSPARK, cap=2)
    assert session.run() == world.truths[0][:10]
    check_stats(session, Expected(rounds=5, accepted=5, drafted=5, hist=Counter({1: 5})))


def test_oracle_confidence_window_sizes_the_verify(world):
    """Slot-confidence at tau 0.5 keeps leading slots with sigmoid >= 0.5: raws [+,+,-,...]
    verify anchor + 2 drafts whatever the ladder says; the drafts past the window, though
    right, are never verified."""
    nd = 7
    keep = [2, 0, 6, 7, 1]
    raws = lambda r: [3.0] * keep[r % 5] + [-3.0] * (nd - keep[r % 5])  # noqa: E731
    session, _ = oracle_session(world, 1, MAX_NEW, window=VerifyWindow("confidence-slot", 0.5), raws=raws)
    assert session.run() == world.truths[1][:MAX_NEW]
    # windows clamp to [2, cap]: 3, 2, 7, 8, 2 -> m = vt-1 each (22 tokens); then 3 is
    # clipped to the 2 tokens left
    want = simulate(lambda r: nd, MAX_NEW, 8, True, window=lambda r: min(max(1 + keep[r % 5], 2), 8))
    assert want == Expected(rounds=6, accepted=18, drafted=18, hist=Counter({2: 1, 1: 3, 6: 1, 7: 1}))
    check_stats(session, want)


def test_oracle_confidence_window_sized_after_a_fixed_width_verify(world, monkeypatch):
    """With 16-row steps the window is sized after the verify (one host read a round): the same
    stream and the same accounting as sizing it first, which the model of the round predicts; and
    the raws are never read on their own (no `.tolist()` of the raws before the verify)."""
    nd = 7
    keep = [2, 0, 6, 7, 1]
    raws = lambda r: [3.0] * keep[r % 5] + [-3.0] * (nd - keep[r % 5])  # noqa: E731
    want = simulate(lambda r: nd, MAX_NEW, 8, True, window=lambda r: min(max(1 + keep[r % 5], 2), 8))
    truth = greedy_reference(StepRunner(world.target, 16), world.prompts[1], N_TRUTH)
    program = Program(Harvest.DFLASH, VerifyWindow("confidence-slot", 0.5), False, nd + 1, True, 8)
    runs = {}
    for late in (True, False):
        with monkeypatch.context() as mp:
            if not late:
                mp.setattr(Session, "_sizes_after_verify", lambda self: False)
            else:
                mp.setattr(Session, "_window", lambda self, proposal: pytest.fail("raws read before verify"))
            oracle = OracleProposer(truth, len(world.prompts[1]), nd, world.target.device, (), raws)
            session = Session(StepRunner(world.target, 16), world.prompts[1], MAX_NEW, proposer=oracle,
                              program=program, taps=ORACLE_TAPS, eos_ids=())
            assert session.late_window == late
            runs[late] = session.run()
            check_stats(session, want)
    assert runs[True] == runs[False] == truth[:MAX_NEW]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_oracle_accounting_matches_the_model(world, data):
    block = data.draw(st.sampled_from([4, 8, 16]), "block")
    harvest = data.draw(st.sampled_from(list(Harvest)), "harvest")
    nd = harvest.n_drafts(block)
    cap = data.draw(st.integers(2, nd + 1), "cap")
    adapt = data.draw(st.booleans(), "adapt")
    max_new = data.draw(st.integers(0, 30), "max_new")
    pi = data.draw(st.integers(0, len(PROMPT_LENS) - 1), "prompt")
    schedule = data.draw(st.lists(st.sets(st.integers(0, nd - 1), max_size=3), max_size=12), "wrong")
    kind = data.draw(st.sampled_from(["ladder", "confidence", "confidence-slot"]), "window")
    keeps = data.draw(st.lists(st.integers(0, nd), min_size=1, max_size=8), "keeps")

    def wrong(r):
        return schedule[r] if r < len(schedule) else set()

    def first_wrong(r):
        return min(wrong(r), default=nd)

    window, raws, sizes = LADDER, None, None
    if kind != "ladder":
        window = VerifyWindow(kind, 0.5)
        raws = lambda r: [4.0] * keeps[r % len(keeps)] + [-4.0] * (nd - keeps[r % len(keeps)])  # noqa: E731
        sizes = lambda r: min(max(1 + keeps[r % len(keeps)], 2), cap)  # noqa: E731
    session, oracle = oracle_session(world, pi, max_new, wrong, block=block, harvest=harvest, cap=cap,
                                     adapt=adapt, window=window, raws=raws)
    out = session.run()
    assert out == world.truths[pi][:max_new]
    check_stats(session, simulate(first_wrong, max_new, cap, adapt if kind == "ladder" else True, sizes))
    assert session.finished
    if max_new:  # (run() with max_new=0 never primes: position stays 0)
        assert session.position == len(world.prompts[pi]) + max_new


# --------------------------------------------------------------------------- stops


def first_occurrences(truth: Sequence[int], limit: int) -> dict[int, int]:
    """index -> token for tokens whose first occurrence in truth[:limit] is at that index."""
    seen, out = set(), {}
    for i, tok in enumerate(truth[:limit]):
        if tok not in seen:
            out[i] = tok
        seen.add(tok)
    return out


def pick_eos(world: World, want: Callable[[int], bool]) -> tuple[int, int, int]:
    """(prompt index, stream index j, eos token) with truth[j] first seen at j and want(j)."""
    for pi, truth in enumerate(world.truths):
        for j, tok in first_occurrences(truth, 40).items():
            if want(j):
                return pi, j, tok
    raise AssertionError("no suitable EOS candidate in the greedy streams (change the seed)")


@pytest.mark.parametrize("where", ["inside-block", "last-draft", "anchor", "first-token"])
def test_eos_stops_right_after_it(world, where):
    """Full acceptance at b=8: round r commits stream[8r .. 8r+7] (anchor 8r, drafts after).
    An EOS among the accepted drafts ends the stream right after it even though the target
    accepted more."""
    rule = {
        "inside-block": lambda j: j >= 8 and j % 8 in (2, 3, 4, 5),
        "last-draft": lambda j: j % 8 == 7,
        "anchor": lambda j: j >= 8 and j % 8 == 0,
        "first-token": lambda j: j == 0,
    }[where]
    pi, j, eos = pick_eos(world, rule)
    max_new = 40
    want = greedy_reference(world.target, world.prompts[pi], max_new, eos_ids=[eos])
    assert want == world.truths[pi][: j + 1] and want[-1] == eos
    session, _ = oracle_session(world, pi, max_new, eos=[eos])
    assert session.run() == want
    assert session.finished and session.stats.tokens == j + 1
    r = j // 8
    check_stats(session, Expected(rounds=r + 1, accepted=7 * (r + 1), drafted=7 * (r + 1), hist=Counter({7: r + 1})))
    # After an EOS stop `position` is the target rows the last round kept (its whole accepted
    # run), not prompt + emitted tokens: the tokens after EOS were verified, never emitted.
    assert session.position == len(world.prompts[pi]) + 8 * (r + 1) >= len(world.prompts[pi]) + len(session.tokens)
    assert session.burst(5) == [] and session.stats.rounds == r + 1


def test_eos_as_anchor_with_zero_acceptance(world):
    """With nothing accepted every token is an anchor; one of several EOS ids ends the stream."""
    pi, j, eos = pick_eos(world, lambda j: 3 <= j < 20)
    session, _ = oracle_session(world, pi, 40, lambda r: {0}, eos=[eos, 9999])
    assert session.run() == world.truths[pi][: j + 1]
    assert session.stats.rounds == j + 1 and session.position == len(world.prompts[pi]) + j + 1


@pytest.mark.parametrize("max_new,rounds,hist", [(13, 2, {7: 1, 4: 1}), (8, 1, {7: 1}), (9, 2, {7: 1, 0: 1}),
                                                 (1, 1, {0: 1}), (0, 0, {})])
def test_budget_is_exact(world, max_new, rounds, hist):
    """max_new landing mid-block yields exactly max_new tokens; the last round's verify window
    is clipped to the budget (never verifies what it could not commit)."""
    session, oracle = oracle_session(world, 1, max_new)
    assert session.finished == (max_new == 0)
    assert session.run() == world.truths[1][:max_new]
    assert len(session.tokens) == max_new and session.finished
    drafted = sum(m * n for m, n in hist.items())
    check_stats(session, Expected(rounds=rounds, accepted=drafted, drafted=drafted, hist=Counter(hist)))
    if max_new:
        assert session.position == len(world.prompts[1]) + max_new
    assert greedy_reference(world.target, world.prompts[1], max_new) == world.truths[1][:max_new]


def test_max_new_zero_and_one_with_a_real_drafter(world, ckpts):
    for max_new in (0, 1):
        _, session = spec_session(world.target, world.prompts[0], max_new, draft=ckpts["spark8"], mode="dspark",
                                  eos_ids=())
        assert session.burst(3) == world.truths[0][:max_new]
        assert session.finished and session.run() == world.truths[0][:max_new]
        assert session.stats.rounds == max_new


# --------------------------------------------------------------------------- bursts


def test_bursts_concatenate_to_the_run_stream(world, ckpts):
    def fresh() -> Session:
        return spec_session(world.target, world.prompts[2], 40, draft=ckpts["spark8"], mode="dspark",
                            settings=PolicySettings(vt="ladder"), eos_ids=())[1]

    whole = fresh().run()
    assert whole == world.truths[2][:40]
    session = fresh()
    p = len(world.prompts[2])
    assert session.burst(0) == [] and session.position == p and not session.finished  # primes only
    pieces, sizes = [], [1, 2, 3, 5, 8, 13]
    k = 0
    while not session.finished:
        n = sizes[k % len(sizes)]
        k += 1
        out = session.burst(n)
        pieces.append(out)
        assert len(out) >= n or session.finished
        assert len(out) <= n - 1 + 9, "a burst overshoots by at most one round (anchor + 8 drafts)"
        assert session.tokens == sum(pieces, [])
        assert session.stats.tokens == len(session.tokens)
        assert session.position == p + len(session.tokens), "rows in the target cache = committed stream"
    assert sum(pieces, []) == whole
    rounds = session.stats.rounds
    assert session.burst(4) == [] and session.run() == whole and session.stats.rounds == rounds


def test_bursts_with_the_oracle_and_eos(world):
    pi, j, eos = pick_eos(world, lambda j: j >= 10 and j % 8 in (2, 3, 4, 5))
    session, oracle = oracle_session(world, pi, 40, PARTIAL, eos=[eos])
    got = []
    while not session.finished:
        assert oracle.released == 0  # not while the stream goes on
        got += session.burst(2)
    assert got == world.truths[pi][: j + 1] == session.tokens
    assert oracle.released == 1  # the stream ended at EOS: the proposer let go of its cache, once
    session.burst(2)
    assert oracle.released == 1


# --------------------------------------------------------------------------- the real drafter


def planted_tensors(world: World, rng: torch.Generator, drop: float = 0.25) -> tuple[dict, set[int]]:
    """A rank-V markov head that knows the target's bigrams: w1 = I, w2[v, u] = 30 when the
    stream goes u -> v (the last such v when streams disagree; a quarter dropped). The
    confidence head scores +3 / -3 on whether the previous token has a planted successor."""
    succ = {}
    for prompt, truth in zip(world.prompts, world.truths):
        seq = prompt[-1:] + truth
        succ.update(zip(seq, seq[1:]))
    keep = {u: v for u, v in succ.items() if torch.rand(1, generator=rng).item() >= drop}
    w2 = torch.zeros(VOCAB, VOCAB)
    for u, v in keep.items():
        w2[v, u] = 30.0
    conf = torch.cat([torch.randn(HIDDEN, generator=rng) * 0.02, torch.full((VOCAB,), -3.0)])
    conf[HIDDEN + torch.tensor(sorted(keep))] = 3.0
    return {
        "markov_head.markov_w1.weight": torch.eye(VOCAB),
        "markov_head.markov_w2.weight": w2,
        "confidence_head.proj.weight": conf[None, :],
        "confidence_head.proj.bias": torch.zeros(1),
    }, set(keep)


@pytest.fixture(scope="module")
def ckpts(world) -> dict[str, Path]:
    root, rng = world.root / "drafts", torch.Generator().manual_seed(7)
    out = {}
    for b in (4, 8, 16):
        out[f"zlab{b}"] = make_tiny_draft(root / f"zlab{b}", "zlab", block_size=b, seed=b)
        planted, _ = planted_tensors(world, rng)
        out[f"spark{b}"] = make_tiny_draft(root / f"spark{b}", "deepspec", block_size=b, seed=100 + b,
                                           markov_rank=VOCAB, confidence="markov", extra_tensors=planted)
    out["nested8-plainconf"] = make_tiny_draft(root / "nested8", "nested", block_size=8, seed=3,
                                               markov_rank=8, confidence="plain")
    out["zlab8-tap-sliding"] = make_tiny_draft(root / "zts", "zlab", block_size=8, seed=4,
                                               target_layer_ids=(-1, 1, 3), sliding_window=6,
                                               layer_types=("sliding_attention", "full_attention"))
    return out


@dataclass(frozen=True)
class Case:
    ckpt: str
    mode: str
    settings: dict
    markov: bool | None
    cap: int | None
    want: tuple  # (harvest, window kind, markov on, verify cap, adapt)


CASES = {
    # --spec dflash: parallel drafting (markov off), ladder window
    "dflash-zlab4": Case("zlab4", "dflash", {}, None, None, ("dflash", "ladder", False, 4, True)),
    "dflash-zlab8-hdspark-cap4-fixed": Case("zlab8", "dflash", {"harvest": "dspark", "adapt": "0"}, None, 4,
                                            ("dspark", "ladder", False, 4, False)),
    "dflash-zlab16": Case("zlab16", "dflash", {}, None, None, ("dflash", "ladder", False, 16, True)),
    "dflash-spark8": Case("spark8", "dflash", {}, None, None, ("dspark", "ladder", False, 9, True)),
    "dflash-spark16-hdflash-cap6": Case("spark16", "dflash", {"harvest": "dflash", "adapt": "1"}, None, 6,
                                        ("dflash", "ladder", False, 6, True)),
    "dflash-tap-sliding": Case("zlab8-tap-sliding", "dflash", {}, None, None, ("dflash", "ladder", False, 8, True)),
    "auto-zlab8": Case("zlab8", "auto", {}, None, None, ("dflash", "ladder", False, 8, True)),
    # --spec dspark: the census-keyed program
    "dspark-spark4-defaults": Case("spark4", "dspark", {}, None, None, ("dspark", "confidence-slot", True, 5, True)),
    "dspark-spark8-ladder": Case("spark8", "dspark", {"vt": "ladder"}, True, None, ("dspark", "ladder", True, 9, True)),
    "dspark-spark8-conf-tau03": Case("spark8", "dspark", {"vt": "confidence", "tau": "0.3"}, None, None,
                                     ("dspark", "confidence", True, 9, True)),
    "dspark-spark8-slot-hdflash-nomarkov": Case("spark8", "dspark", {"vt": "confidence-slot", "harvest": "dflash"},
                                                False, None, ("dflash", "confidence-slot", False, 8, True)),
    "dspark-spark16-fixed-cap9": Case("spark16", "dspark", {"adapt": "0"}, None, 9,
                                      ("dspark", "ladder", True, 9, False)),
    "dspark-spark16-conf-hdflash-cap5": Case("spark16", "dspark", {"vt": "confidence", "harvest": "dflash"}, None, 5,
                                             ("dflash", "confidence", True, 5, True)),
    "dspark-plainconf-slot-tau07": Case("nested8-plainconf", "dspark", {"vt": "confidence-slot", "tau": "0.7"}, None,
                                        None, ("dspark", "confidence-slot", True, 9, True)),
    "dspark-plainconf-ladder-cap2": Case("nested8-plainconf", "dspark", {"vt": "ladder"}, False, 2,
                                         ("dspark", "ladder", False, 2, True)),
    "dspark-zlab8-hdspark": Case("zlab8", "dspark", {"harvest": "dspark"}, None, None,
                                 ("dspark", "ladder", False, 9, True)),
    "dspark-tap-sliding-cap3": Case("zlab8-tap-sliding", "dspark", {}, None, 3, ("dflash", "ladder", False, 3, True)),
    "auto-spark4-nomarkov-fixed": Case("spark4", "auto", {"adapt": "0"}, False, None,
                                       ("dspark", "ladder", False, 5, False)),
}


def spec_session(target, prompt, max_new: int, *, draft: Path | None, mode: str,
                 settings: PolicySettings = PolicySettings(), markov: bool | None = None,
                 verify_cap: str | int | None = None, eos_ids=None) -> tuple[Arm, Session]:
    """An engine around `target` (variable-width steps, as the loaded target runs), an arm
    resolved and loaded for the request, and an unprimed session of it (eos None: the target
    config's). The arm refuses program and pair first, then loads; the session checks the prompt."""
    engine = Engine.from_model(target)
    arm = engine.arm(ArmConfig(draft=draft, mode=mode, settings=settings, markov=markov, verify_cap=verify_cap))
    return arm, engine.session(prompt, max_new, arm, eos_ids=eos_ids)


def prepared(world: World, ckpts, case: Case, pi: int, max_new: int = MAX_NEW, target=None,
             eos=()) -> tuple[Arm, Session]:
    return spec_session(target or world.target, world.prompts[pi], max_new, draft=ckpts[case.ckpt], mode=case.mode,
                        settings=PolicySettings(**case.settings), markov=case.markov, verify_cap=case.cap, eos_ids=eos)


@pytest.mark.parametrize("name", list(CASES))
def test_real_drafter_stream_is_greedy(world, ckpts, name):
    case = CASES[name]
    totals = Counter()
    for pi in range(len(PROMPT_LENS)):
        arm, session = prepared(world, ckpts, case, pi)
        p = session.program
        assert p is arm.program
        assert (p.harvest.value, p.window.kind, p.markov, p.verify_cap, p.adapt) == case.want, name
        assert arm.mode in ("dflash", "dspark") and arm.receipts is not None
        out = session.run()
        assert out == world.truths[pi][:MAX_NEW], f"{name}, prompt {pi}: diverged from plain greedy"
        s = session.stats
        assert s.accepted + s.rounds == MAX_NEW == s.tokens  # every round commits m + 1
        assert session.position == PROMPT_LENS[pi] + MAX_NEW
        totals.update(accepted=s.accepted, drafted=s.drafted, rounds=s.rounds,
                      partial=sum(n for m, n in s.accept_hist.items() if 0 < m))
    if case.ckpt.startswith("spark") and case.want[2]:
        # the planted markov head is sometimes right and sometimes wrong: partial acceptance
        assert 0 < totals["accepted"] < totals["drafted"], totals
        assert totals["partial"] > 0 and totals["rounds"] > 3, totals


def test_eos_with_the_real_drafter(world, ckpts):
    pi, j, eos = pick_eos(world, lambda j: 6 <= j < 20)
    want = greedy_reference(world.target, world.prompts[pi], 40, eos_ids=[eos])
    for name in ("dspark-spark8-ladder", "dspark-spark4-defaults", "dflash-zlab8-hdspark-cap4-fixed"):
        assert prepared(world, ckpts, CASES[name], pi, 40, eos=[eos])[1].run() == want, name
    # Engine.session's default: the target config's eos (508 = <|endoftext|>), as greedy_reference
    eos_cfg = world.target.cfg.eos_token_ids
    for pi in range(len(PROMPT_LENS)):
        _, session = spec_session(world.target, world.prompts[pi], 40, draft=ckpts["spark8"], mode="dspark")
        assert session.run() == greedy_reference(world.target, world.prompts[pi], 40, eos_ids=eos_cfg)


def reference_proposal(drafter: Drafter, target: Qwen3Target, taps, last: int, start: int, program: Program):
    """What one round should propose, from forward_full and plain loops."""
    b, first, nd = program.block_size, program.harvest.first_row, program.n_drafts
    noise = target.embed(torch.tensor([last] + [drafter.cfg.mask_token_id] * (b - 1)))
    hidden = drafter.forward_full(taps, noise, torch.arange(start + b)).hidden_out
    rows = hidden[first:first + nd]
    logits = target.logits(rows).double()
    chain, prev = [], last
    for k in range(nd):
        scores = logits[k]
        if program.markov:
            scores = scores + drafter.markov_w2.double() @ drafter.markov_w1.double()[prev]
        prev = int(torch.argmax(scores))
        chain.append(prev)
    prev_ids = torch.tensor([last] + chain[:-1])
    feats = rows.double()
    if drafter.census.confidence.with_markov:
        feats = torch.cat([feats, drafter.markov_w1.double()[prev_ids]], -1)
    return chain, feats @ drafter.conf_w.double()[0] + drafter.conf_b.double()[0]


@pytest.mark.parametrize("name,prompt_len", [
    ("dspark-spark8-conf-tau03", 12), ("dspark-spark8-slot-hdflash-nomarkov", 12),
    ("dspark-plainconf-slot-tau07", 12), ("dspark-spark16-conf-hdflash-cap5", 12),
    ("dspark-spark8-conf-tau03", 300),
])
def test_drafter_proposer_is_its_definition(world, ckpts, name, prompt_len):
    """One proposal after prime: drafts = harvested rows -> target lm_head -> (markov) argmax
    chain, raws = confidence head with prev ids [anchor, chain[:-1]]. A 300-token prompt is
    ingested in PRIME_CHUNK (256) windows."""
    case = CASES[name]
    census = take_census(ckpts[case.ckpt])
    program, _, _ = resolve_program(case.mode, census, PolicySettings(**case.settings), case.markov, case.cap)
    drafter = Drafter.load(ckpts[case.ckpt], census=census)
    proposer = DrafterProposer(drafter, world.target, program)
    prompt = world.prompts[1]
    if prompt_len != len(prompt):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(300)).tolist()
    runner = StepRunner(world.target)
    cache = runner.new_state(prompt_len + 1)
    logits, taps = runner.prefill(torch.tensor(prompt), cache, census.config.target_layer_ids)
    last = torch.argmax(logits, dim=-1)
    proposer.reset(prompt_len + 1)
    proposer.ingest(taps, torch.arange(len(prompt)))
    got = proposer.propose(last, len(prompt), True)
    chain, raws = reference_proposal(drafter, world.target, taps, int(last), len(prompt), program)
    assert got.drafts.tolist() == chain
    assert got.raws.shape == raws.shape and (got.raws.double() - raws).abs().max() < 1e-4
    # no raws unless asked
    assert proposer.propose(last, len(prompt), False).raws is None


def test_session_that_fills_max_position_embeddings(world, ckpts, tmp_path):
    """prompt + max_new == max_position_embeddings: the verify window never reaches past it."""
    short = Qwen3Target.from_dir(make_tiny_qwen3(tmp_path / "short", max_position_embeddings=40))  # same weights
    max_new = 40 - PROMPT_LENS[2]
    for name in ("dspark-spark16-fixed-cap9", "dflash-zlab16"):
        _, session = prepared(world, ckpts, CASES[name], 2, max_new, target=short)
        assert session.run() == world.truths[2][:max_new] == greedy_reference(short, world.prompts[2], max_new)
        assert session.position == 40


def test_arm_sessions_reused_one_after_another(world, ckpts):
    """One arm (one loaded drafter) serves sessions one after another: none may see another's
    draft context (prime re-makes it) -- same stats as a session of a freshly loaded arm."""
    case = CASES["dspark-spark8-conf-tau03"]
    engine = Engine.from_model(world.target)
    arm = engine.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings)))
    for pi in (2, 0, 1):
        session = engine.session(world.prompts[pi], MAX_NEW, arm, eos_ids=())
        assert session.run() == world.truths[pi][:MAX_NEW]
        _, fresh = prepared(world, ckpts, case, pi)
        fresh.run()
        assert session.stats.accept_hist == fresh.stats.accept_hist


# --------------------------------------------------------------------------- refusals


def test_refusals(world, ckpts, tmp_path):
    t, prompt, s0 = world.target, world.prompts[0], PolicySettings()

    def prep(path, mode="dflash", settings=s0, markov=None):
        return spec_session(t, prompt, 8, draft=path, mode=mode, settings=settings, markov=markov)

    narrow = make_tiny_draft(tmp_path / "h32", "zlab", hidden=32)
    with pytest.raises(ConfigError, match=r"hidden_size 32 .* != target hidden_size 64"):
        prep(narrow)
    big_mask = make_tiny_draft(tmp_path / "mask", "zlab", vocab=1024, mask_token_id=700)
    with pytest.raises(ConfigError, match=r"mask_token_id 700 .*outside the target vocabulary \[0, 512\)"):
        prep(big_mask)
    deep_tap = make_tiny_draft(tmp_path / "tap", "zlab", target_layer_ids=(0, 5), num_target_layers=8)
    with pytest.raises(ConfigError, match=r"target_layer_id 5 .*4-layer target"):
        prep(deep_tap)
    with pytest.raises(PolicyError, match=r"--spec dspark needs a drafter"):
        spec_session(t, prompt, 8, draft=None, mode="dspark", settings=s0)
    with pytest.raises(SpecError, match=r"Confidence\{tau=0.5\}.*confidence_head"):
        prep(ckpts["zlab8"], "dspark", PolicySettings(vt="confidence"))
    with pytest.raises(PolicyError, match=r"vt='confidence-slot' with spec='dflash': .*use spec='dspark'"):
        prep(ckpts["spark8"], "dflash", PolicySettings(vt="confidence-slot"))
    with pytest.raises(PolicyError, match=r"markov=True: .*zlab8 has no markov head"):
        prep(ckpts["zlab8"], "dspark", markov=True)
    with pytest.raises(SettingError, match=r"spec=turbo: expected off\|dflash\|dspark\|auto") as e:
        prep(ckpts["zlab8"], "turbo")
    assert e.value.flag_message("--spec") == "--spec turbo: expected off|dflash|dspark|auto"
    # the proposer itself refuses a confidence program without a head
    program = Program(Harvest.DFLASH, VerifyWindow("confidence-slot", 0.5), False, 8, True, 8)
    with pytest.raises(SpecError, match="ConfidenceSlot"):
        DrafterProposer(Drafter.load(ckpts["zlab8"]), t, program)
    for exc in (ConfigError, PolicyError, SpecError, SettingError):
        assert issubclass(exc, MemraError)
    # not refusals: auto without a drafter is plain greedy; auto on a head-less dspark is fine
    arm, plain = spec_session(t, prompt, 8, draft=None, mode="auto", settings=s0, eos_ids=())
    assert arm.mode == "off" and plain.proposer is None and plain.run() == world.truths[0][:8]
    assert plain.stats.rounds == 8


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_matrix_is_exact(world, ckpts):
    target = Qwen3Target.from_dir(world.target_dir, torch.float32, "cuda")
    truths = [greedy_reference(target, p, N_TRUTH) for p in world.prompts]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), N_TRUTH) for x, y in zip(truths, world.truths)]
    print(f"\n[cuda f32] greedy agreement with the CPU stream (common prefix of {N_TRUTH}): {agree}")
    for name in ("dflash-zlab16", "dspark-spark8-conf-tau03", "dspark-tap-sliding-cap3", "dspark-spark4-defaults"):
        for pi in (0, 2):
            _, session = prepared(world, ckpts, CASES[name], pi, target=target)
            assert session.run() == truths[pi][:MAX_NEW], (name, pi)
    session, _ = oracle_session(world, 2, MAX_NEW, PARTIAL, target=target, truth=truths[2])
    assert session.run() == truths[2][:MAX_NEW]
    check_stats(session, Expected(rounds=8, accepted=16, drafted=27, hist=Counter({3: 3, 2: 3, 0: 1, 1: 1})))


def test_interleaved_sessions_from_one_arm_do_not_share_a_draft_cache(tmp_path):
    """Two live sessions of one arm, bursts alternating: each keeps its own draft context."""
    target = Qwen3Target.from_dir(make_tiny_qwen3(tmp_path / "t"))
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=8, confidence="markov", target_layer_ids=(-1, 1, 3))
    engine = Engine.from_model(target)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark", settings=PolicySettings()))
    long_p, short_p = list(range(3, 33)), [7, 8, 9, 10, 11]
    a, b = engine.session(long_p, 30, arm), engine.session(short_p, 30, arm)
    while not (a.finished and b.finished):
        a.burst(3)
        b.burst(3)
    eos = target.cfg.eos_token_ids
    assert a.tokens == greedy_reference(target, long_p, 30, eos)
    assert b.tokens == greedy_reference(target, short_p, 30, eos)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.want[1] != "ladder"])
def test_real_confidence_rounds_sized_after_verify_match_sizing_first(world, ckpts, name, monkeypatch):
    """The real drafters' confidence programs at 16-row steps: sizing the window after the
    verify gives the stream, rounds, drafted and accepted counts of sizing it first."""
    case = CASES[name]
    engine = Engine.from_model(world.target, step_width=16)
    arm = engine.arm(ArmConfig(draft=ckpts[case.ckpt], mode=case.mode, settings=PolicySettings(**case.settings),
                               markov=case.markov, verify_cap=case.cap))
    for pi in range(len(PROMPT_LENS)):
        late = engine.session(world.prompts[pi], MAX_NEW, arm, eos_ids=())
        assert late.late_window == (arm.program.verify_cap <= 16)
        out = late.run()
        with monkeypatch.context() as mp:
            mp.setattr(Session, "_sizes_after_verify", lambda self: False)
            early = engine.session(world.prompts[pi], MAX_NEW, arm, eos_ids=())
            assert early.run() == out, (name, pi)
        a, b = late.stats, early.stats
        assert (a.rounds, a.drafted, a.accepted, +a.accept_hist) == (b.rounds, b.drafted, b.accepted, +b.accept_hist)
