"""The Qwen3-MoE target's fixed-width step through the Triton step ops (interpreter on CPU), the
MoE kernels in place: close to the torch ops' logits, a step's rows the same bits however the
rows are grouped into steps and after a verify + rollback, and a speculative session equal to
plain greedy."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.models.qwen3_moe import Qwen3MoeTarget
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
from memra_kernels import moe, moe_route

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
    for name in ("moe_swiglu", "moe_swiglu_add_rms_norm"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _n=name, _f=real, **kw: calls.append((_n, a[0].shape[0])) or _f(*a, **kw))
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        model = _model(target_dir, ops)
        out[name], _ = _grouped(StepRunner(model, W), _ids(12, 0), _ids(W, 1), [W])
    sparse = len(model.moe.sparse_layers)
    assert 0 < sparse < len(model.layers)
    # the prefill's 12 rows on the kernels, and the step's with the residual add and next norm in their launch
    assert calls == [("moe_swiglu", 12)] * sparse + [("moe_swiglu_add_rms_norm", W)] * sparse
    ref, got = out["torch"], out["triton"]
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < LOGIT_TOL


@pytest.mark.exhaustive  # a whole target through Triton's interpreter, three ways: the quick tier keeps its one-step check
def test_kernel_step_grouping_and_rollback(target_dir):
    """Through the kernels: one step of W rows equals the same rows split 3 + 5, and verifying
    W rows then keeping 3 leaves the state (and the next step's logits) a fresh run of those 3
    rows leaves, bit for bit."""
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


# --------------------------------------------------------------------------- graphs, stood in for on the CPU


class MoeKernelOps(TorchStepOps):
    """The torch step ops with the MoE kernels in the twins' place (the Triton seam's choices for
    the experts, their add + norm (Qwen3.5 MoE's with its gated shared expert, Gemma 4's sandwich
    norms) and the routing),
    so a session's other ops stay quick on the interpreter."""

    moe_swiglu = TritonStepOps.moe_swiglu
    moe_swiglu_add_rms_norm = TritonStepOps.moe_swiglu_add_rms_norm
    moe_swiglu_shared_add_rms_norm_1p = TritonStepOps.moe_swiglu_shared_add_rms_norm_1p
    moe_gemma_add_norm = TritonStepOps.moe_gemma_add_norm
    router_route = TritonStepOps.router_route
    _routed_for = TritonStepOps._routed_for  # the router's ranked list, handed to the expert launch
    _routed = None
    _moe, _moe_route = moe, moe_route


def _tensors(out):
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out for t in _tensors(item)]


@pytest.fixture
def eager_graphs(monkeypatch):
    """`cuda_graphs.capture` swapped for an eager stand-in (tests/engine/test_step_width.py's):
    replay reruns the body and copies its results into the first run's outputs; both runs refuse
    host reads of device values (`NoHostReads`), as a capture does. The list records captures."""
    import importlib.util
    from pathlib import Path

    from memra_cli.engine.runtime import cuda_graphs

    path = Path(__file__).resolve().parents[1] / "engine" / "host_reads.py"
    spec = importlib.util.spec_from_file_location("host_reads", path)
    host_reads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_reads)
    captures = []

    def capture(fn, device, pool=None):
        with host_reads.NoHostReads():
            out = fn()

        class Replay:
            def replay(self):
                with host_reads.NoHostReads():
                    fresh = fn()
                for mine, new in zip(_tensors(out), _tensors(fresh)):
                    mine.copy_(new)

        captures.append(fn)
        return Replay(), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    return captures


def _graphed_on_cpu(model, round_graphs: bool) -> Engine:
    """What `Engine.from_model(model, step_width=W, cuda_graphs=True, draft_graphs=True)` builds
    on CUDA (a runner refuses graphs off CUDA, so they are switched on after construction)."""
    runner = StepRunner(model, W)
    runner.cuda_graphs = True
    model.ensure_positions(runner._rows(model.cfg.max_position_embeddings))
    return Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                  round_graphs=round_graphs)


@pytest.mark.exhaustive  # whole graphed sessions through Triton's interpreter: the quick tier checks one kernel step
@pytest.mark.parametrize("round_graphs", [False, True], ids=["step-graphs", "round-graphs"])
def test_graphed_sessions_with_the_kernels_read_nothing_on_the_host(target_dir, tmp_path, eager_graphs, round_graphs):
    """The family declares itself capturable: with the MoE kernels, a graphed prefill (its 64-row
    bucket: two row tiles), graphed steps or whole rounds (queued, settled on the device), and
    the drafter's graphs run
    without a host read, and the session equals plain greedy over eager steps."""
    assert Qwen3MoeTarget.supports_cuda_graphs
    prompt = _ids(9, 5).tolist()
    plain = greedy_reference(StepRunner(_model(target_dir, MoeKernelOps()), W), prompt, 12)
    engine = _graphed_on_cpu(_model(target_dir, MoeKernelOps()), round_graphs)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(0, 2), num_target_layers=4)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    with engine.session(prompt, 12, arm, eos_ids=()) as session:
        assert session.run() == plain
        keys = {k[0] for k in session.cache.graphs}
    assert keys == ({"prefill", "spec-chain"} if round_graphs else {"prefill", "step"}), keys  # what was captured
    assert eager_graphs
    assert greedy_reference(engine.runner, prompt, 12) == plain  # plain decoding through the graphs too


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16], ids=str)
def test_a_plain_round_routes_its_one_row_and_sizes_the_expert_grid_by_it(target_dir, eager_graphs, monkeypatch,
                                                                          dtype):
    """Plain decoding's round body reads row 0 only (`reading_rows(1)`): its routing treats the
    other rows as padding on the host too, so each expert launch gets the router's list with at
    most k experts (`max_routed`, the grid's ranks) while the speculative and prefill launches
    get none; the stream equals plain greedy over eager fixed steps (no bound) with the same
    kernels, in float32 and bfloat16."""
    seen = []
    real = moe._expert_lines
    monkeypatch.setattr(moe, "_expert_lines", lambda *a: seen.append(a[8]) or real(*a))
    prompt = _ids(9, 6).tolist()
    plain = greedy_reference(StepRunner(_model(target_dir, MoeKernelOps(), dtype), W), prompt, 6)
    assert set(seen) == {None}
    seen.clear()
    model = _model(target_dir, MoeKernelOps(), dtype)
    engine = _graphed_on_cpu(model, round_graphs=True)
    with engine.session(prompt, 6, engine.arm(ArmConfig(mode="off")), eos_ids=()) as session:
        assert session.run() == plain
        assert ("plain-chain", W) in session.cache.graphs
    k = model.moe.top_k
    assert k in seen and set(seen) <= {None, k}, seen  # the prefill's launches: no bound


def _other_family(name: str, root):
    """A tiny Qwen3.5 MoE hybrid or Gemma 4 MoE target (8 experts, top-2) and its drafter's taps."""
    if name == "qwen3_5_moe":
        from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget
        from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

        return Qwen35MoeTarget.from_dir(make_tiny_qwen35(root / name, moe=(8, 2, 32), intermediate=48)), (1, 3)
    from memra_cli.engine.models.gemma4_moe import Gemma4MoeTarget
    from memra_cli.tiny.gemma4 import make_tiny_gemma4

    return Gemma4MoeTarget.from_dir(make_tiny_gemma4(root / name, moe=(8, 2, 24))), (-1, 1, 3)


@pytest.mark.exhaustive  # whole plain sessions through round graphs on the interpreter
@pytest.mark.parametrize("family", ["qwen3_5_moe", "gemma4_moe"])
def test_the_other_families_plain_rounds_route_their_one_row(tmp_path, eager_graphs, monkeypatch, family):
    """The Qwen3.5 MoE hybrid and Gemma 4's MoE block take the plain round's bound too: each
    expert launch of a plain session through round graphs gets at most k experts' ranks, and
    the stream equals plain greedy over eager fixed steps with the same kernels."""
    seen = []
    real = moe._expert_lines
    monkeypatch.setattr(moe, "_expert_lines", lambda *a: seen.append(a[8]) or real(*a))
    model, _ = _other_family(family, tmp_path)
    model.step_ops = MoeKernelOps()
    prompt = _ids(9, 7).tolist()
    plain = greedy_reference(StepRunner(model, W), prompt, 5)
    seen.clear()
    engine = _graphed_on_cpu(model, round_graphs=True)
    with engine.session(prompt, 5, engine.arm(ArmConfig(mode="off")), eos_ids=()) as session:
        assert session.run() == plain
    k = model.moe.top_k
    assert k in seen and set(seen) <= {None, k}, seen


@pytest.mark.exhaustive  # whole graphed sessions through Triton's interpreter: the families' own tests graph the twin
@pytest.mark.parametrize("family", ["qwen3_5_moe", "gemma4_moe"])
def test_the_other_families_graphed_with_the_kernels_read_nothing_on_the_host(tmp_path, eager_graphs, family):
    """The Qwen3.5 MoE hybrid (SwiGLU experts) and Gemma 4's MoE block (GELU-tanh experts) with
    the MoE kernels: graphed steps and the drafter's graphs read nothing on the host, and the
    session equals plain greedy over eager steps with the same kernels."""
    model, taps = _other_family(family, tmp_path)
    assert type(model).supports_cuda_graphs
    model.step_ops = MoeKernelOps()
    prompt = _ids(9, 5).tolist()
    plain = greedy_reference(StepRunner(model, W), prompt, 12)
    engine = _graphed_on_cpu(model, round_graphs=False)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=taps,
                            num_target_layers=model.n_layers)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    with engine.session(prompt, 12, arm, eos_ids=()) as session:
        assert session.run() == plain
        assert "step" in {k[0] for k in session.cache.graphs}
    assert eager_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("round_graphs", [False, True], ids=["step-graphs", "round-graphs"])
@pytest.mark.parametrize("vt", ["ladder", "priced"])  # priced: the fitted window on the routed cost, settled on the device
def test_on_the_gpu_graphed_sessions_equal_plain_greedy(target_dir, tmp_path, round_graphs, vt):
    """On CUDA with the kernels and graphs on (the family's default there), in bfloat16: a
    speculative session, and a plain one (with round graphs, the plain round that routes its one
    row alone), equal plain greedy over eager steps with the same kernels."""
    from memra_cli.engine.layers.step_ops import select_step_ops

    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(0, 2), num_target_layers=4,
                            dtype=torch.bfloat16)
    ref_model = Qwen3MoeTarget.from_dir(target_dir, torch.bfloat16, "cuda")
    ref_model.step_ops, _ = select_step_ops(ref_model.device)
    model = Qwen3MoeTarget.from_dir(target_dir, torch.bfloat16, "cuda")
    model.step_ops, _ = select_step_ops(model.device)
    engine = Engine.from_model(model, step_width=W, cuda_graphs=True, draft_graphs=True, round_graphs=round_graphs)
    settings = PolicySettings(vt="priced", vt_cost="routed") if vt == "priced" else PolicySettings()
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash", settings=settings))
    off = engine.arm(ArmConfig(mode="off"))  # plain decoding: with round graphs, the one-row plain round
    for seed in range(3):
        ids = _ids(9 + 11 * seed, 80 + seed).tolist()
        plain = greedy_reference(StepRunner(ref_model, W), ids, 40)
        with engine.session(ids, 40, arm, eos_ids=()) as session:
            assert session.run() == plain, seed
            assert session.graphed_rounds == round_graphs
        with engine.session(ids, 40, off, eos_ids=()) as session:
            assert session.run() == plain, seed
