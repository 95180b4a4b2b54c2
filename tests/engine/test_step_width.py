"""Fixed-width target steps: a token's logits must not depend on how many tokens share its step.

With a `StepRunner` of width W every decode / verify step runs at exactly W rows (padded, or chunked), so
the logits of a position are bit-identical whether it is decoded alone, verified inside a block,
or split across chunks; then speculative streams equal plain greedy in bfloat16 too. Checked
bit for bit on CPU in float32 and bfloat16; a `gpu`-marked variant repeats it on CUDA, where
variable-width bf16 steps are known to differ (docs/perf.md).
"""

from __future__ import annotations

import re
import types

import pytest
import torch

from memra_cli.engine.errors import ConfigError, SettingError
from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

from fp32_bounds import assert_close_at_scale, layer_reductions, reorder_bound
from host_reads import NoHostReads

WIDTH = 16
VOCAB = 512


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("steps") / "target", hidden=128, intermediate=384, layers=3,
                           heads=4, kv_heads=2, head_dim=32)


def _ids(n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def _logits_in_groups(runner: StepRunner, prompt: torch.Tensor, cont: torch.Tensor, groups: list[int],
                      room: int = 1):
    """Prefill `prompt`, then teacher-force `cont` in steps of the given sizes, in a state of
    `room` positions beyond them; logits `[len(cont), V]`."""
    cache = runner.new_state(prompt.shape[0] + cont.shape[0] + room)
    runner.prefill(prompt, cache)
    out, at = [], 0
    for g in groups:
        logits, _ = runner.step(cont[at:at + g], cache.length, cache)
        out.append(logits)
        at += g
    assert at == cont.shape[0] and cache.length == prompt.shape[0] + at
    return torch.cat(out)


GROUPINGS = ([1] * 24, [24], [16, 8], [5, 7, 1, 11], [3] * 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fixed_width_logits_do_not_depend_on_the_grouping(target_dir, dtype):
    model = Qwen3Target.from_dir(target_dir, dtype=dtype)
    runner = StepRunner(model, WIDTH)
    prompt, cont = _ids(37, 0), _ids(24, 1)
    runs = [_logits_in_groups(runner, prompt, cont, g) for g in GROUPINGS]
    for g, logits in zip(GROUPINGS[1:], runs[1:]):
        assert torch.equal(logits, runs[0]), f"grouping {g} differs from one row at a time"
    # and they are the model's logits: the same numbers as a variable-width run, to rounding
    variable = StepRunner(Qwen3Target.from_dir(target_dir, dtype=dtype))
    ref = _logits_in_groups(variable, prompt, cont, [24])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert ((runs[0] - ref).norm() / ref.norm()).item() < tol


def test_padding_rows_leave_no_trace(target_dir):
    """A padded step then a step over the padded positions: identical to never padding there."""
    runner = StepRunner(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16), WIDTH)
    prompt, cont = _ids(20, 2), _ids(6, 3)
    a = _logits_in_groups(runner, prompt, cont, [2, 4])  # the first step pads 14 rows at 22..35
    b = _logits_in_groups(runner, prompt, cont, [6])
    assert torch.equal(a, b)


def test_taps_come_back_for_the_real_rows_only(target_dir):
    target = Qwen3Target.from_dir(target_dir)
    runner = StepRunner(target, WIDTH)
    cache = runner.new_state(64)
    runner.prefill(_ids(10, 4), cache)
    _, taps = runner.step(_ids(3, 5), 10, cache, taps=(-1, 1))
    assert taps.shape == (3, 2 * target.hidden_size) and cache.length == 13
    _, taps = runner.step(_ids(20, 6), 13, cache, taps=(0,))  # two chunks: 16 + 4
    assert taps.shape == (20, target.hidden_size) and cache.length == 33


def test_cache_has_room_for_the_padding(target_dir):
    """A session sized to its last token still fits a padded step there."""
    runner = StepRunner(Qwen3Target.from_dir(target_dir), WIDTH)
    prompt = _ids(30, 7)
    out = greedy_reference(runner, prompt.tolist(), 5)  # cache of 35 positions: the last step pads to 49
    assert len(out) == 5


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_width_is_refused(target_dir, bad):
    target = Qwen3Target.from_dir(target_dir)
    want = f"step_width must be a positive integer or None (variable), got {bad!r}"
    with pytest.raises(ConfigError, match=re.escape(want)):
        StepRunner(target, bad)
    with pytest.raises(ConfigError, match=re.escape(want)):
        Engine.from_model(target, step_width=bad)


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_bf16_speculative_equals_plain_greedy_with_fixed_steps(target_dir, tmp_path, spec):
    """The point of it: in bfloat16, every arm's stream equals plain greedy of the same target."""
    engine = Engine.from_model(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16), step_width=WIDTH)
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                            block_size=16, target_layer_ids=(0, 2), num_target_layers=3, dtype=torch.bfloat16, **extra)
    arms = {window: engine.arm(ArmConfig(draft=draft, mode=spec, settings=PolicySettings(adapt=window)))
            for window in ("0", "1")}  # verify window pinned at the cap, and the ladder
    for seed in range(3):
        prompt = _ids(9 + 7 * seed, 10 + seed).tolist()
        plain = greedy_reference(engine.runner, prompt, 40)
        for window, arm in arms.items():
            assert engine.session(prompt, 40, arm, eos_ids=()).run() == plain, (seed, window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fixed_width_logits_do_not_depend_on_the_grouping(target_dir):
    runner = StepRunner(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda"), WIDTH)
    prompt, cont = _ids(37, 0, "cuda"), _ids(24, 1, "cuda")
    runs = [_logits_in_groups(runner, prompt, cont, g) for g in GROUPINGS]
    for g, logits in zip(GROUPINGS[1:], runs[1:]):
        assert torch.equal(logits, runs[0]), f"grouping {g} differs from one row at a time"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_cuda_bf16_logits_do_not_depend_on_the_storage_size(target_dir, ops):
    """A plain and a speculative session size their K/V storages differently, so a position's
    logits must not depend on the storage's size (on the CPU: tests/engine/test_sdpa.py), with
    either step ops (`MEMRA_KERNELS=0` runs the torch ones on CUDA)."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    model = Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda")
    model.step_ops = TorchStepOps() if ops == "torch" else TritonStepOps()
    runner = StepRunner(model, WIDTH)
    prompt, cont = _ids(37, 0, "cuda"), _ids(24, 1, "cuda")
    runs = {room: _logits_in_groups(runner, prompt, cont, [16, 8], room) for room in (1, 700, 1900)}
    for room, logits in runs.items():
        assert torch.equal(logits, runs[1]), f"{ops} step ops: a storage {room} positions longer differs"


def test_cuda_graphs_refused_off_cuda_or_without_a_width(target_dir):
    target = Qwen3Target.from_dir(target_dir)
    with pytest.raises(ConfigError, match=r"cuda_graphs needs the target on a CUDA device .*\(device cpu, step_width 16\)"):
        StepRunner(target, WIDTH, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs needs the target on a CUDA device"):
        Engine.from_model(target, step_width=WIDTH, cuda_graphs=True)
    # on CUDA too, a graph needs a fixed width (a stand-in model: the check reads only its device)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"), supports_cuda_graphs=True)  # a declared capability
    with pytest.raises(ConfigError, match=r"fixed step_width \(device cuda, step_width None\)"):
        StepRunner(on_cuda, None, cuda_graphs=True)
    # drafter rounds are graphed only with the target's steps graphed
    with pytest.raises(SettingError, match="draft_graphs=True: needs the target's CUDA graphs on"):
        Engine.from_model(target, step_width=WIDTH, draft_graphs=True)
    runner = StepRunner(target, WIDTH, cuda_graphs=False)
    assert not runner.cuda_graphs and runner.new_state(10).graphs == {}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_graph_replay_is_bit_identical_to_the_eager_step(target_dir):
    eager = StepRunner(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda"), WIDTH)
    graphed = StepRunner(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda"), WIDTH,
                         cuda_graphs=True)
    prompt, cont = _ids(37, 0, "cuda"), _ids(24, 1, "cuda")
    for g in GROUPINGS:
        a = _logits_in_groups(eager, prompt, cont, g)
        b = _logits_in_groups(graphed, prompt, cont, g)
        assert torch.equal(a, b), g


@pytest.mark.gpu
@cuda
def test_cuda_graph_sessions_reuse_the_pooled_storage_and_stay_exact(target_dir, tmp_path):
    engine = Engine.from_model(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda"),
                               step_width=WIDTH, cuda_graphs=True)
    draft = make_tiny_draft(tmp_path / "d", "deepspec", hidden=128, heads=4, kv_heads=2, head_dim=32,
                            intermediate=256, block_size=16, target_layer_ids=(0, 2), num_target_layers=3,
                            dtype=torch.bfloat16, markov_rank=16, confidence="markov")
    prompt = _ids(20, 3).tolist()
    plain = greedy_reference(engine.runner, prompt, 40)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    first = engine.session(prompt, 40, arm, eos_ids=())
    storage = first.cache.kv.data_ptr()
    assert first.run() == plain
    graphs = dict(first.cache.graphs)
    assert ("step", tuple(first.taps)) in graphs  # captured for this drafter's taps
    again = engine.session(prompt, 40, arm, eos_ids=())
    assert again.cache.kv.data_ptr() == storage  # the released storage, graphs and all
    assert again.run() == plain and again.cache.graphs == graphs  # no new capture
    # two live sessions never share a storage; interleaved bursts stay exact
    a = engine.session(prompt, 40, arm, eos_ids=())
    b = engine.session(prompt, 40, arm, eos_ids=())
    assert a.cache.kv.data_ptr() != b.cache.kv.data_ptr()
    out_a, out_b = [], []
    while not (a.finished and b.finished):
        out_a += a.burst(3)
        out_b += b.burst(5)
    assert out_a == plain and out_b == plain


# --------------------------------------------------------------------------- the drafter's static path


@pytest.mark.parametrize("fmt", ["zlab", "deepspec"])
def test_static_draft_round_and_ingest_match_the_eager_ones(target_dir, tmp_path, fmt):
    """The graphed drafter runs `static_round` / `static_ingest` (whole-storage attention under a
    mask from device positions): they must draft and store what the eager cached path does, with
    a sliding, causal-in-block layer whose window is shorter than the context."""
    from memra_cli.engine.spec.proposer import static_proposal

    target = Qwen3Target.from_dir(target_dir)
    engine = Engine.from_model(target, step_width=WIDTH)
    extra = {} if fmt == "zlab" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / fmt, fmt, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                            block_size=16, target_layer_ids=(0, 2), num_target_layers=3,
                            layer_types=("sliding_attention", "full_attention"), sliding_window=9, **extra)
    mode = "dflash" if fmt == "zlab" else "dspark"
    session = engine.session(_ids(30, 8).tolist(), 60, engine.arm(ArmConfig(draft=draft, mode=mode)), eos_ids=())
    session.burst(12)
    proposer, start, last = session.proposer, session.cache.length, session.last
    kv = proposer.kv
    assert kv.length == start
    want_raws = proposer.program.window.is_confidence
    eager = proposer.propose(last, start, want_raws)
    heads = static_proposal(proposer.drafter, proposer.target, proposer.program, kv, last,
                            proposer.block_ids, torch.tensor(start), want_raws, want_chain=True)
    drafts, raws = heads.drafts, heads.raws
    assert torch.equal(drafts, eager.drafts)
    assert torch.equal(heads.chain, torch.cat([last.reshape(1), drafts]))  # the round's candidates
    if want_raws:  # the static round's GEMMs may sum in other orders: the drafter's layers, then the head
        dc = proposer.drafter.cfg
        per_layer = layer_reductions(dc.hidden_size, dc.num_attention_heads * dc.head_dim, dc.head_dim, start + 16,
                                     dc.intermediate_size)
        bound = reorder_bound(*per_layer * dc.num_hidden_layers, dc.hidden_size + dc.markov_rank)
        assert_close_at_scale(raws, eager.raws, bound, "confidence raws")
    hidden_eager = proposer.drafter.forward_round(kv, target.embed(proposer.block_ids),
                                                  torch.arange(start, start + 16)).hidden_out
    hidden_static = proposer.drafter.static_round(kv, target.embed(proposer.block_ids), torch.tensor(start))
    assert ((hidden_static - hidden_eager).norm() / hidden_eager.norm()).item() < 1e-5
    # ingest: 3 real rows (and 13 padding rows) statically == 3 rows eagerly, on the real rows
    taps = torch.randn(16, 2 * 128, generator=torch.Generator().manual_seed(0))
    k_before = kv.k.clone()
    proposer.drafter.ingest(kv, taps[:3], torch.arange(start, start + 3))
    k_eager = kv.k[:, :, start:start + 3].clone()
    kv.k.copy_(k_before)
    padded = torch.cat([taps[:3], taps[2:3].expand(13, -1)])
    proposer.drafter.static_ingest(kv, padded, torch.tensor(start))
    assert_close_at_scale(kv.k[:, :, start:start + 3], k_eager, _kv_bound(proposer.drafter.cfg), "static ingest")
    assert torch.equal(kv.k[:, :, :start], k_before[:, :, :start])  # committed rows untouched
    # a round hands the ingest its block's positions (one add for both): the same K/V, bit for bit
    at = proposer.drafter.block_positions(torch.tensor(start), 15, 16)  # a 15-row block, a 16-row step
    assert at.rows.tolist() == list(range(start, start + 15)) and at.last.tolist() == [start + 14] * 15
    assert at.span.tolist() == list(range(start, start + 16))
    k_static = kv.k.clone()
    kv.k.copy_(k_before)
    proposer.drafter.static_ingest(kv, padded, torch.tensor(start), at.span)
    assert torch.equal(kv.k, k_static)
    with pytest.raises(ValueError, match="positions"):
        proposer.drafter.static_ingest(kv, padded, torch.tensor(start), at.rows)
    # a round's positions in one add: the verify's rows from the target's start, the block's
    # (`block_positions`) from the draft cache's
    for b, width in ((15, 16), (16, 16), (4, 16), (16, 8)):
        verify, blk = proposer.drafter.round_positions(torch.tensor([start + 5, start]), b, width)
        assert verify.tolist() == list(range(start + 5, start + 5 + width)) and verify.is_contiguous()
        ref = proposer.drafter.block_positions(torch.tensor(start), b, width)
        assert all(torch.equal(got, want) and got.is_contiguous() for got, want in zip(blk, ref)), (b, width)


@pytest.mark.gpu
@cuda
def test_graphed_rounds_keep_the_eager_tau_and_stay_exact(target_dir, tmp_path):
    """Graphed drafter rounds: every stream equals plain greedy, and (f32) the accepted counts are
    the eager proposer's, so the graphs draft what the eager drafter drafts."""
    draft = make_tiny_draft(tmp_path / "d", "deepspec", hidden=128, heads=4, kv_heads=2, head_dim=32,
                            intermediate=256, block_size=16, target_layer_ids=(0, 2), num_target_layers=3,
                            markov_rank=16, confidence="markov", layer_types=("sliding_attention", "full_attention"),
                            sliding_window=9)
    graphed = Engine.from_model(Qwen3Target.from_dir(target_dir, device="cuda"), step_width=WIDTH,
                                cuda_graphs=True, draft_graphs=True)
    eager = Engine.from_model(Qwen3Target.from_dir(target_dir, device="cuda"), step_width=WIDTH)
    # one arm per engine and window, kept for every prompt (as bench keeps its arms): a later
    # session replays graphs an earlier, freed session captured over the pooled storages
    arms = {}
    for vt in ("ladder", "confidence-slot"):
        cfg = ArmConfig(draft=draft, mode="dspark", settings=PolicySettings(vt=vt))
        arms[vt] = graphed.arm(cfg), eager.arm(cfg)
    for seed in range(3):
        prompt = _ids(20 + 9 * seed, 30 + seed).tolist()
        plain = greedy_reference(eager.runner, prompt, 48)
        for vt, (arm_g, arm_e) in arms.items():
            s_g = graphed.session(prompt, 48, arm_g, eos_ids=())
            s_e = eager.session(prompt, 48, arm_e, eos_ids=())
            assert s_g.run() == plain == s_e.run(), (seed, vt)
            assert s_g.stats.accept_hist == s_e.stats.accept_hist, (seed, vt)
            assert s_g.proposer.kv.graphs  # the rounds really were graphed
            # the session is gone, its storages and graphs live on in the pools: nothing a graph
            # reads may have belonged to the session (freed memory here gets scribbled over)
            del s_g
            junk = torch.full((1 << 22,), 1 << 30, dtype=torch.long, device="cuda")
            del junk


def test_resolve_cuda_graphs_rules():
    from memra_cli.engine.api import resolve_cuda_graphs

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    on, drafter, note = resolve_cuda_graphs(None, gpu, 16, {})
    assert (on, drafter) == (True, True) and "default: on CUDA with fixed-width steps" in note
    assert "drafter rounds graphed (default" in note
    assert resolve_cuda_graphs(None, gpu, 16, {"MEMRA_DRAFT_GRAPHS": "1"})[:2] == (True, True)
    on, drafter, note = resolve_cuda_graphs(None, gpu, 16, {"MEMRA_DRAFT_GRAPHS": "0"})
    assert (on, drafter) == (True, False) and "drafter rounds eager (MEMRA_DRAFT_GRAPHS=0)" in note
    assert resolve_cuda_graphs(None, gpu, None, {})[:2] == (False, False)  # variable widths: no graph
    assert resolve_cuda_graphs(None, cpu, 16, {})[:2] == (False, False)
    assert resolve_cuda_graphs(False, gpu, 16, {})[:2] == (False, False)
    # a refused setting names the setting; a front end words it as its flag (SettingError.flag_message)
    for args, match, flag in (((True, cpu, 16, {}), r"cuda_graphs=True: needs a CUDA device .*\(device cpu, step width 16\)",
                               "--cuda-graphs needs --device cuda"),
                              ((True, gpu, None, {}), r"fixed step_width \(device cuda, step width variable\)",
                               "fixed --step-width")):
        with pytest.raises(SettingError, match=match) as e:
            resolve_cuda_graphs(*args)
        assert flag in e.value.flag_message("--cuda-graphs")
    for args, match in (((None, gpu, 16, {"MEMRA_DRAFT_GRAPHS": "on"}), "expected 0 or 1"),
                        ((False, gpu, 16, {"MEMRA_DRAFT_GRAPHS": "1"}), "needs the target's CUDA graphs on")):
        with pytest.raises(ConfigError, match=match):
            resolve_cuda_graphs(*args)


# --------------------------------------------------------------------------- graph plumbing on the CPU


def _tensors(out):
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out for t in _tensors(item)]


@pytest.fixture
def eager_graphs(monkeypatch):
    """`cuda_graphs.capture` swapped for an eager stand-in: replay reruns the function and copies
    its results into the outputs of the first run, as a real graph writes into its buffers; both
    runs refuse host reads of device values (`NoHostReads`). The list records every capture."""
    from memra_cli.engine.runtime import cuda_graphs

    captures = []

    def capture(fn, device, pool=None):
        with NoHostReads():
            out = fn()

        class Replay:
            def replay(self):
                with NoHostReads():
                    fresh = fn()
                for mine, new in zip(_tensors(out), _tensors(fresh)):
                    mine.copy_(new)

        captures.append(fn)
        return Replay(), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    return captures


def graphed_on_cpu(model, pool=None, round_graphs: bool = False, width: int = WIDTH) -> Engine:
    """What `Engine.from_model(model, step_width=WIDTH, cuda_graphs=True, draft_graphs=True)`
    builds on CUDA. A runner refuses graphs off CUDA, so they are switched on after construction
    (with `eager_graphs`, a capture is the eager stand-in); the rope tables are made at full
    length as the runner's constructor does with graphs on."""
    runner = StepRunner(model, width, pool=pool)
    runner.cuda_graphs = True
    model.ensure_positions(runner._rows(model.cfg.max_position_embeddings))
    return Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                  round_graphs=round_graphs)


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_graph_plumbing_runs_exact_sessions_and_reuses_pools(target_dir, tmp_path, eager_graphs, spec):
    """Target steps and drafter rounds through StepGraph / ProposeGraph / IngestGraph (replayed
    eagerly): streams equal plain greedy, drafts and acceptance equal the eager drafter's, and a
    second session reuses the pooled storages with no new capture."""
    graphed = graphed_on_cpu(Qwen3Target.from_dir(target_dir))
    eager = Engine.from_model(Qwen3Target.from_dir(target_dir), step_width=WIDTH)
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                            block_size=16, target_layer_ids=(0, 2), num_target_layers=3,
                            layer_types=("sliding_attention", "full_attention"), sliding_window=9, **extra)
    prompt = _ids(25, 40).tolist()
    plain = greedy_reference(eager.runner, prompt, 50)

    def arm(engine):
        return engine.arm(ArmConfig(draft=draft, mode=spec))

    graphed_arm = arm(graphed)  # loaded once, as bench loads each arm once: one drafter, one pool

    def run(engine):
        s = engine.session(prompt, 50, graphed_arm if engine is graphed else arm(engine), eos_ids=())
        return s, s.run()

    s_eager, out_eager = run(eager)
    s1, out1 = run(graphed)
    assert out1 == plain == out_eager
    assert s1.stats.accept_hist == s_eager.stats.accept_hist and s1.stats.rounds == s_eager.stats.rounds
    # the graphed ingests stored what the eager ones did, row for row (a random drafter is rarely
    # accepted, so the streams alone would not see a misplaced ingest)
    n_ctx = s_eager.proposer.kv.length
    assert s1.proposer.kv.length == n_ctx
    bound = _kv_bound(s1.proposer.drafter.cfg)
    for a, b in ((s1.proposer.kv.k, s_eager.proposer.kv.k), (s1.proposer.kv.v, s_eager.proposer.kv.v)):
        assert_close_at_scale(a[:, :, :n_ctx], b[:, :, :n_ctx], bound, "graphed ingest")
    kinds = {key[0] for key in s1.proposer.kv.graphs}
    assert kinds == {"propose", "ingest", "prompt-ingest"} and ("step", tuple(s1.taps)) in s1.cache.graphs
    assert ("prefill", 64, tuple(s1.taps)) in s1.cache.graphs  # the 25-token prompt's bucket
    assert graphed.pool.live_count == 0 and graphed.pool.idle_count == 2  # both storages went back
    n = len(eager_graphs)
    storages = (s1.cache.kv.data_ptr(), s1.proposer.kv.k.data_ptr())
    s2, out2 = run(graphed)
    assert out2 == plain and len(eager_graphs) == n  # no new capture
    assert (s2.cache.kv.data_ptr(), s2.proposer.kv.k.data_ptr()) == storages
    assert greedy_reference(graphed.runner, prompt, 50) == plain  # plain decode through a graph too


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["prime", "round"])
def test_a_session_that_raises_returns_its_pooled_storages(target_dir, tmp_path, eager_graphs, when, exc):
    """A drafter that fails mid-stream (its 3rd proposal) or in the prompt's ingest: the error
    reaches the caller, and the target state and the draft cache, both pooled (graphs on), are
    back in the pool, idle, exactly once. The next session gets them (graphs and all) and is exact."""
    engine = graphed_on_cpu(Qwen3Target.from_dir(target_dir))
    draft = make_tiny_draft(tmp_path / "d", "deepspec", hidden=128, heads=4, kv_heads=2, head_dim=32,
                            intermediate=256, block_size=16, target_layer_ids=(0, 2), num_target_layers=3,
                            markov_rank=16, confidence="markov")
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    prompt = _ids(25, 41).tolist()
    plain = greedy_reference(StepRunner(engine.target, WIDTH), prompt, 40)  # unpooled: the pool stays empty
    pool = engine.pool
    assert (pool.live_count, pool.idle_count) == (0, 0)

    session = engine.session(prompt, 40, arm, eos_ids=())
    proposer, state = session.proposer, session.cache
    assert pool.live_count == 1  # the target state, taken when the session was made
    calls = []
    name = "ingest" if when == "prime" else "propose"
    real = getattr(proposer, name)

    def failing(*args):
        calls.append(args)
        if len(calls) == (1 if when == "prime" else 3):
            raise exc("the drafter blew up")
        return real(*args)

    setattr(proposer, name, failing)
    with pytest.raises(exc, match="the drafter blew up"):
        session.run()
    assert session.finished and session.stats.rounds == (0 if when == "prime" else 2)
    draft_kv = proposer.kv
    assert draft_kv is not None
    assert (pool.live_count, pool.idle_count) == (0, 2)  # both storages went back, idle
    assert pool.idle_bytes == state.nbytes + draft_kv.nbytes

    again = engine.session(prompt, 40, arm, eos_ids=())
    again.prime()
    assert again.cache is state and again.proposer.kv is draft_kv  # the released storages, reused
    session.close()  # closing the failed session again is a no-op: it must not hand back what `again` holds
    assert (pool.live_count, pool.idle_count) == (2, 0)
    assert again.run() == plain
    assert (pool.live_count, pool.idle_count) == (0, 2)


# --------------------------------------------------------------------------- the fastest plain decoding


class _FakeTarget:
    """Just what a step runner and an engine read of a model, on a device that need not exist."""

    def __init__(self, device: str, graphs: bool = True, max_pos: int = 4095):
        self.device, self.dtype = torch.device(device), torch.bfloat16
        self.supports_cuda_graphs = graphs
        self.cfg = types.SimpleNamespace(max_position_embeddings=max_pos, source="fake/config.json")
        self.rope_rows = []

    def ensure_positions(self, rows: int) -> None:
        self.rope_rows.append(rows)


@pytest.mark.parametrize("device, graphs, main, want", [
    ("cuda", True, (16, True), (1, True, "one-row steps, CUDA graphs on")),
    ("cuda", True, (16, False), (1, True, "one-row steps, CUDA graphs on")),  # --no-cuda-graphs: off eager, plain graphed
    ("cuda", False, (16, False), (None, False, "one-row steps (variable width), eager")),  # a family that cannot be captured
    ("cpu", True, (16, False), (None, False, "one-row steps (variable width), eager")),
    ("cpu", True, (None, False), (None, False, "one-row steps (variable width), eager")),
])
def test_fastest_plain_per_device(device, graphs, main, want):
    model = _FakeTarget(device, graphs)
    engine = Engine.from_model(model, step_width=main[0], cuda_graphs=main[1])
    before = list(model.rope_rows)
    plain = engine.fastest_plain()
    assert (plain.step_width, plain.cuda_graphs, plain.steps) == want
    assert plain.target is model and plain.pool is not engine.pool and not plain.draft_graphs
    if want[1]:  # rope tables reach the longest state of either runner before the plain one captures
        assert model.rope_rows[len(before)] == engine.runner.max_rows() == (4352 if main[1] else 4095 + 16)
        assert max(model.rope_rows) >= max(engine.runner.max_rows(), plain.runner.max_rows())
    else:
        assert model.rope_rows == before
    assert engine.steps == ("fixed 16-row steps, " + ("CUDA graphs on" if main[1] else "eager") if main[0]
                            else "variable-width steps, eager")


# --------------------------------------------------------------------------- whole rounds as one graph


@pytest.fixture(scope="module")
def embedded_pair():
    from memra_cli.assets import default_pair

    return default_pair()


def _kv_bound(cfg) -> float:
    """The drafter's context K/V of one row on two paths that ingest it in GEMMs of different row
    counts (the taps themselves come from fixed-width target steps: bit-equal on both): fc over
    n_taps × hidden, the hidden norm, the K / V projection over hidden, the K norm over head_dim
    may each sum in another order (fp32_bounds.py). Rope adds a few roundings, no reduction."""
    return reorder_bound(cfg.n_taps * cfg.hidden_size, cfg.hidden_size, cfg.hidden_size, cfg.head_dim, 4)


def _kv_rows(session):
    kv = session.proposer.kv
    n = kv.length
    return kv.k[:, :, :n].clone(), kv.v[:, :, :n].clone()


@pytest.mark.parametrize("arm_key", ["dflash", "dspark",  # the window variants: exhaustive tier (quick-tier time)
                                     pytest.param("dspark:vt=ladder", marks=pytest.mark.exhaustive),
                                     pytest.param("dspark:adapt=0", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_round_graphs_equal_the_per_part_graphs(embedded_pair, eager_graphs, arm_key, pipelined):
    """The embedded pair (real partial acceptance), graphed rounds (one replay each, eager
    stand-in; queued one ahead of the host's read, which settles each round on the device, or
    read one by one) against graphed parts: the same stream as plain greedy, the same rounds,
    the same accepted prefix every round (so the same drafts: the drafter saw the same context),
    and the drafter's cache holding the same committed rows. A second session reuses the round
    graph."""
    target_dir, drafts = embedded_pair
    mode, _, setting = arm_key.partition(":")
    settings = PolicySettings()
    if setting == "vt=ladder":
        settings = PolicySettings(vt="ladder")
    elif setting == "adapt=0":
        settings = PolicySettings(adapt="0")
    draft = drafts[mode]
    prompt = list(range(40, 90))
    model = Qwen3Target.from_dir(target_dir)
    plain = greedy_reference(StepRunner(model, WIDTH), prompt, 64)
    runs = {}
    for whole in (False, True):
        engine = graphed_on_cpu(model, round_graphs=whole)
        engine.pipelined = whole and pipelined
        arm = engine.arm(ArmConfig(draft=draft, mode=mode, settings=settings))
        s = engine.session(prompt, 64, arm, eos_ids=())
        out = s.run()
        runs[whole] = (s, out, _kv_rows(s))
        assert s.graphed_rounds == whole and s.pipelined == (whole and pipelined)
    (parts, out_parts, kv_parts), (whole, out_whole, kv_whole) = runs[False], runs[True]
    assert out_whole == out_parts == plain
    assert whole.stats.accept_hist == parts.stats.accept_hist and whole.stats.rounds == parts.stats.rounds
    assert whole.stats.drafted == parts.stats.drafted
    assert sum(k * v for k, v in whole.stats.accept_hist.items()) > 10  # drafts were accepted: a real test
    assert whole.proposer.kv.length == parts.proposer.kv.length
    bound = _kv_bound(whole.proposer.drafter.cfg)
    for a, b in zip(kv_whole, kv_parts):
        assert_close_at_scale(a, b, bound, arm_key)
    assert any(key[0] == "spec-chain" for key in whole.cache.graphs)  # one round driver, queued ahead or not
    assert not any(key[0] == "propose" for key in whole.proposer.kv.graphs)  # the parts never ran
    n = len(eager_graphs)
    again = engine.session(prompt, 64, arm, eos_ids=())
    assert again.run() == plain and len(eager_graphs) == n  # pooled storages, their round graph reused


@pytest.mark.parametrize("arm_key", [pytest.param("dflash", marks=pytest.mark.exhaustive), "dspark",  # DSpark's default
                                     # window quick; DFlash and the window variants: exhaustive (quick-tier time)
                                     pytest.param("dspark:vt=confidence", marks=pytest.mark.exhaustive),
                                     pytest.param("dspark:vt=ladder", marks=pytest.mark.exhaustive),
                                     pytest.param("dspark:adapt=0", marks=pytest.mark.exhaustive)])
def test_pipelined_speculative_rounds_equal_rounds_read_one_by_one(embedded_pair, eager_graphs, arm_key):
    """Speculative rounds queued one ahead of the host's read, each settled on the device (window,
    accepted prefix, next inputs; round_bodies.speculative_round_chained) against the same
    rounds read one by one: in bursts of 1, 3 and whole, with budgets that end mid-round and an
    EOS inside an accepted run, the same tokens, round for round the same accepted counts and
    windows, the committed lengths of both caches prompt + tokens between bursts, and every
    launch read when the stream ends."""
    target_dir, drafts = embedded_pair
    mode, _, setting = arm_key.partition(":")
    key, _, value = setting.partition("=")
    settings = PolicySettings(**({key: value} if key else {}))
    model = Qwen3Target.from_dir(target_dir)
    engine = graphed_on_cpu(model, round_graphs=True)
    arm = engine.arm(ArmConfig(draft=drafts[mode], mode=mode, settings=settings))

    def run(prompt, max_new, eos, burst, pipelined):
        engine.pipelined = pipelined
        with engine.session(prompt, max_new, arm, eos_ids=eos) as s:
            assert s.pipelined == pipelined
            while not s.finished:
                s.burst(burst)
                if not s.finished:  # (an EOS mid-run ends the stream; the round's rows stay committed)
                    assert s.position == len(prompt) + len(s.tokens) == s.proposer.kv.length
            chains = [g for k, g in s.cache.graphs.items() if k[0] == "spec-chain"]
            assert all(c.read_upto == c.launched for c in chains)
            return list(s.tokens), dict(s.stats.accept_hist), s.stats.drafted, s.stats.rounds

    for seed, max_new in ((0, 64), (1, 45)):
        prompt = _ids(30 + 7 * seed, 120 + seed).tolist()
        ref = run(prompt, max_new, (), 1 << 30, False)
        assert sum(k * v for k, v in ref[1].items()) > 5, arm_key  # drafts were accepted
        for burst in (1, 3, 1 << 30):
            assert run(prompt, max_new, (), burst, True) == ref, (seed, burst)
        stream = ref[0]
        eos = stream[max_new // 2]
        ref_eos = run(prompt, max_new, (eos,), 1 << 30, False)
        assert ref_eos[0] == stream[: stream.index(eos) + 1]
        assert run(prompt, max_new, (eos,), 2, True) == ref_eos, seed


@pytest.mark.parametrize("kind", ["confidence", "confidence-slot"])
def test_the_window_on_the_device_is_the_hosts(kind):
    """memra_kernels.settle_ref's window (the torch settle_round; the kernel is tested against it) against
    VerifyWindow.size_window (the host's, the policy contract) on random raws, every cap and a
    few thresholds, with the budget out of the way."""
    from memra_cli.engine.spec.policy import VerifyWindow
    from memra_kernels.settle_ref import settle_round

    gen = torch.Generator().manual_seed(3)
    cand = sel = torch.zeros(17, dtype=torch.long)
    for threshold in (0.1, 0.5, 0.9):
        window = VerifyWindow(kind, threshold)
        for trial in range(60):
            n = 1 + trial % 16
            raws = (torch.randn(n, generator=gen) * 3 + 1.5).float()
            for cap in (2, 3, 9, 17):
                host = window.size_window(raws.double().tolist(), cap)
                out = settle_round(cand, sel, raws, torch.tensor([0, 0, 0, 2, 1000]), torch.tensor([threshold], dtype=torch.float64),
                                   kind=kind, cap=cap, adapt=True)
                assert int(out[-2]) == host, (threshold, trial, cap)


@pytest.mark.parametrize("pipelined", [True, False])
def test_round_graphs_plain_decoding_equals_the_runner(target_dir, eager_graphs, pipelined):
    """Plain decoding as one replay per token (step + argmax), at width 16 (the exactness arm)
    and 1 (the fastest plain), queued one ahead of the host's read or not: the runner's greedy
    stream, and one capture per storage."""
    model = Qwen3Target.from_dir(target_dir)
    prompt = _ids(25, 43).tolist()
    plain = greedy_reference(StepRunner(model, WIDTH), prompt, 40)
    for width in (WIDTH, 1):
        engine = graphed_on_cpu(model, round_graphs=True, width=width)
        engine.pipelined = pipelined
        s = engine.session(prompt, 40, eos_ids=())
        assert s.graphed_rounds and s.pipelined == pipelined
        out = s.run()
        if width == WIDTH:
            assert out == plain
        else:  # another width: f32 on the CPU happens to agree here; what matters is the runner's
            assert out == greedy_reference(StepRunner(model, 1), prompt, 40)
        key = ("plain-chain", width)  # one round driver, queued ahead or not
        assert key in s.cache.graphs and s.stats.rounds == 40


def _chain_launches(engine, width: int) -> int:
    """Plain rounds launched so far over the engine's pooled storages (their plain RoundChains)."""
    return sum(c.launched for c in _chains(engine, width))


def _chains(engine, width: int) -> list:
    return [g for _, st in engine.pool._idle.values() for k, g in st.graphs.items() if k == ("plain-chain", width)]


@pytest.mark.parametrize("lookahead", [True, False])
def test_pipelined_plain_rounds_stop_where_the_stream_stops(target_dir, eager_graphs, lookahead):
    """Plain rounds queued one ahead of the host's read, or read before the next is queued
    (spec/chained.py, MEMRA_PIPELINE=0):
    bursts of any size, an EOS mid-stream, the budget, a session closed with a round queued and
    the next session on that storage all give the runner's stream; the committed length is
    always prompt + tokens, every launch is read, and no round runs past the stream's end (one
    launch per committed token)."""
    model = Qwen3Target.from_dir(target_dir)
    prompt = _ids(30, 7).tolist()
    full = greedy_reference(StepRunner(model, 1), prompt, 48)
    engine = graphed_on_cpu(model, round_graphs=True, width=1)
    assert engine.pipelined
    engine.pipelined = lookahead
    for size in (1, 5, 48):
        before = _chain_launches(engine, 1)
        with engine.session(prompt, 48, eos_ids=()) as s:
            got = []
            while not s.finished:
                got += s.burst(size)
                assert s.position == len(prompt) + len(s.tokens), size
                assert (s.chained.ahead is not None) == (not s.finished), size  # one queued while it goes on
            assert got == full and s.stats.rounds == 48, size
        assert _chain_launches(engine, 1) - before == 48, size
    eos = full[20]
    stop = full.index(eos) + 1  # through its first occurrence, included
    before = _chain_launches(engine, 1)
    with engine.session(prompt, 48, eos_ids=(eos,)) as s:
        assert s.run() == full[:stop] and s.stats.rounds == stop
    assert _chain_launches(engine, 1) - before == stop
    before = _chain_launches(engine, 1)
    with engine.session(prompt, 7, eos_ids=()) as s:
        assert s.run() == full[:7]
    assert _chain_launches(engine, 1) - before == 7
    with engine.session(prompt, 48, eos_ids=()) as s:  # stopped with a round queued
        assert s.burst(3) == full[:3] and s.chained.ahead is not None
    chains = _chains(engine, 1)
    assert chains and all(c.read_upto == c.launched for c in chains)  # drained on close
    with engine.session(prompt, 48, eos_ids=()) as s:  # the same storage, its chain reused
        assert s.run() == full


def test_round_chain_refuses_a_third_unread_launch(target_dir, eager_graphs):
    """Two pinned slots: a launch with two rounds unread, an out-of-order read, or a first
    launch without every input would read or overwrite a slot in use, and are refused."""
    from memra_cli.engine.runtime.round_graphs import RoundChain, RoundGraph

    chain = RoundChain(torch.device("cpu"), 2)
    chain.graphs[0] = RoundGraph(lambda inputs: inputs[1:2] + inputs[0:1], (0, 0), torch.device("cpu"),
                                 inputs=chain.inputs)
    with pytest.raises(RuntimeError, match="first launch needs every input"):
        chain.launch(0, (5,))
    assert chain.launch(0, (5, 3)) == 0 and chain.launch(0, (6,)) == 1
    with pytest.raises(RuntimeError, match="two rounds unread"):
        chain.launch(0, (7,))
    with pytest.raises(RuntimeError, match="read of launch 1, expected 0"):
        chain.read(1)
    assert chain.read(0)[0] == 8 and chain.read(1)[0] == 9  # start + anchor: the body's output


def test_pipeline_setting():
    from memra_cli.engine.api import resolve_pipeline

    assert resolve_pipeline(True, {})[0] is True
    assert resolve_pipeline(True, {"MEMRA_PIPELINE": "0"})[0] is False
    assert resolve_pipeline(False, {}) == (False, None)
    with pytest.raises(ConfigError, match="MEMRA_PIPELINE=1 needs whole-round graphs"):
        resolve_pipeline(False, {"MEMRA_PIPELINE": "1"})
    with pytest.raises(ConfigError, match=r"MEMRA_PIPELINE='yes': expected 0 or 1"):
        resolve_pipeline(True, {"MEMRA_PIPELINE": "yes"})


def test_round_graphs_setting():
    from memra_cli.engine.api import resolve_round_graphs

    assert resolve_round_graphs(True, {})[0] is True
    assert resolve_round_graphs(True, {"MEMRA_ROUND_GRAPHS": "0"})[0] is False
    assert resolve_round_graphs(False, {}) == (False, None)
    for env, match in (({"MEMRA_ROUND_GRAPHS": "yes"}, "expected 0 or 1"),
                       ({"MEMRA_ROUND_GRAPHS": "1"}, "needs the target's CUDA graphs on")):
        with pytest.raises(ConfigError, match=match):
            resolve_round_graphs(False, env)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_round_graphs_equal_the_per_part_graphs(embedded_pair, dtype):
    """On CUDA, real graphs: whole-round replays against per-part replays on the embedded pair,
    every arm and plain decoding at widths 16 and 1. Same streams (plain greedy at width 16),
    same accepted prefixes round by round (f32), and a later session replays the captured round graph
    over the pooled storages with the earlier session's memory scribbled over."""
    target_dir, drafts = embedded_pair
    model = Qwen3Target.from_dir(target_dir, dtype=dtype, device="cuda")
    engines = {whole: Engine.from_model(model, step_width=WIDTH, cuda_graphs=True, draft_graphs=True,
                                        round_graphs=whole) for whole in (False, True)}
    cfgs = [ArmConfig(draft=drafts["dflash"], mode="dflash"), ArmConfig(draft=drafts["dspark"], mode="dspark"),
            ArmConfig(draft=drafts["dspark"], mode="dspark", settings=PolicySettings(vt="ladder"))]
    arms = {whole: [e.arm(c) for c in cfgs] for whole, e in engines.items()}
    accepted = 0
    for seed in range(3):
        prompt = _ids(30 + 11 * seed, 60 + seed).tolist()
        plain = engines[False].session(prompt, 64, eos_ids=()).run()
        fast_plain = engines[True].session(prompt, 64, eos_ids=())
        assert fast_plain.graphed_rounds and fast_plain.run() == plain
        one_row = engines[True].fastest_plain().session(prompt, 64, eos_ids=())
        assert one_row.graphed_rounds and len(one_row.run()) == 64
        for i in range(len(cfgs)):
            s_parts = engines[False].session(prompt, 64, arms[False][i], eos_ids=())
            s_whole = engines[True].session(prompt, 64, arms[True][i], eos_ids=())
            assert s_whole.graphed_rounds and not s_parts.graphed_rounds
            assert s_whole.run() == plain == s_parts.run(), (seed, i)
            if dtype == torch.float32:  # (bf16: a full block's ingest is eager by parts, static whole)
                assert s_whole.stats.accept_hist == s_parts.stats.accept_hist, (seed, i)
            accepted += s_whole.stats.accepted
            del s_whole
            junk = torch.full((1 << 22,), 1 << 30, dtype=torch.long, device="cuda")
            del junk
    assert accepted > 50  # the embedded drafters are often right: partial acceptance was exercised


@pytest.mark.gpu
@cuda
def test_cuda_pipelined_plain_equals_one_by_one(embedded_pair):
    """On CUDA, real graphs and real pinned-memory reads: plain rounds queued one ahead of the
    host (the default) give the stream of rounds read one by one (MEMRA_PIPELINE=0), at widths 1
    and 16, in bursts of one token and whole, and stop at an EOS with every launch read."""
    target_dir, _ = embedded_pair
    model = Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda")
    engine = Engine.from_model(model, step_width=WIDTH, cuda_graphs=True, draft_graphs=True, round_graphs=True)
    for eng in (engine, engine.fastest_plain()):
        for seed in range(2):
            prompt = _ids(40 + 9 * seed, 90 + seed).tolist()
            eng.pipelined = False
            ref = eng.session(prompt, 96, eos_ids=()).run()
            eng.pipelined = True
            s = eng.session(prompt, 96, eos_ids=())
            got = []
            while not s.finished:
                got += s.burst(1)
                assert s.position == len(prompt) + len(s.tokens)
            assert s.pipelined and got == ref, seed
            assert eng.session(prompt, 96, eos_ids=()).run() == ref
            stop = ref.index(ref[50]) + 1
            with eng.session(prompt, 96, eos_ids=(ref[50],)) as s:
                assert s.run() == ref[:stop]
            assert all(c.read_upto == c.launched for c in _chains(eng, eng.step_width))


@pytest.mark.gpu
@cuda
def test_cuda_pdl_launches_change_no_bit(embedded_pair, monkeypatch):
    """Our kernels launched with programmatic dependent launch (kernels/_pdl.py, the default on
    sm_90+) against plain launches (MEMRA_PDL=0), each captured into its own graphs: the same
    plain and DSpark streams and the same accepted prefixes, bf16, whole-round graphs."""
    from memra_kernels import _pdl

    target_dir, drafts = embedded_pair
    monkeypatch.delenv(_pdl.ENV, raising=False)
    if not _pdl.enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv(_pdl.ENV, pdl)
        model = Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda")
        engine = Engine.from_model(model, step_width=WIDTH, cuda_graphs=True, draft_graphs=True, round_graphs=True)
        arm = engine.arm(ArmConfig(draft=drafts["dspark"], mode="dspark"))
        out = []
        for seed in range(3):
            prompt = _ids(30 + 7 * seed, 70 + seed).tolist()
            out.append(engine.session(prompt, 96, eos_ids=()).run())
            out.append(engine.fastest_plain().session(prompt, 96, eos_ids=()).run())
            s = engine.session(prompt, 96, arm, eos_ids=())
            out += [s.run(), dict(s.stats.accept_hist)]
        runs[pdl] = out
    assert runs["1"] == runs["0"]
    assert runs["1"][0] == runs["1"][2]  # and speculative == plain greedy


def test_a_round_graph_keeps_what_its_body_closes_over(eager_graphs):
    """A real CUDA graph keeps no Python reference to the tensors its body reads (here a
    constant row index), so the RoundGraph must: dropped, their memory would be reused under
    the replay (found on the H200: the block's mask ids freed, garbage ids into the embedding)."""
    import gc
    import weakref

    from memra_cli.engine.runtime import cuda_graphs
    from memra_cli.engine.runtime.round_graphs import RoundGraph

    def real_capture(fn, device):  # like a CUDA graph: the function is not kept
        out = fn()
        return types.SimpleNamespace(replay=lambda: None), out

    cuda_graphs.capture = real_capture  # (eager_graphs restores the module afterwards)
    consts = torch.arange(4)
    seen = weakref.ref(consts)

    def make_body(c):
        return lambda inputs: c + inputs[0]

    graph = RoundGraph(make_body(consts), (0,), torch.device("cpu"))
    del consts
    gc.collect()
    assert seen() is not None and graph.body is not None


# --------------------------------------------------------------------------- graphed prefill


def test_graphed_prefill_pads_to_a_bucket_and_matches_the_eager_prefill(target_dir, eager_graphs):
    """A one-chunk prompt replays a prefill graph of its bucket (eager stand-in on the CPU): the
    last row's logits, the real rows' taps and the real rows' K/V equal an eager prefill's, the
    length is the prompt's, and a second prompt of the same bucket reuses the capture."""
    from memra_cli.engine.runtime.steps import PREFILL_BUCKET

    model = Qwen3Target.from_dir(target_dir)
    graphed = graphed_on_cpu(model).runner
    eager = StepRunner(model, WIDTH)
    taps = (0, 2)
    for seed, t in ((0, 37), (1, 50), (2, PREFILL_BUCKET + 1)):
        prompt = _ids(t, seed)
        a, b = graphed.new_state(t + 40), eager.new_state(t + 40)
        got, got_taps = graphed.prefill(prompt, a, taps)
        want, want_taps = eager.prefill(prompt, b, taps)
        rows = graphed.prefill_rows(t, a)
        assert rows == -(-t // PREFILL_BUCKET) * PREFILL_BUCKET and ("prefill", rows, taps) in a.graphs
        assert a.length == b.length == t
        # the bucket's GEMMs run at other row counts than the prompt's: another summation order
        # through the layers (and the lm_head for the logits): fp32_bounds.py
        cfg = model.cfg
        per_layer = layer_reductions(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, t,
                                     cfg.intermediate_size)
        whole = reorder_bound(*per_layer * model.n_layers, cfg.hidden_size)
        assert_close_at_scale(got, want, whole, "last logits")
        assert got_taps.shape[0] == t
        assert_close_at_scale(got_taps, want_taps, reorder_bound(*per_layer * (max(taps) + 1)), "taps")
        assert_close_at_scale(a.kv[:, :, :, :t], b.kv[:, :, :, :t], whole, "K/V")
        graphed.release(a)
    assert len([f for f in eager_graphs]) == 2  # 37 and 50 share the 64-row bucket's capture


def test_graphed_prefill_padding_leaves_no_trace_on_the_stream(target_dir, eager_graphs, monkeypatch):
    """Decoding after a padded prefill equals decoding after an eager one, token for token (the
    padding rows' K/V are overwritten before any query reads them). Planted: a prefill graph
    that kept its padding rows as context changes the stream, so the check can fail."""
    from memra_cli.engine.runtime.graphs import PrefillGraph

    model = Qwen3Target.from_dir(target_dir)
    prompt = _ids(41, 7).tolist()
    plain = greedy_reference(StepRunner(model, WIDTH), prompt, 48)
    s = graphed_on_cpu(model).session(prompt, 48, eos_ids=())
    assert s.run() == plain
    assert any(key[0] == "prefill" for key in s.cache.graphs)

    run = PrefillGraph.run

    def keeps_padding(self, ids):
        out = run(self, ids)
        self.cache.length = self.rows  # the bug: padding rows committed as context
        return out

    monkeypatch.setattr(PrefillGraph, "run", keeps_padding)
    assert graphed_on_cpu(model).session(prompt, 48, eos_ids=()).run() != plain


def test_prefill_stays_eager_where_padding_could_leave_a_trace(target_dir, eager_graphs):
    """More than one chunk, a bucket past the storage, or graphs off: the eager chunked path."""
    model = Qwen3Target.from_dir(target_dir)
    runner = graphed_on_cpu(model).runner
    state = runner.new_state(300)
    assert runner.prefill_rows(runner.prefill_chunk + 1, state) is None
    small = model.new_state(100)  # not a bucketed storage: a 90-token prompt's 128 rows overrun it
    small.graphs = {}
    assert runner.prefill_rows(90, small) is None and runner.prefill_rows(60, small) == 64
    assert StepRunner(model, WIDTH).prefill_rows(10, state) is None

    class Recurrent:  # a state without host bookkeeping (a recurrent one restores on device)
        max_len = 1024
        host_bookkeeping = False  # the capability, declared (models/base.py TargetState)

    assert runner.prefill_rows(10, Recurrent()) is None
    runner.release(state)


@pytest.mark.gpu
@cuda
def test_cuda_graphed_prefill_is_bit_identical_to_the_eager_padded_forward(target_dir):
    """On CUDA: the prefill graph's replay gives the bits of an eager forward of the padded ids
    (last real row's logits, real rows' taps and K/V), bf16."""
    from memra_cli.engine.runtime.steps import PREFILL_BUCKET

    model = Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16, device="cuda")
    runner = StepRunner(model, WIDTH, cuda_graphs=True)
    taps = (0, 2)
    for seed, t in ((0, 37), (1, 64), (2, 100)):
        prompt = _ids(t, seed, "cuda")
        state = runner.new_state(t + 40)
        got, got_taps = runner.prefill(prompt, state, taps)
        rows = -(-t // PREFILL_BUCKET) * PREFILL_BUCKET
        padded = torch.cat([prompt, prompt[-1:].expand(rows - t)])
        ref = model.new_state(state.max_len)
        hidden, want_taps = model.forward(padded, 0, ref, taps)
        want = model.logits(hidden[t - 1 : t])
        assert torch.equal(got, want) and torch.equal(got_taps, want_taps[:t])
        assert torch.equal(state.kv[:, :, :, :t], ref.kv[:, :, :, :t])
        runner.release(state)


def _row_bits_independent(linear, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether each row of `linear(x, w)` is bit-identical after the rows are reversed and after
    every other row is replaced: what the step-width rule needs of a step's weight matmul."""
    ref = linear(x, w)
    flipped = linear(x.flip(0), w).flip(0)
    other = x.clone()
    other[1:] = torch.randn_like(other[1:])
    return torch.equal(ref, flipped) and torch.equal(linear(other, w)[0], ref[0])


def test_few_row_float32_cpu_matmuls_run_on_onednn_with_independent_rows():
    """TorchStepOps.linear sends float32 CPU calls of ONEDNN_MIN_ROWS+ rows to oneDNN, fewer to
    F.linear; oneDNN's rows are bit-independent of their neighbours and place (a planted row
    mixer is caught), and it is F.linear's product to float32 rounding: each output is a sum of
    256 products, so the two summation orders differ by at most ~256 * eps * sum|x*w|."""
    from memra_cli.engine.layers import torch_step_ops

    if not torch_step_ops.ONEDNN_F32:
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g) * 0.05
    for rows in (1, torch_step_ops.ONEDNN_MIN_ROWS - 1, torch_step_ops.ONEDNN_MIN_ROWS, WIDTH):
        x = torch.randn(rows, 256, generator=g)
        want = torch_step_ops.onednn_linear(x, w) if rows >= torch_step_ops.ONEDNN_MIN_ROWS else torch.nn.functional.linear(x, w)
        assert torch.equal(torch_step_ops.TorchStepOps.linear(x, w), want), rows
    x = torch.randn(WIDTH, 256, generator=g)
    assert _row_bits_independent(torch_step_ops.onednn_linear, x, w)
    assert not _row_bits_independent(lambda a, b: torch_step_ops.onednn_linear(a, b) + a.mean(0)[:1], x, w)  # planted
    bound = 256 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T)
    assert ((torch_step_ops.onednn_linear(x, w) - x @ w.T).abs() <= bound).all()


def _storage_masked_attention(q, k_cache, v_cache, positions, scale, window=0):
    """The planted breakage: attention over the whole storage under a position mask, its value
    sum split into four equal parts of the storage, so the split points, and the float32
    summation order, follow the storage's length (what a split over the storage does). (A
    library SDPA over the masked storage is this bug on some CPUs only: one whose kernel walks
    keys in fixed blocks adds the masked ones as exact zeros.)"""
    t, nh, hd = q.shape
    nkv, S = k_cache.shape[0], k_cache.shape[1]
    g = nh // nkv
    mask = (torch.arange(S)[None, :] <= positions[:, None]).repeat(g, 1)  # [g*t, S], row (head, t)
    qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd).float()
    scores = (qf @ k_cache.float().transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    p, v = torch.softmax(scores, dim=-1), v_cache.float()
    cuts = [S * i // 4 for i in range(5)]
    out = sum(p[..., a:b] @ v[:, a:b] for a, b in zip(cuts, cuts[1:])).to(q.dtype)
    return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)


def _logits_over_storages(target_dir, dtype, slacks, attention=None):
    """A 200-token prompt, then 24 tokens teacher-forced (one at a time, and as a 16 + 8
    verify) in sessions whose storage has `slack` more rows; logits per (slack, grouping)."""
    model = Qwen3Target.from_dir(target_dir, dtype=dtype)
    if attention is not None:  # the planted form: that attention over the whole storage
        model.step_ops.attention = attention
        model._step_keys = lambda cache: cache.max_len
    runner = StepRunner(model, WIDTH)
    prompt, cont = _ids(200, 11), _ids(24, 12)
    out = []
    for slack in slacks:
        for groups in ([1] * 24, [16, 8]):
            cache = runner.new_state(prompt.shape[0] + cont.shape[0] + 1 + slack)
            runner.prefill(prompt, cache)
            out.append(torch.cat([runner.step(cont[sum(groups[:i]):sum(groups[:i + 1])], cache.length, cache)[0]
                                  for i in range(len(groups))]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fixed_width_logits_do_not_depend_on_the_storage_size(target_dir, dtype):
    """Plain and speculative sessions size their caches differently (the block's slack), so a
    token's logits must not depend on the storage either: the CPU's blocked attention reads the
    live key blocks only. Planted: attention over the whole storage under a mask (the
    summation order follows the storage length) changes the float32 logits; in bfloat16 this
    small model's rounding hides it (the embedded pair's bf16 bench showed it: docs/perf.md)."""
    slacks = (0, 40, 131)  # storages of 256, 320 and 384 rows (the CPU rounds them to key blocks)
    runs = _logits_over_storages(target_dir, dtype, slacks)
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    if dtype == torch.float32:  # the same grouping (one token a step) over the three storages
        planted = _logits_over_storages(target_dir, dtype, slacks, _storage_masked_attention)[::2]
        assert not all(torch.equal(r, planted[0]) for r in planted[1:])


def _attention_row_stable(attention, dtype) -> bool:
    """Whether the output of a token at position p (query fixed) is bit-identical as row 0 of a
    16-row step at p over a 400-row storage and as row r of a step at p - r over 250 rows."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 400, 64, generator=g).to(dtype) for _ in range(2))
    for p in (140, 203, 230):
        one = torch.randn(4, 64, generator=g).to(dtype)
        a = torch.randn(WIDTH, 4, 64, generator=g).to(dtype)
        a[0] = one
        ref = attention(a, k, v, torch.arange(p, p + WIDTH), 0.125)[0]
        for r in (1, 7, 15):
            b = torch.randn(WIDTH, 4, 64, generator=g).to(dtype)
            b[r] = one
            out = attention(b, k[:, :250], v[:, :250], torch.arange(p - r, p - r + WIDTH), 0.125)[r]
            if not torch.equal(out, ref):
                return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_blocked_attention_rows_do_not_depend_on_their_step_or_storage(dtype):
    """The op itself, at the embedded target's head size (64), storages of 250 and 400 rows,
    where attention over the whole storage split at fractions of it (planted) changes float32 bits
    (in bfloat16 the output's rounding hides it for these inputs); and it is that attention's
    result to rounding: float32 softmax + matmul over <= 400 keys differ by a few eps of the
    output's scale (1e-5 relative), bfloat16 by the output's rounding (2^-8 of its scale)."""
    from memra_cli.engine.layers.torch_step_ops import blocked_attention

    assert _attention_row_stable(blocked_attention, dtype)
    if dtype == torch.float32:
        assert not _attention_row_stable(_storage_masked_attention, dtype)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(WIDTH, 4, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 300, 64, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(230, 230 + WIDTH)
    want = _storage_masked_attention(q.float(), k.float(), v.float(), pos, 0.125)
    got = blocked_attention(q, k, v, pos, 0.125).float()
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_whole_round_graphs_at_a_step_narrower_than_the_block(target_dir, tmp_path, eager_graphs, spec):
    """A step of 8 rows under a 16-row block (a verify cap of 8, so rounds are graphed whole): the
    round body verifies the first 8 candidates and ingests the step's 8 tap rows at the head of
    the block's positions; the stream equals plain greedy over 8-row steps."""
    model = Qwen3Target.from_dir(target_dir)
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                            block_size=16, target_layer_ids=(0, 2), num_target_layers=3, **extra)
    prompt = _ids(25, 44).tolist()
    engine = graphed_on_cpu(model, round_graphs=True, width=8)
    with engine.session(prompt, 40, engine.arm(ArmConfig(draft=draft, mode=spec, verify_cap=8)), eos_ids=()) as s:
        assert s.graphed_rounds
        assert s.run() == greedy_reference(StepRunner(model, 8), prompt, 40)
        assert any(k[0] == "spec-chain" for k in s.cache.graphs)
