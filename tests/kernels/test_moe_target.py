"""The Qwen3-MoE target's fixed-width step through the Triton step ops (interpreter on CPU), the
MoE kernels in place: close to the torch ops' logits, a step's rows the same bits however the
rows are grouped into steps and after a verify + rollback, and a speculative session equal to
plain greedy."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.step_ops import TorchStepOps, TritonStepOps
from memra_cli.engine.models.qwen3_moe import Qwen3MoeTarget
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
from memra_kernels import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W = 8  # a small fixed width keeps the interpreter quick
# f32 relative L2 of the logits: the kernels sum in another order than torch's matmuls (a few
# f32 ulps a reduction, over 4 layers of 64-wide ones) and round exp differently; a wrong expert
# or weight moves the logits by O(1)
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moek") / "t", seed=3)


def _model(path, ops, dtype=torch.float32):
    model = Qwen3MoeTarget.from_dir(path, dtype, DEVICE)
    model.step_ops = ops
    return model


def _ids(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


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


def test_a_step_through_the_kernels_matches_the_torch_ops(target_dir, monkeypatch):
    calls = []
    real = moe.moe_swiglu
    monkeypatch.setattr(moe, "moe_swiglu", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        model = _model(target_dir, ops)
        out[name], _ = _grouped(StepRunner(model, W), _ids(12, 0), _ids(W, 1), [W])
    sparse = len(model.moe.sparse_layers)
    assert 0 < sparse < len(model.layers)
    assert calls == [12] * sparse + [W] * sparse  # the prefill's 12 rows and the step, on the kernels
    ref, got = out["torch"], out["triton"]
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < LOGIT_TOL


def test_kernel_step_grouping_and_rollback(target_dir):
    """Through the kernels: one step of W rows equals the same rows split 3 + 5, and verifying W rows then keeping 3 leaves the state (and the next step's logits) a
    fresh run of those 3 rows leaves, bit for bit."""
    runner = StepRunner(_model(target_dir, TritonStepOps()), W)
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


@pytest.mark.exhaustive  # quick: the grouping/rollback check above and test_qwen3_moe's arms over the torch ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_speculative_equals_plain_with_the_kernels(target_dir, tmp_path, dtype):
    model = _model(target_dir, TritonStepOps(), dtype)
    prompt = _ids(9, 5).tolist()
    plain = greedy_reference(StepRunner(model, W), prompt, 12)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(0, 2), num_target_layers=4)
    engine = Engine.from_model(model, step_width=W)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    with engine.session(prompt, 12, arm, eos_ids=()) as session:
        assert session.run() == plain
