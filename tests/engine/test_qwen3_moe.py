"""Qwen3MoeTarget against transformers' Qwen3MoeForCausalLM, the MoE op's row invariance (with
planted breakage), speculative arms over an MoE target, and the loader's refusals.

Tolerance: float32 on the CPU, a few layers of 64-wide reductions; logits differ from HF's only
by summation order (BLAS blocking, our fused q/k/v and gate/up), each op's error ~ a few f32 ulps
(6e-8 relative) growing with depth, so 1e-5 relative leaves two orders of margin while a wrong
expert or weight moves the logits by O(1).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.errors import CheckpointError, ConfigError, PolicyError, UnsupportedError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers import moe
from memra_cli.engine.models.base import load_target
from memra_cli.engine.models import qwen3_moe
from memra_cli.engine.models.qwen3_moe import Qwen3MoeTarget
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.spec.priced import StepCost
from memra_cli.tiny.draft import make_tiny_draft

import spec_arms
from spec_arms import (RouteRecorder, assert_arm_equals_plain, assert_groupings_equal, hf_greedy, make_drafts,
                       rel_err, write_variant)

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB, EXPERTS, TOP_K = 512, 8, 2
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
             num_experts_per_tok=TOP_K, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
             max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=VOCAB - 4)


def make_hf(seed: int = 0, **over):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SHAPE, **over})).eval()
    with torch.no_grad():
        for p in model.parameters():  # wide weights: routing decisions and logits far from ties
            p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(directory in the per-expert layout transformers saves, the HF model)."""
    hf = make_hf()
    out = tmp_path_factory.mktemp("moe") / "target"
    hf.save_pretrained(out)
    return out, hf


@pytest.fixture(scope="module")
def target(pair):
    return Qwen3MoeTarget.from_dir(pair[0])


prompt = partial(spec_arms.prompt, top=VOCAB - 8)


def test_saved_layout_is_per_expert_and_registry_dispatches(pair):
    names = load_file(str(pair[0] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # mlp_only_layers: a dense layer
    assert type(load_target(pair[0])) is Qwen3MoeTarget


@pytest.mark.parametrize("n", [1, 9, 70])
def test_logits_match_transformers(pair, target, n):
    ids = prompt(n, n)
    cache = target.new_state(n)
    hidden, _ = target.forward(torch.tensor(ids), 0, cache)
    with torch.no_grad():
        ref = pair[1](torch.tensor([ids])).logits[0]
    assert rel_err(target.logits(hidden), ref) <= 1e-5


def test_stacked_layout_loads_the_same_model(pair, target, tmp_path):
    """transformers 5 holds experts as [E, 2I, h] / [E, h, I] tensors: a checkpoint of its state
    dict loads to the same weights as the per-expert one."""
    state = {k: v.contiguous() for k, v in pair[1].state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((pair[0] / "config.json").read_text())
    stacked = Qwen3MoeTarget.from_dir(tmp_path)
    for a, b in zip(stacked.layers, target.layers):
        if a.experts is not None:
            assert torch.equal(a.experts.w_gate_up, b.experts.w_gate_up)
            assert torch.equal(a.experts.w_down, b.experts.w_down)


def test_greedy_256_tokens_equal_transformers(pair, target):
    ids = prompt(11, 5)
    ref = hf_greedy(pair[1], ids, 256, VOCAB)
    assert greedy_reference(StepRunner(target, 16), ids, 256) == ref
    assert greedy_reference(StepRunner(target), ids, 256) == ref  # variable width too


def test_fixed_width_logits_do_not_depend_on_the_grouping_over_steps_that_share_and_split_experts(target,
                                                                                                   monkeypatch):
    rec = RouteRecorder(qwen3_moe.route)
    monkeypatch.setattr(qwen3_moe, "route", rec)
    assert_groupings_equal(target, VOCAB, rec)


# --------------------------------------------------------------------------- the MoE op


def weights(seed=0, e=EXPERTS, h=32, i=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) * 0.3,
            torch.randn(e, h, i, generator=g) * 0.3)


def run_op(x, router, gate_up, down, route=moe.route, op=moe.moe_swiglu):
    w, ids = route(x, router, TOP_K, True)
    return op(x, w, ids, gate_up, down)


def invariance_violations(route=moe.route, op=moe.moe_swiglu) -> int:
    """Rows whose output is not the same bits alone (padded with zero rows to the same width)
    as beside other rows, at the same step width."""
    router, gate_up, down = weights()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    together = run_op(x, router, gate_up, down, route, op)
    bad = 0
    for r in range(16):
        alone = torch.zeros_like(x)
        alone[r] = x[r]
        bad += not torch.equal(run_op(alone, router, gate_up, down, route, op)[r], together[r])
    return bad


def reference_rows(x, router, gate_up, down):
    """One row at a time, experts in the row's own ascending order: the naive definition."""
    out = []
    for row in x:
        p = torch.softmax(router @ row, -1)
        top = sorted(range(len(p)), key=lambda e: (-p[e].item(), e))[:TOP_K]
        wsum = sum(p[e] for e in top)
        acc = torch.zeros_like(row)
        for e in sorted(top):
            g, u = (gate_up[e] @ row).chunk(2)
            acc = acc + (down[e] @ (torch.nn.functional.silu(g) * u)) * (p[e] / wsum)
        out.append(acc)
    return torch.stack(out)


def test_op_is_row_invariant_and_matches_the_naive_definition():
    router, gate_up, down = weights()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    assert invariance_violations() == 0
    # f32, 32- and 16-long dots: a few ulps apart from the per-row matvecs
    assert rel_err(run_op(x, router, gate_up, down), reference_rows(x, router, gate_up, down)) < 1e-5


def test_planted_wrong_expert_index_is_caught():
    router, gate_up, down = weights()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def off_by_one(x, router, k, normalize):
        w, ids = moe.route(x, router, k, normalize)
        return w, (ids + 1) % EXPERTS

    assert rel_err(run_op(x, router, gate_up, down, off_by_one), reference_rows(x, router, gate_up, down)) > 0.1


def test_topk_ties_break_to_the_lower_index_and_a_planted_reversal_is_caught():
    probs = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert moe.topk_lowest_index(probs, 2)[1].tolist() == [[1, 2], [0, 1]]

    def higher_index_first(p, k):  # the planted bug: ties go to the higher index
        flipped = p.flip(-1)
        v, i = moe.topk_lowest_index(flipped, k)
        return v, p.shape[-1] - 1 - i

    assert higher_index_first(probs, 2)[1].tolist() != [[1, 2], [0, 1]]
    # through the router: equal router rows make exact ties, the lower index must win
    router = torch.zeros(4, 8)
    assert moe.route(torch.randn(3, 8), router, 2, True)[1].tolist() == [[0, 1]] * 3


def test_planted_row_order_combine_is_caught():
    """A combine that keeps one running f32 sum across the step's rows (a prefix-sum segmented
    reduce) gives each row acc_after - acc_before: equal in exact arithmetic, but its rounding
    depends on the rows before it, which the invariance check sees."""

    def running_sum_combine(x, w, ids, gate_up, down):
        per_row = moe.moe_swiglu(x, w, ids, gate_up, down)
        running = torch.cumsum(per_row * 1000.0 + 1.0, dim=0)
        prev = torch.cat([torch.zeros_like(running[:1]), running[:-1]])
        return (running - prev - 1.0) / 1000.0

    assert invariance_violations(op=running_sum_combine) > 0


# --------------------------------------------------------------------------- speculative arms


SPARK = dict(markov_rank=16, confidence="markov")
SPEC_PROMPTS = [prompt(9, 3), prompt(14, 8)]
SPEC_NEW = 64


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    return make_drafts(tmp_path_factory.mktemp("drafts"), target, SPEC_PROMPTS, SPEC_NEW, taps=(0, 2), vocab=VOCAB)


@pytest.mark.parametrize("mode,vt", [("dflash", "ladder"), ("dspark", "ladder"), ("dspark", "confidence"),
                                     ("dspark", "confidence-slot"), ("dspark", "priced"), ("headless", "priced"),
                                     ("dspark", "priced-routed"), ("headless", "priced-routed")])
def test_speculative_arms_equal_plain_greedy(target, drafts, mode, vt):
    assert_arm_equals_plain(target, drafts, mode, vt, SPEC_PROMPTS, SPEC_NEW)


def test_graphed_prefill_padding_rows_read_no_experts_and_a_planted_unmasked_bucket_is_caught(target, monkeypatch):
    """The prefill graph's bucket rows past the prompt route to no expert: it counts what an eager
    prefill of the prompt counts; planted, a capture of the plain forward (every bucket row
    routed) counts more."""
    spec_arms.eager_capture(monkeypatch)
    spec_arms.assert_graphed_prefill_padding_reads_no_experts(target, VOCAB)
    monkeypatch.setattr(Qwen3MoeTarget, "padded_forward", lambda self, ids, start, state, taps, live:
                        self.forward(ids, start, state, taps))  # the live count dropped
    with pytest.raises(AssertionError, match="graphed prefill counted"):
        spec_arms.assert_graphed_prefill_padding_reads_no_experts(target, VOCAB)


def test_padding_rows_run_no_experts_and_a_planted_unmasked_step_is_caught(target, monkeypatch):
    """models/experts.py `LiveRouting`: a plain step's 15 padding rows add no experts, and a live
    row's bits do not depend on the live count; with the padding mask planted away (every row
    routed, as a step without the live count would) the same check fails."""
    spec_arms.assert_padding_rows_run_no_experts(target, VOCAB)
    ops = type(target.step_ops)()
    monkeypatch.setattr(ops, "router_route", lambda x, router, k, norm, live=None, counts=None, scale=None, bound=None:
                        moe.moe_route_ref(ops.linear(x, router), k, norm, None, counts, scale))  # the live rows ignored
    monkeypatch.setattr(target, "step_ops", ops)
    with pytest.raises(AssertionError, match="one-live-row calls"):
        spec_arms.assert_padding_rows_run_no_experts(target, VOCAB)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("variant,error,words", [
    ({"config": {"num_experts_per_tok": 9}}, ConfigError, "num_experts_per_tok 9 is more than num_experts 8"),
    ({"config": {"hidden_act": "gelu"}}, UnsupportedError, "hidden_act 'gelu' is not implemented (expected 'silu')"),
    ({"config": {"mlp_only_layers": [4]}}, ConfigError, "key 'mlp_only_layers' must be a list of layer ids in [0, 4)"),
    ({"drop": "model.layers.2.mlp.experts.5.up_proj.weight"}, CheckpointError,
     "'model.layers.2.mlp.experts.5.up_proj.weight' is missing"),
    ({"reshape": "model.layers.0.mlp.gate.weight"}, CheckpointError,
     "'model.layers.0.mlp.gate.weight' has shape [7, 64], expected shape [8, 64]"),
])
def test_bad_input_is_refused_in_one_line(pair, tmp_path, variant, error, words):
    bad = write_variant(pair[0], tmp_path / "bad", **variant)
    with pytest.raises(error) as info:
        Qwen3MoeTarget.from_dir(bad)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_tiny_maker_writes_a_target_transformers_reads_the_same_and_a_drafter_for_it(tmp_path):
    from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe

    out = make_tiny_qwen3_moe(tmp_path / "moe")
    ours = Qwen3MoeTarget.from_dir(out)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = prompt(20, 7)
    hidden, _ = ours.forward(torch.tensor(ids), 0, ours.new_state(20))
    with torch.no_grad():
        assert rel_err(ours.logits(hidden), hf(torch.tensor([ids])).logits[0]) <= 1e-5
    draft = make_tiny_draft(tmp_path / "dflash", "zlab")
    engine = Engine.from_model(ours, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    assert engine.session(ids, 40, arm, eos_ids=()).run() == greedy_reference(StepRunner(ours, 16), ids, 40)


# --------------------------------------------------------------------------- the priced window


def test_priced_window_is_named_with_its_cost(target, drafts):
    engine = Engine.from_model(target, step_width=16)
    arm = engine.arm(ArmConfig(draft=drafts["dspark"], mode="dspark", settings=PolicySettings(vt="priced")))
    assert arm.program.window.kind == "priced" and arm.program.window.cost.num_experts == EXPERTS
    line = arm.receipts.lines()[1]
    assert "verify-window=Priced{experts=8,top_k=2}" in line and "cost(1)=" in line
    # slots that each survive with p = 0.5: a flat cost verifies them all, this target's expert
    # bytes (a quarter of a one-row step's, the lm_head most of the rest) make it narrower
    window, cap = arm.program.window, arm.program.verify_cap
    flat = dataclasses.replace(window, cost=StepCost(fixed_bytes=1.0))
    assert flat.size_window([0.0] * (cap - 1), cap) == cap > window.size_window([0.0] * (cap - 1), cap)


def test_priced_window_on_a_dense_target_is_the_confidence_slot_window_and_says_so(tmp_path):
    from memra_cli.tiny.target import make_tiny_qwen3

    dense = load_target(make_tiny_qwen3(tmp_path / "dense"))
    draft = make_tiny_draft(tmp_path / "spark", "deepspec", **SPARK)
    engine = Engine.from_model(dense, step_width=16)
    priced = engine.arm(ArmConfig(draft=draft, mode="dspark", settings=PolicySettings(vt="priced", tau="0.4")))
    slot = engine.arm(ArmConfig(draft=draft, mode="dspark", settings=PolicySettings(vt="confidence-slot", tau="0.4")))
    assert priced.program == slot.program
    assert "priced -> confidence-slot (flat step cost" in priced.receipts.lines()[1]
    ids = prompt(7, 2)
    a, b = engine.session(ids, 40, priced, eos_ids=()), engine.session(ids, 40, slot, eos_ids=())
    assert a.run() == b.run() and a.stats.accept_hist == b.stats.accept_hist



@pytest.mark.parametrize("mode,cost", [  # quick: the fitted window on the routed cost; the others exhaustive
    ("headless", "routed"), pytest.param("headless", None, marks=pytest.mark.exhaustive),
    pytest.param("dspark", "routed", marks=pytest.mark.exhaustive),
    pytest.param("dflash", "routed", marks=pytest.mark.exhaustive)])
def test_priced_arms_equal_plain_greedy_in_bfloat16(pair, drafts, mode, cost):
    """The priced windows (the ladder's prior, the routed cost) in bfloat16: fixed-width steps
    keep speculative == plain greedy bit for bit whatever the window verifies."""
    model = Qwen3MoeTarget.from_dir(pair[0], torch.bfloat16)
    engine = Engine.from_model(model, step_width=16)
    arm = engine.arm(ArmConfig(draft=drafts[mode], mode="dflash" if mode == "dflash" else "dspark",
                               settings=PolicySettings(vt="priced", vt_cost=cost)))
    ids = SPEC_PROMPTS[1]
    assert engine.session(ids, 40, arm, eos_ids=()).run() == greedy_reference(StepRunner(model, 16), ids, 40)


def test_priced_window_without_a_confidence_head_runs_on_the_accepted_runs_and_says_so(target, drafts):
    engine = Engine.from_model(target, step_width=16)
    for mode, draft, why in (("dflash", "dflash", "no accept-rate head"), ("dspark", "headless", "no accept-rate head"),
                             ("dflash", "dspark", "the dflash program reads no accept-rate head")):
        arm = engine.arm(ArmConfig(draft=drafts[draft], mode=mode, settings=PolicySettings(vt="priced")))
        window = arm.program.window
        assert (window.kind, window.survival, window.is_confidence) == ("priced", "accepted-runs", False)
        line = arm.receipts.lines()[1]
        assert "verify-window=Priced{experts=8,top_k=2,survival=accepted-runs}" in line
        assert f"survival fitted to the session's accepted runs ({why})" in line and "cost=shape (MEMRA_DSPARK_VT_COST unset)" in line
        assert arm.receipts.as_json()["verify_window"] == {"policy": "priced", "tau": None, "survival": "accepted-runs",
                                                           "cost_model": "shape"}
    # the carried window: the priced one over the fitted survival, wider after long runs
    cap = arm.program.verify_cap
    assert window.next_window(0, cap, runs=(60, 2)) > window.next_window(0, cap, runs=(2, 20)) >= 2


def test_priced_dflash_on_a_dense_target_is_the_ladder_and_says_so(tmp_path):
    from memra_cli.tiny.target import make_tiny_qwen3

    dense = load_target(make_tiny_qwen3(tmp_path / "dense"))
    draft = make_tiny_draft(tmp_path / "zlab", "zlab")
    engine = Engine.from_model(dense, step_width=16)
    priced = engine.arm(ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(vt="priced")))
    ladder = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    assert priced.program == ladder.program
    assert "priced -> ladder (flat step cost" in priced.receipts.lines()[1]
    routed = engine.arm(ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(vt="priced", vt_cost="routed")))
    assert routed.program == ladder.program and "MEMRA_DSPARK_VT_COST has nothing to price" in routed.receipts.lines()[1]


def zero_routers(model):
    """Every sparse layer's router zeroed: all experts tie and every token routes to experts
    0..k-1 (the lower index wins), the most correlated routing there is."""
    for layer in model.layers:
        if layer.experts is not None:
            layer.experts.router.zero_()
    return model


def test_routed_cost_measures_the_prompt_union_and_says_which_model(pair, target, drafts):
    engine = Engine.from_model(target, step_width=16)
    arm = engine.arm(ArmConfig(draft=drafts["headless"], mode="dspark",
                               settings=PolicySettings(vt="priced", vt_cost="routed")))
    assert "cost=routed (MEMRA_DSPARK_VT_COST set)" in arm.receipts.lines()[1]
    assert arm.receipts.as_json()["verify_window"]["cost_model"] == "routed"
    cap, shape = arm.program.verify_cap, arm.program.window.cost
    ids = prompt(40, 1)
    session = engine.session(ids, 8, arm, eos_ids=())
    session.run()
    got = session.stats.window_cost
    assert got["model"] == "routed" and "routing of 40 tokens over 3 sparse layers" in got["why"]
    assert len(got["experts_per_layer"]) == cap and got["experts_per_layer"][0] == TOP_K
    # random routers on random tokens: near independent routing, never above the union's bound
    assert all(TOP_K <= u <= shape.expected_union(v) + 1.0 for v, u in enumerate(got["experts_per_layer"], 1))
    assert session.stats.as_json()["window_cost"] == got
    # a prompt shorter than the cap: no window that wide to measure, the shape model prices it
    short = engine.session(ids[: cap - 1], 8, arm, eos_ids=())
    short.run()
    assert short.stats.window_cost["model"] == "shape" and "routed -> shape" in short.stats.window_cost["why"]
    # routers rigged so every token shares its experts: the union stays k, so the routed window
    # opens to the cap where the shape model's stays narrow
    rigged = zero_routers(Qwen3MoeTarget.from_dir(pair[0]))
    engine = Engine.from_model(rigged, step_width=16)
    by_cost = {}
    for cost in ("shape", "routed"):
        arm = engine.arm(ArmConfig(draft=drafts["headless"], mode="dspark",
                                   settings=PolicySettings(vt="priced", vt_cost=cost)))
        session = engine.session(ids, 24, arm, eos_ids=())
        assert session.run() == greedy_reference(StepRunner(rigged, 16), ids, 24)
        by_cost[cost] = session
    assert by_cost["routed"].stats.window_cost["experts_per_layer"] == [float(TOP_K)] * cap
    assert by_cost["routed"].cost.expected_union(cap) < by_cost["routed"].program.window.cost.expected_union(cap)
    no_runs_yet = {c: s.program.window.next_window(0, cap, s.cost) for c, s in by_cost.items()}  # survival 1/2, 1/4, ...
    assert no_runs_yet["routed"] == cap > no_runs_yet["shape"]
    rows = {c: s.stats.drafted / s.stats.rounds for c, s in by_cost.items()}
    assert rows["routed"] > rows["shape"]


@pytest.mark.parametrize("settings,words", [
    (dict(vt="priced", vt_cost="measured"), "vt_cost='measured': unknown step-cost model (expected shape|routed)"),
    (dict(vt="ladder", vt_cost="routed"), "vt_cost='routed' prices the priced window only; set vt='priced'"),
    (dict(vt_cost="shape"), "vt_cost='shape' prices the priced window only; set vt='priced'"),
])
def test_a_cost_model_is_refused_by_name(target, drafts, settings, words):
    engine = Engine.from_model(target, step_width=16)
    with pytest.raises(PolicyError) as info:
        engine.arm(ArmConfig(draft=drafts["headless"], mode="dspark", settings=PolicySettings(**settings)))
    assert str(info.value) == words


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """`cuda_graphs.capture` swapped for spec_arms' eager stand-in (no host reads; the MoE twin runs
    every expert inside a capture)."""
    return spec_arms.eager_capture(monkeypatch)


@pytest.mark.parametrize("draft,cost", [  # quick: the fitted window on the routed cost; the others exhaustive
    ("headless", "routed"), pytest.param("dspark", None, marks=pytest.mark.exhaustive),
    pytest.param("dflash", None, marks=pytest.mark.exhaustive)])
def test_priced_rounds_settle_on_the_device_as_the_host_does(pair, drafts, stand_in_graphs, draft, cost):
    """With round graphs (the CPU stand-in) the priced window is settled on the device
    (memra_kernels.settle's priced kinds over the session's cost table): the stream equals plain
    greedy, and the rounds are those of the host-settled session (the same windows, the same
    accepted runs), queued one ahead or not."""
    graphed = spec_arms.graphed_on_cpu(Qwen3MoeTarget.from_dir(pair[0]), 16, round_graphs=True)
    eager = Engine.from_model(Qwen3MoeTarget.from_dir(pair[0]), step_width=16)
    settings = PolicySettings(vt="priced", vt_cost=cost)
    mode = "dflash" if draft == "dflash" else "dspark"
    ids = prompt(20, 4)
    plain = greedy_reference(StepRunner(eager.target, 16), ids, 48)
    host = eager.session(ids, 48, eager.arm(ArmConfig(draft=drafts[draft], mode=mode, settings=settings)), eos_ids=())
    assert host.run() == plain and not host.graphed_rounds
    arm = graphed.arm(ArmConfig(draft=drafts[draft], mode=mode, settings=settings))
    for pipelined in (True, False):
        graphed.pipelined = pipelined
        with graphed.session(ids, 48, arm, eos_ids=()) as session:
            assert session.graphed_rounds and session.run() == plain
            assert "spec-chain" in {k[0] for k in session.cache.graphs}
        assert (session.stats.rounds, session.stats.accept_hist, session.stats.drafted) == \
            (host.stats.rounds, host.stats.accept_hist, host.stats.drafted)
    assert (host.stats.window_cost is None) == (cost is None)


# --------------------------------------------------------------------------- the expert counter


def test_the_expert_counter_counts_on_the_device_and_not_in_a_graphs_warm_up(monkeypatch):
    """layers/moe.py `ExpertReads` (every MoE family's): a call and its distinct experts, added
    without a host read; nothing inside `not_counted`, which `cuda_graphs.capture` holds over its
    two warm-up runs (here with torch.cuda's stream and graph calls stood in for, so the CPU runs
    the capture's code: the recorded run counts, as its replays will)."""
    import contextlib
    import types

    from host_reads import NoHostReads
    from memra_cli.engine.runtime import cuda_graphs

    reads = moe.ExpertReads(EXPERTS, torch.device("cpu"))
    with NoHostReads():
        reads.count(torch.tensor([[3, 1], [1, 5]]))
        with moe.not_counted():
            reads.count(torch.tensor([[0, 2]]))
    assert reads.snapshot() == (1, 3)
    fake = types.SimpleNamespace(Stream=lambda device: types.SimpleNamespace(wait_stream=lambda s: None),
                                 current_stream=lambda device: types.SimpleNamespace(wait_stream=lambda s: None),
                                 stream=lambda s: contextlib.nullcontext(), CUDAGraph=lambda: "graph",
                                 graph=lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(cuda_graphs.torch, "cuda", fake)
    runs = []
    graph, _ = cuda_graphs.capture(lambda: runs.append(1) or reads.count(torch.tensor([[7, 6]])), "cpu")
    assert len(runs) == 3 and reads.snapshot() == (2, 5)  # two warm-ups uncounted, the captured run counted
