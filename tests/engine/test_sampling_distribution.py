"""Losslessness in distribution, tested exactly: the first three tokens of speculative sampling
follow the target's processed distribution, and deliberately lossy rules fail the same test.

What is tested, and how:

- A tiny Qwen3 target with a 16-token vocabulary, run through the real `StepRunner` at width 16.
  Its logits are tabulated for every prefix the first three tokens can have (the prompt's last
  row, 16 one-token and 256 two-token continuations), so the exact distribution of (t1, t2, t3)
  is the product of the processed conditionals: 4096 cells, computed in float64.
- Speculative samples: for each program, 20,000 fixed seeds (a disjoint range per program). The
  position-keyed sampler's selections are computed for all seeds at once with the real
  `process_logits` and `keyed_gumbel` (seed keys as a batch), and the round is played out per
  seed with the real `accept_prefix`, the real window policies (ladder, confidence-slot sized
  from raws, fixed) and the budget clip, exactly as `Session._round` does; drafts come from a
  deterministic table proposer (the target's own greedy chain: the drafts most likely to be
  accepted, so any bias in accepting them shows) and confidence raws from a hash of the prefix.
- The round play-out is tied to the real thing seed by seed: for 200 seeds per program a real
  `Session` (real engine, real `PositionKeyed` sampler, the same table proposer) yields the same
  three tokens.
- The test is a G-test over the cells (cells expected below 5 pooled), at significance 1e-3:
  the position-keyed rule must pass (p > 1e-3) for every program; with fixed seeds the outcome
  is deterministic. Two lossy rules must fail it (p < 1e-3): a sampler that reuses one noise
  vector at every position, and the argmax-draft + p/q acceptance test (accept an argmax draft
  with probability min(1, p/q) where q is the drafter's softmax, resample the residual).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from memra_cli.engine.api import Engine
from memra_cli.engine.models.state import StateBase
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.spec.keyed import (
    PositionKeyed, SamplingParams, keyed_bits, keyed_gumbel, process_logits, processed_probs, seed_keys,
)
from memra_cli.engine.spec.policy import LADDER, Harvest, VerifyWindow, ladder_next
from memra_cli.engine.spec.proposer import Program, Proposal
from memra_cli.engine.spec.sampling import accept_prefix
from memra_cli.engine.spec.session import Session
from memra_cli.tiny.target import make_tiny_qwen3

V = 16
PROMPT = [3, 7, 1, 9, 4]
N = len(PROMPT)
S = 20_000  # speculative samples per program
ALPHA = 1e-3  # the test's significance level
CROSS_CHECK = 100  # seeds per program replayed through a real Session
FILLER = 0  # a draft past the tabulated depth (never decides a committed token)


@dataclass
class Table:
    runner: object
    L0: torch.Tensor  # [V] logits of the prompt's last row (position N-1)
    L1: torch.Tensor  # [V, V] row for prefix (x,) at position N
    L2: torch.Tensor  # [V, V, V] row for prefix (x, y) at position N+1

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return (self.L0, self.L1[prefix[0]] if prefix else None, self.L2[prefix[:2]] if len(prefix) == 2 else None)[
            len(prefix)] if len(prefix) < 3 else None

    def greedy_drafts(self, prefix: tuple[int, ...], nd: int) -> list[int]:
        """The target's own greedy chain after `prefix` (filler past the table)."""
        out, p = [], tuple(prefix)
        for _ in range(nd):
            lg = self.logits(p) if len(p) < 3 else None
            tok = int(torch.argmax(lg)) if lg is not None else FILLER
            out.append(tok)
            p = p + (tok,)
        return out


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Table:
    target = Qwen3Target.from_dir(make_tiny_qwen3(tmp_path_factory.mktemp("v16") / "t", vocab=V, seed=5))
    runner = Engine.from_model(target, step_width=16).runner
    state = runner.new_state(N + 8)
    L0, _ = runner.prefill(torch.tensor(PROMPT), state)
    L1, L2 = torch.empty(V, V), torch.empty(V, V, V)
    for x in range(V):
        for y in range(V):
            rows, _ = runner.step(torch.tensor([x, y]), N, state)
            state.rollback(N)
            L1[x], L2[x, y] = rows[0], rows[1]  # row 0 is the same for every y (fixed-width steps)
    return Table(runner, L0[0], L1, L2)


def exact_distribution(t: Table, params: SamplingParams) -> torch.Tensor:
    """P[x, y, z] = p0(x) p1(y | x) p2(z | x, y) under the processed target distribution."""
    p0 = processed_probs(t.L0[None], params)[0]
    p1 = processed_probs(t.L1, params)  # [V, V]
    p2 = processed_probs(t.L2.reshape(V * V, V), params).reshape(V, V, V)
    return p0[:, None, None] * p1[:, :, None] * p2


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a G-test of `counts` against `probs`; cells expected below 5 pooled."""
    n = counts.sum().double()
    e, o = (probs.flatten() * n), counts.flatten().double()
    small = e < 5
    e = torch.cat([e[~small], e[small].sum().reshape(1)])
    o = torch.cat([o[~small], o[small].sum().reshape(1)])
    if e[-1] == 0:  # nothing pooled
        e, o = e[:-1], o[:-1]
    assert o[e == 0].sum() == 0, "a sample fell in a cell of probability 0"
    g = 2 * torch.sum(torch.where(o > 0, o * torch.log(o / e), torch.zeros_like(o)))
    df = e.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), g / 2))


# --------------------------------------------------------------------------- the programs


@dataclass(frozen=True)
class Prog:
    name: str
    program: Program
    params: SamplingParams
    seed0: int  # seeds seed0 .. seed0 + S - 1


PROGRAMS = [
    Prog("dflash-ladder", Program(Harvest.DFLASH, LADDER, False, 4, True, 4), SamplingParams(temperature=1.0), 0),
    Prog("dspark-confidence-slot", Program(Harvest.DSPARK, VerifyWindow("confidence-slot", 0.5), True, 5, True, 4),
         SamplingParams(temperature=0.7, top_p=0.9), 1_000_000),
    Prog("fixed-cap2", Program(Harvest.DSPARK, LADDER, False, 2, False, 4),
         SamplingParams(temperature=1.5, top_k=10, min_p=0.02), 2_000_000),
]


def raws_for(prefix: tuple[int, ...], nd: int) -> list[float]:
    """Deterministic confidence raws: the first (sum(prefix) mod 3) slots confident."""
    c = sum(prefix) % 3
    return [4.0] * c + [-4.0] * (nd - c)


class TableProposer:
    """A `Proposer` whose drafts are the target's greedy chain after the committed prefix."""

    def __init__(self, table: Table, program: Program):
        self.table, self.program, self.session = table, program, None

    def reset(self, capacity: int) -> None: ...
    def ingest(self, taps, positions) -> None: ...
    def release(self) -> None: ...

    def propose(self, last, start, want_raws) -> Proposal:
        prefix = tuple(self.session.tokens) + (int(last),)
        nd = self.program.n_drafts
        raws = torch.tensor(raws_for(prefix, nd)) if want_raws else None
        return Proposal(torch.tensor(self.table.greedy_drafts(prefix, nd)), raws)


# --------------------------------------------------------------------------- batched selections


def key_batch(seeds: list[int]) -> tuple[torch.Tensor, ...]:
    ks = torch.tensor([seed_keys(s) for s in seeds], dtype=torch.int64)  # [S, 4]
    return tuple(ks[:, i : i + 1] for i in range(4))


def select_batch(rows: torch.Tensor, params: SamplingParams, keys, positions: torch.Tensor) -> torch.Tensor:
    """The position-keyed selection of `rows [S, V]`, row s with seed s's keys: the real
    `process_logits` + `keyed_gumbel`, as `PositionKeyed.select` computes it."""
    return torch.argmax(process_logits(rows, params) + keyed_gumbel(keys, positions, V), dim=-1)


@dataclass
class Selections:
    """Per seed: A0 the token after the prompt; A1 after (A0,); A2[y] after (A0, y), for the two
    y a round can verify there (the greedy draft and A1)."""

    A0: list[int]
    A1: list[int]
    A2: list[dict[int, int]]


def selections(t: Table, params: SamplingParams, seeds: list[int], shared_noise: bool = False) -> Selections:
    keys = key_batch(seeds)
    n = len(seeds)
    pos = lambda j: torch.zeros(n, dtype=torch.long) if shared_noise else torch.full((n,), j)  # noqa: E731
    a0 = select_batch(t.L0.expand(n, V), params, keys, pos(N - 1))
    a1 = select_batch(t.L1[a0], params, keys, pos(N))
    d0 = torch.argmax(t.L1[a0], dim=-1)  # the greedy draft after (A0,)
    a2_d = select_batch(t.L2[a0, d0], params, keys, pos(N + 1))
    a2_a = select_batch(t.L2[a0, a1], params, keys, pos(N + 1))
    A2 = [{int(d): int(x), int(a): int(y)} for d, x, a, y in zip(d0, a2_d, a1, a2_a)]
    return Selections(a0.tolist(), a1.tolist(), A2)


def play_three(t: Table, prog: Program, sel: Selections, s: int, accept=accept_prefix) -> tuple[int, int, int]:
    """Seed s's first three tokens, round by round as `Session._round` plays them (max_new 3)."""
    tokens: list[int] = []
    last, vt_state = sel.A0[s], prog.verify_cap

    def target_selection(prefix: tuple[int, ...]) -> int | None:
        if len(prefix) == 1:
            return sel.A1[s]
        if len(prefix) == 2:
            return sel.A2[s][prefix[1]]
        return None  # stream index 3: only ever the next anchor of a finished stream

    while len(tokens) < 3:
        prefix = tuple(tokens) + (last,)
        drafts = t.greedy_drafts(prefix, prog.n_drafts)
        vt = prog.window.size_window(raws_for(prefix, prog.n_drafts), prog.verify_cap) \
            if prog.window.is_confidence else vt_state
        vt = max(1, min(vt, 3 - len(tokens)))
        cand = [last] + drafts[: vt - 1]
        vam = [target_selection(tuple(tokens) + tuple(cand[: k + 1])) for k in range(vt)]
        m = accept(cand, vam, vt) if vt > 1 else 0
        tokens += cand[: m + 1]
        last = vam[m]
        vt_state = ladder_next(m, prog.verify_cap) if prog.adapt else prog.verify_cap
    assert len(tokens) == 3
    return tuple(tokens)  # type: ignore[return-value]


def counts_of(outcomes) -> torch.Tensor:
    c = torch.zeros(V, V, V, dtype=torch.long)
    for x, y, z in outcomes:
        c[x, y, z] += 1
    return c


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("prog", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_speculative_sampling_is_lossless_in_distribution(table, prog):
    seeds = list(range(prog.seed0, prog.seed0 + S))
    sel = selections(table, prog.params, seeds)
    outcomes = [play_three(table, prog.program, sel, s) for s in range(S)]
    probs = exact_distribution(table, prog.params)
    assert abs(probs.sum().item() - 1) < 1e-9
    p = g_test(counts_of(outcomes), probs)
    print(f"{prog.name}: G-test p = {p:.3g}")
    assert p > ALPHA, f"{prog.name}: G-test p = {p:.2e} <= {ALPHA}"

    # the play-out is the real round, seed by seed (and plain sampling, by the identity)
    engine_runner = table.runner
    for s in range(0, S, S // CROSS_CHECK):
        sampler = PositionKeyed(SamplingParams(**{**prog.params.__dict__, "seed": seeds[s]}))
        proposer = TableProposer(table, prog.program)
        session = Session(engine_runner, PROMPT, 3, proposer=proposer, program=prog.program, taps=(-1,),
                          sampler=sampler)
        proposer.session = session
        assert tuple(session.run()) == outcomes[s], (prog.name, seeds[s])
        if s % (S // 20) == 0:
            assert tuple(Session(engine_runner, PROMPT, 3, sampler=sampler).run()) == outcomes[s]
    # the drafts were accepted often enough for a biased rule to show
    accepted = sum(o[1] == table.greedy_drafts((o[0],), 1)[0] for o in outcomes[:2000])
    assert accepted > 200


def test_one_noise_vector_at_every_position_fails(table):
    """The vLLM-style bug: the same random draw reused across positions. Each token alone is
    still a correct sample; the three together are not."""
    prog = PROGRAMS[0]
    seeds = list(range(prog.seed0, prog.seed0 + S))
    sel = selections(table, prog.params, seeds, shared_noise=True)
    outcomes = [play_three(table, prog.program, sel, s) for s in range(S)]
    probs = exact_distribution(table, prog.params)
    p = g_test(counts_of(outcomes), probs)
    print(f"shared noise: G-test p = {p:.3g}")
    assert p < ALPHA
    # while each position's marginal alone still passes: the bias is in the joint distribution
    first = torch.bincount(torch.tensor([o[0] for o in outcomes]), minlength=V)
    assert g_test(first, probs.sum(dim=(1, 2))) > ALPHA


def test_argmax_drafts_with_a_p_over_q_test_fail(table):
    """The lossy combination: drafts are the drafter's argmax, but accepted with probability
    min(1, p(d)/q(d)) as if sampled from the drafter's softmax q (here the target's logits at
    temperature 0.5: a plausible drafter), the residual max(0, p - q) resampled on rejection.
    Played for all seeds at once, one token per round (the anchor, then a draft or the residual)."""
    prog = PROGRAMS[0]
    params = prog.params
    seeds = list(range(prog.seed0, prog.seed0 + S))
    keys, accept_keys = key_batch(seeds), key_batch([s ^ 0xACCE97 for s in seeds])
    t1 = selections(table, params, seeds).A0
    tokens = [torch.tensor(t1)]
    for level in (1, 2):
        lg = table.L1[tokens[0]] if level == 1 else table.L2[tokens[0], tokens[1]]  # [S, V]
        p, q = processed_probs(lg, params), torch.softmax(lg.double() / 0.5, -1)
        d = torch.argmax(q, dim=-1, keepdim=True)
        j = torch.full((S,), N - 1 + level)
        u = (keyed_bits(accept_keys, j, 1)[:, 0].double() + 0.5) / 2**32
        keep = u < (p.gather(1, d) / q.gather(1, d)).clamp(max=1.0)[:, 0]
        r = (p - q).clamp_min(0)
        resampled = torch.argmax(torch.log(r / r.sum(-1, keepdim=True)) + keyed_gumbel(keys, j, V), dim=-1)
        tokens.append(torch.where(keep, d[:, 0], resampled))
    counts = torch.zeros(V * V * V, dtype=torch.long).index_add_(
        0, tokens[0] * V * V + tokens[1] * V + tokens[2], torch.ones(S, dtype=torch.long)).reshape(V, V, V)
    p_value = g_test(counts, exact_distribution(table, params))
    print(f"argmax draft + p/q test: G-test p = {p_value:.3g}")
    assert p_value < ALPHA, p_value


# --------------------------------------------------------------------------- rejection sampling


class TableState(StateBase):
    """The KV state of `TableRunner`: the ids at each position (no capability: `StateBase`)."""

    def __init__(self):
        self.ids: list[int] = []
        self.graphs: dict = {}

    @property
    def length(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.ids = []

    def rollback(self, n: int) -> None:
        del self.ids[n:]


class TableRunner:
    """A `StepRunner` that looks the target's logits up in the table (every row's logits are the
    real target's, tabulated by prefix) instead of running it: a session's round costs only the
    sampler's and the round's own work, so 20,000 real `Session`s run in seconds."""

    width = None  # variable-width steps, as a runner declares

    def __init__(self, table: Table, target):
        self.table, self.model = table, target

    def check_prompt(self, prompt, max_new) -> None: ...
    def new_state(self, max_len: int) -> TableState:
        return TableState()
    def release(self, state) -> None: ...

    def _rows(self, state: TableState, n: int) -> torch.Tensor:
        zeros = torch.zeros(V)
        rows = []
        for end in range(state.length - n + 1, state.length + 1):
            stream = tuple(state.ids[N:end])
            rows.append(self.table.logits(stream) if len(stream) < 3 else zeros)
        return torch.stack(rows)

    def prefill(self, ids, state, taps=None, on_taps=None):
        state.ids = ids.tolist()
        tapped = torch.zeros(len(state.ids), 1)
        if on_taps is not None:  # the runner's contract: taps go to the callback, not back
            on_taps(tapped, 0)
            tapped = None
        return self._rows(state, 1), tapped

    def step(self, ids, start, state, taps=None):
        del state.ids[start:]
        state.ids += ids.tolist()
        return self._rows(state, ids.shape[0]), torch.zeros(ids.shape[0], 1)


def drafter_logits(t: Table, prefix: tuple[int, ...]) -> torch.Tensor:
    """The drafter of the rejection tests: sharper than the target (its logits x 1.6), blind past
    the table."""
    lg = t.logits(prefix) if len(prefix) < 3 else None
    return torch.zeros(V) if lg is None else lg * 1.6


class SampledTableProposer(TableProposer):
    """Drafts from the sampler's `drafting` (q = the processed drafter distribution, chained on
    the drafter's own previous drafts), with its q; raws either from the prefix (`raws_for`) or,
    for the lossy control, from the judged draft itself."""

    def __init__(self, table: Table, program: Program, raws_see_the_draft: bool = False):
        super().__init__(table, program)
        self.raws_see_the_draft = raws_see_the_draft

    def propose(self, last, start, want_raws) -> Proposal:
        prefix = tuple(self.session.tokens) + (int(last),)
        nd = self.program.n_drafts
        drafting = self.session.sampler.drafting(start + torch.arange(nd), V)
        drafts: list[int] = []
        for k in range(nd):
            drafts.append(int(drafting.pick(k, drafter_logits(self.table, prefix + tuple(drafts))[None])))
        raws = None
        if want_raws:
            if self.raws_see_the_draft:  # slot k judged only when its draft is the drafter's argmax: lossy
                greedy = [int(torch.argmax(drafter_logits(self.table, prefix + tuple(drafts[:k])))) for k in range(nd)]
                raws = torch.tensor([4.0 if d == g else -4.0 for d, g in zip(drafts, greedy)])
            else:
                raws = torch.tensor(raws_for(prefix, nd))
        return Proposal(torch.tensor(drafts), raws, drafting.probs)


def rejection_outcomes(t: Table, prog: Prog, seeds, raws_see_the_draft: bool = False):
    from memra_cli.engine.spec.keyed import RejectionSampling

    runner = TableRunner(t, t.runner.model)
    out, accepted = [], 0
    for seed in seeds:
        sampler = RejectionSampling(SamplingParams(**{**prog.params.__dict__, "seed": seed, "acceptance": "rejection"}))
        proposer = SampledTableProposer(t, prog.program, raws_see_the_draft)
        session = Session(runner, PROMPT, 3, proposer=proposer, program=prog.program, taps=(-1,), sampler=sampler)
        proposer.session = session
        out.append(tuple(session.run()))
        accepted += session.stats.accepted
    return out, accepted


RS_PROGRAMS = [PROGRAMS[0], PROGRAMS[1]]  # the ladder, and a confidence window (raws from the prefix)
S_RS = 3_000  # real Sessions per program (~3 ms each on a CPU; a one-off run at 20,000: docs/sampling.md)


@pytest.mark.parametrize("prog", RS_PROGRAMS, ids=[p.name for p in RS_PROGRAMS])
def test_rejection_sampling_is_lossless_in_distribution(table, prog):
    """Real `Session`s with the real `RejectionSampling` (drafting, q, verify), over the
    tabulated target: `S_RS` seeds per program."""
    outcomes, accepted = rejection_outcomes(table, prog, range(prog.seed0 + 500_000, prog.seed0 + 500_000 + S_RS))
    p = g_test(counts_of(outcomes), exact_distribution(table, prog.params))
    print(f"rejection {prog.name}: G-test p = {p:.3g}, accepted drafts {accepted}")
    assert p > ALPHA
    assert accepted > S_RS // 4  # drafts were kept often: a biased acceptance would show


def test_rejection_sampling_with_a_window_that_reads_the_judged_draft_fails(table):
    """The subtlety rejection sampling carries: the verify window must not depend on the draft
    it judges. Raws that open slot k only when its draft is the drafter's argmax make the drafts
    that get judged argmax-biased, and the same test fails (on half the samples: the bias is large)."""
    prog = RS_PROGRAMS[1]
    outcomes, _ = rejection_outcomes(table, prog, range(prog.seed0 + 500_000, prog.seed0 + 500_000 + S_RS // 2), True)
    p = g_test(counts_of(outcomes), exact_distribution(table, prog.params))
    print(f"rejection, window reads the judged draft: G-test p = {p:.3g}")
    assert p < ALPHA
