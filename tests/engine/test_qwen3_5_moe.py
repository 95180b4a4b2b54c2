"""Qwen35MoeTarget (the Qwen3.5 hybrid with routed experts and a gated shared expert) against
transformers' Qwen3_5MoeForCausalLM, its layouts, speculative arms over it, and its refusals.

- HF parity (CPU float32, eager attention, HF's torch DeltaNet): tiny random `qwen3_5_moe_text`
  checkpoints from `memra_cli.tiny.qwen3_5` (per-expert layout, as published and as transformers
  saves it), loaded by `from_pretrained`: prompt logits, and greedy streams vs `generate` over
  16-row steps whose rows share experts and steps whose rows do not. The multimodal layout and
  the stacked expert layout (transformers' state dict) load the same weights.
- Tolerance: ours and HF's run the same float32 ops; only the summation order may differ (BLAS
  blocking per CPU, our fused projections), so the bound is fp32_bounds' reordering bound over
  the chained reductions of every layer (mixer, router, experts and their k-term combine, shared
  expert) and the final norm and lm_head. Routing is compared exactly: every row's experts, in
  order, are those transformers' router picked.
- Speculative arms (DFlash ladder, DSpark priced) == plain greedy; refusals: one line each.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors.torch import save_file

from memra_cli.engine.api import resolve_cuda_graphs
from memra_cli.engine.errors import CheckpointError, ConfigError, UnsupportedError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models import qwen3_5_moe
from memra_cli.engine.models.base import load_target, target_family
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.priced import step_cost_of
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

import spec_arms
from fp32_bounds import layer_reductions, reorder_bound
from spec_arms import (RouteRecorder, assert_arm_equals_plain, assert_graphed_session_equals_plain,
                       assert_groupings_equal, assert_session_equals_plain,
                       eager_capture, hf_greedy, hf_logits_and_routes, make_drafts, rel_err, write_variant)

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB, EXPERTS, TOP_K, MOE_INTER, SHARED = 512, 8, 2, 32, 48
MOE = (EXPERTS, TOP_K, MOE_INTER)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35moe")
    return {layout: make_tiny_qwen35(root / layout, layout=layout, moe=MOE, intermediate=SHARED)
            for layout in ("text", "multimodal")}


@pytest.fixture(scope="module")
def target(dirs):
    return Qwen35MoeTarget.from_dir(dirs["text"])


@pytest.fixture(scope="module")
def hf(dirs):
    return transformers.Qwen3_5MoeForCausalLM.from_pretrained(dirs["text"], dtype=torch.float32,
                                                             attn_implementation="eager").eval()


prompt = partial(spec_arms.prompt, top=VOCAB - 8)
ROUTER = "Qwen3_5MoeTopKRouter"  # transformers' router module, whose third output is the expert ids


def logits_bound(cfg, keys: int) -> float:
    """fp32_bounds' reordering bound of the logits: per layer the wider mixer's reductions and
    the feed-forward's (router and experts over hidden, down over the wider of the expert and
    shared widths, the top-k + shared combine), then the final norm and the lm_head."""
    mixer = max(cfg.num_attention_heads * cfg.head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    head = max(cfg.head_dim, cfg.linear_key_head_dim)
    ffn = max(cfg.moe.moe_intermediate_size, cfg.moe.shared_expert_intermediate_size)
    layer = layer_reductions(cfg.hidden_size, mixer, head, keys, ffn) + (cfg.hidden_size, TOP_K + 1)
    return reorder_bound(*layer * cfg.num_hidden_layers, cfg.hidden_size, cfg.hidden_size)


# --------------------------------------------------------------------------- registry and layouts


def test_registry_dispatches_both_layouts_and_the_dense_class_refuses_moe(dirs):
    assert target_family(dirs["text"]) is target_family(dirs["multimodal"]) is Qwen35MoeTarget
    # capturable (the step reads nothing on the host): graphs default on with CUDA and a fixed width
    on, drafter, _ = resolve_cuda_graphs(None, torch.device("cuda"), 16, {}, Qwen35MoeTarget)
    assert Qwen35MoeTarget.supports_cuda_graphs and on and drafter
    with pytest.raises(UnsupportedError, match="is not a Qwen35Target target \\(a mixture-of-experts") as err:
        Qwen35Target.from_dir(dirs["text"])
    assert "\n" not in str(err.value)


def test_declared_moe_settings_price_the_verify_window(target):
    moe = target.moe
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size) == (EXPERTS, TOP_K, MOE_INTER)
    assert moe.sparse_layers == frozenset(range(5)) and moe.norm_topk_prob
    cost = step_cost_of(target)
    assert cost.sparse_layers == 5 and cost.expert_bytes == 3 * 64 * MOE_INTER * 4
    # the non-expert weights it counted: everything loaded but the routed experts, one embedding row
    total = sum(t.numel() for w in target.layers for t in (w.w_gate_up, w.w_down, w.experts.router, w.shared_gate))
    assert moe.fixed_elements > total + target.lm_head_weight.numel()
    assert cost.bytes(16) > cost.bytes(1)


def test_padding_rows_run_no_experts(target):
    spec_arms.assert_padding_rows_run_no_experts(target, VOCAB)  # (the planted unmasked step: test_qwen3_moe.py)


def test_multimodal_and_stacked_layouts_load_the_same_model(dirs, target, hf, tmp_path):
    ids = torch.tensor(prompt(12, 4))
    mm = Qwen35MoeTarget.from_dir(dirs["multimodal"])
    assert "multimodal layout" in mm.load_note and "per-expert layout" in mm.load_note
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 2 * MOE_INTER, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((dirs["text"] / "config.json").read_text())
    stacked = Qwen35MoeTarget.from_dir(tmp_path)
    assert "stacked layout" in stacked.load_note
    want = target.forward(ids, 0, target.new_state(12))[0]
    for other in (mm, stacked):
        assert torch.equal(other.forward(ids, 0, other.new_state(12))[0], want)


# --------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("n", [1, 9, 70])  # 70 > HF's 64-row DeltaNet chunk
def test_logits_match_transformers(target, hf, n, monkeypatch):
    rec = RouteRecorder(qwen3_5_moe.route)
    monkeypatch.setattr(qwen3_5_moe, "route", rec)
    ids = prompt(n, n)
    ours = target.logits(target.forward(torch.tensor(ids), 0, target.new_state(n))[0])
    ref, routes = hf_logits_and_routes(hf, ids, ROUTER)
    # every row routed to the experts transformers picked, layer by layer, in its order
    assert len(routes) == len(rec.calls) == target.n_layers
    assert all(torch.equal(a, b) for a, b in zip(rec.calls, routes))
    assert rel_err(ours, ref) < logits_bound(target.cfg, n)


def test_greedy_equals_transformers(target, hf):
    ids = prompt(11, 5)
    ref = hf_greedy(hf, ids, 256, VOCAB)
    assert greedy_reference(StepRunner(target, 16), ids, 256) == ref
    assert greedy_reference(StepRunner(target), ids, 256) == ref  # variable width too
    assert len(set(ref)) > 20, "degenerate tiny model"


# --------------------------------------------------------------------------- speculative arms


SPEC_PROMPTS, SPEC_NEW = [prompt(9, 3), prompt(14, 8)], 48


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    return make_drafts(tmp_path_factory.mktemp("drafts"), target, SPEC_PROMPTS, SPEC_NEW, taps=(1, 3))


@pytest.mark.parametrize("mode,vt", [("dflash", "ladder"), ("dspark", "priced")])
def test_speculative_arms_equal_plain_greedy(target, drafts, mode, vt):
    assert_arm_equals_plain(target, drafts, mode, vt, SPEC_PROMPTS, SPEC_NEW)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fixed_width_logits_do_not_depend_on_the_grouping(dirs, dtype, monkeypatch):
    rec = RouteRecorder(qwen3_5_moe.route)
    monkeypatch.setattr(qwen3_5_moe, "route", rec)
    assert_groupings_equal(Qwen35MoeTarget.from_dir(dirs["multimodal"], dtype=dtype), recorded=rec)


def test_bf16_dflash_session_equals_plain_greedy(dirs, tmp_path):
    from memra_cli.tiny.draft import make_tiny_draft

    target = Qwen35MoeTarget.from_dir(dirs["multimodal"], dtype=torch.bfloat16)
    draft = make_tiny_draft(tmp_path / "zlab", "zlab", target_layer_ids=(1, 3), num_target_layers=target.n_layers,
                            dtype=torch.bfloat16)
    assert_session_equals_plain(target, draft, SPEC_PROMPTS, 32)


# --------------------------------------------------------------------------- graphs


def test_graphed_sessions_read_nothing_on_the_host(dirs, tmp_path, monkeypatch):
    """The family declares itself capturable: on the CPU stand-in of a capture (the twin then
    runs every expert, as on CUDA), graphed steps and the drafter's graphs read nothing on the
    host, count their experts, and equal plain greedy. (Whole-round graphs over the hybrid need
    test_qwen3_5.py's stand-in, which undoes a replayed step's Python side effects: its round-graph
    test's `-moe` case.)"""
    from memra_cli.tiny.draft import make_tiny_draft

    captures = eager_capture(monkeypatch)
    target = Qwen35MoeTarget.from_dir(dirs["text"])
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(1, 3),
                            num_target_layers=target.n_layers)
    assert_graphed_session_equals_plain(target, draft, prompt(9, 5), 12, 8, False, captures)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_groupings_and_arms_equal_plain_greedy(dirs, tmp_path):
    """On CUDA in bfloat16 with the step ops' kernels (the MoE kernels among them): the
    fixed-width logits do not depend on the grouping, and DFlash / DSpark sessions, eager and
    with CUDA graphs, equal plain greedy over eager steps."""
    from memra_cli.engine.layers.step_ops import select_step_ops
    from memra_cli.tiny.draft import make_tiny_draft

    target = Qwen35MoeTarget.from_dir(dirs["text"], dtype=torch.bfloat16, device="cuda")
    target.step_ops, _ = select_step_ops(target.device)
    assert_groupings_equal(target)
    for mode, fmt, extra in (("dflash", "zlab", {}), ("dspark", "deepspec", dict(markov_rank=16, confidence="markov"))):
        draft = make_tiny_draft(tmp_path / mode, fmt, target_layer_ids=(1, 3), num_target_layers=target.n_layers,
                                dtype=torch.bfloat16, **extra)
        for graphs in (False, True):
            assert_session_equals_plain(target, draft, SPEC_PROMPTS, 32, mode, graphs)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("variant,error,words", [
    ({"config": {"num_experts_per_tok": 9}}, ConfigError, "num_experts_per_tok 9 is more than num_experts 8"),
    ({"config": {"norm_topk_prob": False}}, UnsupportedError, "norm_topk_prob=false is not how Qwen3.5-MoE routes"),
    ({"config": {"mlp_only_layers": [1]}}, UnsupportedError, "every Qwen3.5-MoE layer is sparse"),
    ({"config": {"shared_expert_intermediate_size": None}}, ConfigError,
     "required key 'shared_expert_intermediate_size' is missing"),
    ({"drop": "model.layers.2.mlp.experts.5.up_proj.weight"}, CheckpointError,
     "'model.layers.2.mlp.experts.5.up_proj.weight' is missing"),
    ({"drop": "model.layers.0.mlp.shared_expert_gate.weight"}, CheckpointError,
     "'model.layers.0.mlp.shared_expert_gate.weight' is missing"),
    ({"reshape": "model.layers.1.mlp.gate.weight"}, CheckpointError,
     "'model.layers.1.mlp.gate.weight' has shape [7, 64], expected shape [8, 64]"),
])
def test_bad_input_is_refused_in_one_line(dirs, tmp_path, variant, error, words):
    bad = write_variant(dirs["text"], tmp_path / "bad", **variant)  # config keys: the text model's
    with pytest.raises(error) as info:
        load_target(bad)
    assert words in str(info.value) and "\n" not in str(info.value)
