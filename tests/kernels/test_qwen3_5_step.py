"""The Qwen3.5 hybrid's fixed-width step through the Triton step ops (interpreter on CPU) against
the torch ops: close logits; with the kernels in place, groupings and verify + rollback bit for
bit in both rollback modes, and a speculative session equal to plain greedy."""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W = 8  # a small fixed width keeps the interpreter quick
LOGIT_TOL = 1e-4  # f32 relative L2: the kernels round exp / rsqrt / sums differently from torch


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # 2 key heads -> 4 value heads, dk = dv = 32: the head repeat Qwen3.5 uses, at toy size
    return make_tiny_qwen35(tmp_path_factory.mktemp("q35k") / "t", seed=5)


def _model(path, ops, mode="stash", dtype=torch.float32):
    model = Qwen35Target.from_dir(path, dtype, DEVICE, rollback=mode)
    model.step_ops = ops
    return model


def _ids(n, seed):
    return torch.randint(0, 511, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _grouped(runner, prompt, cont, groups):
    state = runner.new_state(prompt.shape[0] + cont.shape[0] + 1)
    runner.prefill(prompt, state)
    out, at = [], 0
    for g in groups:
        out.append(runner.step(cont[at:at + g], state.length, state)[0])
        at += g
    return torch.cat(out), state


def _same_state(a, b):
    assert a.length == b.length
    assert torch.equal(a.kv[:, :, :, :a.length], b.kv[:, :, :, :b.length])
    for x, y in zip([*a.conv, *a.rec], [*b.conv, *b.rec], strict=True):
        assert torch.equal(x, y)


def test_a_step_through_the_kernels_matches_the_torch_ops(target_dir):
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        out[name], _ = _grouped(StepRunner(_model(target_dir, ops), W), _ids(12, 0), _ids(W, 1), [W])
    ref, got = out["torch"], out["triton"]
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < LOGIT_TOL


@pytest.mark.exhaustive  # quick: test_kernel_step_grouping_and_one_rollback
@pytest.mark.parametrize("mode,dtype", [("stash", torch.float32), ("replay", torch.bfloat16)], ids=["stash-f32", "replay-bf16"])
def test_kernel_steps_are_grouping_invariant_and_roll_back_exactly(target_dir, mode, dtype):
    runner = StepRunner(_model(target_dir, TritonStepOps(), mode, dtype), W)
    p, cont = _ids(12, 2), _ids(W, 3)
    one, s_one = _grouped(runner, p, cont, [1] * W)
    for groups in ([W], [3, 5]):
        logits, state = _grouped(runner, p, cont, groups)
        assert torch.equal(logits, one), groups
        _same_state(state, s_one)
    for k in (0, 3, W):  # verify W rows, keep k of them, continue == running the k rows, continuing
        state = runner.new_state(40)
        runner.prefill(p, state)
        runner.step(cont, 12, state)
        state.rollback(12 + k)
        got, _ = runner.step(_ids(2, 4), state.length, state)
        fresh = runner.new_state(40)
        runner.prefill(p, fresh)
        if k:
            runner.step(cont[:k], 12, fresh)
        want, _ = runner.step(_ids(2, 4), fresh.length, fresh)
        assert torch.equal(got, want), k
        _same_state(state, fresh)


@pytest.mark.exhaustive  # quick: the kernel step against the torch ops, and its launches; groupings and rollback
def test_kernel_step_grouping_and_one_rollback(target_dir):  # over the torch ops in tests/engine/test_qwen3_5.py
    """The quick tier's share of the test above: through the kernels (stash rollback, f32), one
    step of W rows equals the same rows split 3 + 5, and verifying W rows then keeping 3 leaves
    the state a fresh run of those 3 rows leaves, bit for bit."""
    runner = StepRunner(_model(target_dir, TritonStepOps(), "stash", torch.float32), W)
    p, cont = _ids(12, 2), _ids(W, 3)
    whole, s_whole = _grouped(runner, p, cont, [W])
    split, s_split = _grouped(runner, p, cont, [3, W - 3])
    assert torch.equal(split, whole)
    _same_state(s_split, s_whole)
    state = runner.new_state(40)
    runner.prefill(p, state)
    runner.step(cont, 12, state)
    state.rollback(12 + 3)
    fresh = runner.new_state(40)
    runner.prefill(p, fresh)
    runner.step(cont[:3], 12, fresh)
    _same_state(state, fresh)
    assert torch.equal(runner.step(_ids(2, 4), state.length, state)[0],
                       runner.step(_ids(2, 4), fresh.length, fresh)[0])


@pytest.mark.exhaustive  # quick: the grouping/rollback check below and the hybrid's spec == plain over the torch ops
def test_speculative_equals_plain_with_the_kernels(target_dir, tmp_path):
    model = _model(target_dir, TritonStepOps(), "replay")
    prompt = _ids(9, 5).tolist()
    plain = greedy_reference(StepRunner(model, W), prompt, 10)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(-1, 1, 3), num_target_layers=5)
    engine = Engine.from_model(model, step_width=W)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    with engine.session(prompt, 10, arm, eos_ids=()) as session:
        assert session.run() == plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
def test_a_kernel_step_is_six_launches_a_deltanet_layer_six_an_attention_one(target_dir, monkeypatch):
    """The Triton path itself, counted (not inferred from the torch ops): every Triton launch of
    one fixed step, and the torch ops left around them (benchmarks/qwen3_5_step_ops.py's rule).
    The tiny target has 3 DeltaNet layers of 6 launches (two add + norms, the fused conv + gates,
    the recurrence, the gated norm, SiLU·mul; 7 while conv and gates were two launches) and 2
    attention layers of 6 (its two counted, the output gate in the second), plus the embedding gather with the
    first norm (one launch; two while apart);
    outside the kernels only the weight matmuls and the ring index (`positions % ring`). An op
    falling back to torch fails both the count and the torch-op check."""
    from triton.runtime.interpreter import InterpretedFunction

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "qwen3_5_step_ops.py"
    spec = importlib.util.spec_from_file_location("qwen3_5_step_ops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    launches: Counter = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.__name__] += 1
        with record_function(f"stepop::{self.__name__}"):  # outside the torch-op count
            return run(self, *args, **kwargs)

    model = _model(target_dir, TritonStepOps())
    runner = StepRunner(model, W)
    state = runner.new_state(40)
    runner.prefill(_ids(12, 0), state)
    ids, positions = _ids(W, 1), torch.arange(12, 12 + W, device=DEVICE)
    monkeypatch.setattr(InterpretedFunction, "run", counted)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.static_step(ids, positions, state)
    torch_ops = bench._torch_leaves(prof)
    n_layers = len(model.layers)
    n_gdn = sum(w.attn is None for w in model.layers)
    assert 0 < n_gdn < n_layers
    assert sum(launches.values()) == 1 + 6 * n_gdn + 6 * (n_layers - n_gdn), launches
    assert launches["_embed_kernel"] == 0, launches  # the gather in the first norm's launch
    assert launches["_output_gate_kernel"] == 0, launches  # gated in attention's combine launch
    assert launches["_gdn_conv_gates_kernel"] == n_gdn, launches  # one launch: conv, gates, record
    assert launches["_conv_silu_kernel"] == launches["_gdn_gates_kernel"] == 0, launches
    # (the logits' widening is a no-op in float32)
    assert {k: v for k, v in torch_ops.items() if k not in bench.GEMMS} == {"aten::remainder": 1}
    assert sum(v for k, v in torch_ops.items() if k in bench.GEMMS) == 4 * n_layers + 1


@pytest.mark.exhaustive  # interpreted steps; quick: tests/kernels/test_deltanet.py's one-launch restores
@pytest.mark.parametrize("mode", ["replay", "stash"])
def test_a_round_restored_in_one_launch_is_the_host_rollback(target_dir, mode):
    """`restore_round` through the kernels (one launch for the windows and the states of every
    DeltaNet layer: `gated_delta_restore`, or `stash_restore` in stash mode) and, in replay mode,
    the host rollback's graph body (the same op without live rows) leave the host's eager
    rollback's windows and states bit for bit: a ladder round keeping part of its window, all of
    it (replay: nothing restored, the step's own last live row), and a full-width verify keeping
    some rows. Planted: a restore told one row too many is caught."""
    runner = StepRunner(_model(target_dir, TritonStepOps(), mode, torch.bfloat16), W)
    prompt, block = _ids(9, 70), _ids(W, 71)

    def stepped(window=None):
        state = runner.new_state(40)
        runner.prefill(prompt, state)
        live = None if window is None else torch.tensor([window], dtype=torch.int32, device=DEVICE)
        with state.live_rows_from(live) if live is not None else contextlib.nullcontext():
            runner.model.static_step(block, torch.arange(state.length, state.length + W, device=DEVICE), state)
        return state, live

    def in_round(keep, window=None, rows=None):
        state, live = stepped(window)
        start = state.length
        rows = rows if rows is not None else (-1 if keep == W else keep)
        state.round_params.copy_(torch.tensor([start % state.ring, rows], dtype=torch.int32))
        state.restore_round(live)
        state.settled_on_device(start + keep)
        return state

    class Eager:  # the runtime's GraphCache, its capture and replay stood in for by a call
        def run(self, key, make, *args):
            make(*args)()

    def host(keep, graphed=False):
        state = runner.new_state(40)
        if graphed:  # the rollback through `_restore_body`, what a CUDA graph of it replays
            state._restore_graphs, state.graph_restores = Eager(), True
        runner.prefill(prompt, state)
        runner.step(block, state.length, state)
        state.rollback(state.length - W + keep)
        return state

    for window, keep in ((5, 3), (5, 5), (None, 6)):
        want = host(keep)
        _same_state(in_round(keep, window), want)
        if window is None and mode == "replay":
            _same_state(host(keep, graphed=True), want)
    with pytest.raises(AssertionError):
        _same_state(in_round(3, 5, rows=4), host(3))
