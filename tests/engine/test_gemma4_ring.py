"""Gemma 4's sliding layers on a ring storage (`kv_cache.ring_rows`: the window and one write's
rows, position j at row j % rows). With the ring's write span patched down so that a tiny
target's sessions use it, everything equals the plain storage's, bit for bit: the eager forward
(taps too), fixed-width steps in any grouping, a rollback, and speculative arms against plain
greedy; the state is smaller; a step wider than the span is refused."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.engine.models.kv_cache import ring_rows
from memra_cli.engine.runtime.steps import PREFILL_CHUNK, StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.gemma4 import make_tiny_gemma4

VOCAB, WINDOW, WIDTH, SPAN = 512, 8, 16, 16
RING = ring_rows(WINDOW, SPAN)  # 24 rows: storages of 60+ positions take the ring
SIX = ("sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention",
       "full_attention")
NO_RING = 10 ** 9  # a span no storage reaches: every layer keeps every position


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_ring")
    # k_eq_v, softcap, tied; and per-layer inputs with two KV-shared layers (a shared sliding
    # layer reads its source's ring)
    return {"base": make_tiny_gemma4(root / "base"),
            "ple-shared": make_tiny_gemma4(root / "ps", ple=8, shared=2, layer_types=SIX, k_eq_v=False,
                                           softcap=None, tie=False, seed=1)}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 4, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _span(monkeypatch, span: int, engine: Engine | None = None) -> None:
    """Set the ring's write span; drop `engine`'s idle storages (made under the other span: the
    pool would hand them out again)."""
    monkeypatch.setattr(Gemma4Target, "RING_SPAN", span)
    if engine is not None:
        engine.pool.clear()


def _rows_seen(monkeypatch) -> list[int]:
    """The fewest rows of any layer of each state the target makes from here on."""
    seen, make = [], Gemma4Target.new_state

    def recording(self, rows):
        state = make(self, rows)
        seen.append(min(kv.shape[2] for kv in state.kv if kv is not None))
        return state

    monkeypatch.setattr(Gemma4Target, "new_state", recording)
    return seen


def test_the_ring_span_covers_every_write_the_engine_makes():
    """The prefill's chunks and the default fixed-width step fit one write of the ring."""
    assert Gemma4Target.RING_SPAN >= PREFILL_CHUNK >= 16


def test_a_sliding_layer_keeps_a_ring_and_a_full_layer_every_position(dirs, monkeypatch):
    target = Gemma4Target.from_dir(dirs["base"])
    _span(monkeypatch, NO_RING)
    plain = target.new_state(200)
    _span(monkeypatch, SPAN)
    ring = target.new_state(200)
    for kind, p, r in zip(target.cfg.layer_types, plain.kv, ring.kv):
        if p is not None:
            assert p.shape[2] == 200 and r.shape[2] == (RING if kind == "sliding_attention" else 200), kind
    assert ring.nbytes < plain.nbytes
    small = target.new_state(RING)  # no fewer rows than positions: a plain storage
    assert all(kv is None or kv.shape[2] == RING for kv in small.kv)


@pytest.mark.parametrize("variant", ["base", "ple-shared"])
def test_the_forward_over_a_ring_is_the_plain_forward(dirs, monkeypatch, variant):
    """A 150-token prompt through the eager forward (in SPAN-row chunks over the ring) against
    the same chunks over a plain storage: hidden states and taps bit for bit."""
    target = Gemma4Target.from_dir(dirs[variant])
    ids = torch.tensor(prompt(150, 3))
    taps = (-1, 1, 4)
    _span(monkeypatch, SPAN)
    ring = target.new_state(160)
    assert any(kv is not None and kv.shape[2] == RING for kv in ring.kv)
    got, got_taps = target.forward(ids, 0, ring, taps=taps)
    _span(monkeypatch, NO_RING)
    plain = target.new_state(160)
    want = [target.forward(ids[c:c + SPAN], c, plain, taps=taps) for c in range(0, 150, SPAN)]
    assert ring.length == plain.length == 150
    assert torch.equal(got, torch.cat([h for h, _ in want])) and torch.equal(got_taps, torch.cat([t for _, t in want]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_steps_over_a_ring_are_the_plain_storages(dirs, monkeypatch, dtype):
    """Fixed 16-row steps in three groupings over a ring of 24 rows (windows wrapping around its
    end), and a rollback of rows that overwrote ring rows: the plain storage's logits."""
    target = Gemma4Target.from_dir(dirs["ple-shared"], dtype=dtype)
    runner = StepRunner(target, WIDTH)
    ids, wrong = prompt(120, 21), prompt(10, 22)

    def run(span: int) -> list[torch.Tensor]:
        _span(monkeypatch, span)
        outs = []
        for groups in ((12, 28, 16, 64), (1,) * 12 + (45, 63), (30, 5, 16, 7, 62)):
            state = target.new_state(160)
            rows, start = [], 0
            for g in groups:
                logits, _ = runner.step(torch.tensor(ids[start:start + g]), start, state)
                rows.append(logits)
                start += g
            outs.append(torch.cat(rows))
        state = target.new_state(160)  # 100 real rows, 10 wrong ones, rolled back, then the rest
        runner.step(torch.tensor(ids[:100] + wrong), 0, state)
        state.rollback(100)
        outs.append(runner.step(torch.tensor(ids[100:]), 100, state)[0])
        return outs

    ring, plain = run(SPAN), run(NO_RING)
    for got, want in zip(ring, plain):
        assert torch.equal(got, want)
    assert torch.equal(ring[0][12:], ring[1][12:]) and torch.equal(ring[3], ring[0][100:])


def test_a_graphed_prefills_padding_stays_within_the_rings_span(dirs, monkeypatch):
    """A graphed prefill pads the prompt up to its bucket (64 rows) and replays `forward` over
    them, padding included. Over a ring, padding more than RING_SPAN rows past the prompt
    overwrites keys the next step reads (shown eagerly here: a replay runs the same forward), so
    the runner prefills such a prompt eagerly (`padding_rows_limit`) and pads one within it."""
    target = Gemma4Target.from_dir(dirs["base"])
    runner, stepper = StepRunner(target, WIDTH), StepRunner(target, WIDTH)
    runner.cuda_graphs = True  # prefill_rows' rule alone: the CPU captures no graph
    ids = prompt(80, 5)

    def next_logits(span: int, t: int, padded: bool) -> torch.Tensor:
        _span(monkeypatch, span)
        state = target.new_state(160)
        rows = ids[:t] + [ids[t - 1]] * (64 - t) if padded else ids[:t]  # PrefillGraph.run's padding
        target.forward(torch.tensor(rows), 0, state)
        state.length = t
        return stepper.step(torch.tensor([ids[t]]), t, state)[0]

    _span(monkeypatch, SPAN)
    ring = target.new_state(160)
    assert target.padding_rows_limit(ring) == SPAN
    assert runner.prefill_rows(30, ring) is None  # 34 padding rows: past the span, eager
    assert runner.prefill_rows(50, ring) == 64  # 14: within it, graphed
    _span(monkeypatch, NO_RING)
    plain = target.new_state(160)
    assert target.padding_rows_limit(plain) is None and runner.prefill_rows(30, plain) == 64
    for t in (30, 50):
        want = next_logits(NO_RING, t, padded=False)
        assert torch.equal(next_logits(NO_RING, t, padded=True), want)  # a plain storage takes any padding
        assert torch.equal(next_logits(SPAN, t, padded=True), want) is (t == 50)


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_speculative_arms_over_a_ring_equal_plain_greedy(dirs, tmp_path, monkeypatch, mode):
    """A session whose storage is a ring (prompt + 64 new tokens > 24 rows): every arm's stream is
    plain greedy's, and plain greedy's is the plain storage's."""
    target = Gemma4Target.from_dir(dirs["base"], dtype=torch.bfloat16)
    engine = Engine.from_model(target, step_width=WIDTH)
    draft = make_tiny_draft(tmp_path / "d", "zlab" if mode == "dflash" else "deepspec", block_size=8,
                            target_layer_ids=(-1, 1, 4), num_target_layers=5, dtype=torch.bfloat16, seed=3)
    ids = prompt(30, 40)
    seen = _rows_seen(monkeypatch)
    _span(monkeypatch, NO_RING, engine)
    plain = greedy_reference(engine.runner, ids, 64)
    assert seen and min(seen) > RING
    _span(monkeypatch, SPAN, engine)
    seen.clear()
    assert greedy_reference(engine.runner, ids, 64) == plain
    arm = engine.arm(ArmConfig(draft=draft, mode=mode))
    session = engine.session(ids, 64, arm)
    assert session.run() == plain
    assert seen and set(seen) == {RING}  # every state of the ring runs had its sliding layers' ring


def test_a_step_wider_than_the_rings_span_is_refused(dirs, monkeypatch):
    target = Gemma4Target.from_dir(dirs["base"])
    _span(monkeypatch, SPAN)
    state = target.new_state(100)
    with pytest.raises(ValueError, match="a step of 32 rows over a sliding-window ring of 16-row writes"):
        target.static_step(torch.zeros(32, dtype=torch.long), torch.arange(32), state)


@pytest.mark.parametrize("round_graphs", [False, True])
def test_graphed_sessions_over_a_ring_on_the_capture_stand_in(dirs, tmp_path, monkeypatch, round_graphs):
    """Graphed steps (or whole rounds) and drafter graphs over a ring, on the CPU stand-in of a
    capture, whose capture run writes what a warm-up writes: plain greedy over the plain
    storage. A capture at the storage's slack positions would overwrite ring rows of live keys
    (every position's row is some live position's in a ring); it writes the step's own rows."""
    from spec_arms import eager_capture, graphed_on_cpu

    captures = eager_capture(monkeypatch)
    target = Gemma4Target.from_dir(dirs["base"])
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=8, target_layer_ids=(-1, 1, 4), num_target_layers=5,
                            seed=3)
    ids = prompt(30, 41)
    _span(monkeypatch, NO_RING)
    plain = greedy_reference(StepRunner(target, WIDTH), ids, 64)
    _span(monkeypatch, SPAN)
    seen = _rows_seen(monkeypatch)
    engine = graphed_on_cpu(target, WIDTH, round_graphs)
    assert greedy_reference(engine.runner, ids, 64) == plain
    with engine.session(ids, 64, engine.arm(ArmConfig(draft=draft, mode="dflash")), eos_ids=()) as session:
        assert session.run() == plain
        keys = {k[0] for k in session.cache.graphs}
    assert ("spec-chain" if round_graphs else "step") in keys and captures
    assert seen and set(seen) == {RING}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphed_sessions_over_a_ring_equal_the_plain_storages(dirs, tmp_path, monkeypatch):
    """On CUDA, bf16, the kernels and CUDA graphs: plain greedy over a ring is plain greedy over
    the plain storage, and a DFlash session over a ring gives it."""
    engine = Engine.from_model(Gemma4Target.from_dir(dirs["base"], dtype=torch.bfloat16, device="cuda"),
                               step_width=WIDTH, cuda_graphs=True)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=8, target_layer_ids=(-1, 1, 4), num_target_layers=5,
                            dtype=torch.bfloat16, seed=3)
    ids = prompt(30, 41)
    seen = _rows_seen(monkeypatch)
    _span(monkeypatch, NO_RING, engine)
    plain = greedy_reference(engine.runner, ids, 64)
    _span(monkeypatch, SPAN, engine)
    seen.clear()
    assert greedy_reference(engine.runner, ids, 64) == plain
    assert engine.session(ids, 64, engine.arm(ArmConfig(draft=draft, mode="dflash"))).run() == plain
    assert seen and set(seen) == {RING}
