"""Gemma 4 with `enable_moe_block` (Gemma4MoeTarget) against transformers' Gemma4ForCausalLM, its
layouts, speculative arms over it, and its refusals.

- HF parity (CPU float32, HF's eager attention): tiny random checkpoints from
  `memra_cli.tiny.gemma4` with the MoE block on every layer (stacked experts, as transformers
  writes them): the base variant (sliding + full, k_eq_v, softcap, tied) and one with per-layer
  inputs, KV-shared layers and an untied head. Prompt logits and 256-token greedy streams vs
  `generate` over 16-row steps whose rows share experts and steps whose rows do not.
- Tolerance: the same float32 ops in possibly different summation orders, so fp32_bounds'
  reordering bound over each layer's chained reductions (attention, the dense MLP, the router,
  the experts and their k-term combine, the block's five norms) and the final norm and lm_head
  (the softcap's tanh only shrinks differences). Routing is compared exactly: every row's
  experts, in order, are those transformers' router picked.
- The multimodal checkpoint and the per-expert layout load the same weights; the block changes
  the logits (the dense model of the same seed is far from it).
- Speculative arms (DFlash ladder, DSpark priced) == plain greedy; refusals: one line each.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.api import resolve_cuda_graphs
from memra_cli.engine.errors import CheckpointError, ConfigError, UnsupportedError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models import gemma4_moe
from memra_cli.engine.models.base import load_target, target_family
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.engine.models.gemma4_moe import Gemma4MoeTarget
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.priced import step_cost_of
from memra_cli.tiny.gemma4 import make_tiny_gemma4
from memra_cli.tiny.target import special_token_ids

import spec_arms
from fp32_bounds import layer_reductions, reorder_bound
from spec_arms import (RouteRecorder, assert_arm_equals_plain, assert_graphed_session_equals_plain,
                       assert_groupings_equal, assert_session_equals_plain,
                       eager_capture, hf_greedy, hf_logits_and_routes, make_drafts, rel_err)

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB, EXPERTS, TOP_K, MOE_INTER = 512, 8, 2, 24
EOS = special_token_ids(VOCAB)["<|endoftext|>"]
MOE = (EXPERTS, TOP_K, MOE_INTER)
SIX = ("sliding_attention", "full_attention") * 3
VARIANTS = {"base": {}, "ple-shared": dict(ple=8, shared=2, layer_types=SIX, k_eq_v=False, softcap=None, tie=False,
                                          seed=1)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4moe")
    out = {name: make_tiny_gemma4(root / name, moe=MOE, **kw) for name, kw in VARIANTS.items()}
    out["multimodal"] = make_tiny_gemma4(root / "mm", layout="multimodal", moe=MOE)  # "base"'s weights
    out["dense"] = make_tiny_gemma4(root / "dense")  # "base" without its MoE block
    return out


@pytest.fixture(scope="module")
def models(dirs):
    return {name: (Gemma4MoeTarget.from_dir(dirs[name]),
                   transformers.Gemma4ForCausalLM.from_pretrained(dirs[name], dtype=torch.float32,
                                                                 attn_implementation="eager").eval())
            for name in VARIANTS}


prompt = partial(spec_arms.prompt, top=VOCAB - 4)
ROUTER = "Gemma4TextRouter"  # transformers' router module, whose third output is the expert ids


def ours_logits(target, ids):
    return target.logits(target.forward(torch.tensor(ids), 0, target.new_state(len(ids)))[0])


def logits_bound(cfg, keys: int) -> float:
    """fp32_bounds' reordering bound of the logits (module docstring)."""
    hd = max(cfg.head_dims)
    ffn = max(cfg.intermediate_size * 2, cfg.moe.moe_intermediate_size)
    h = cfg.hidden_size
    layer = layer_reductions(h, cfg.num_attention_heads * hd, hd, keys, ffn) + (h, TOP_K) + (h,) * 5
    return reorder_bound(*layer * cfg.num_hidden_layers, h, h)


# --------------------------------------------------------------------------- registry and layouts


def test_the_registry_picks_the_moe_class_from_config_json(dirs):
    assert target_family(dirs["base"]) is target_family(dirs["multimodal"]) is Gemma4MoeTarget
    assert target_family(dirs["dense"]) is Gemma4Target
    # capturable (the step reads nothing on the host): graphs default on with CUDA and a fixed width
    on, drafter, _ = resolve_cuda_graphs(None, torch.device("cuda"), 16, {}, Gemma4MoeTarget)
    assert Gemma4MoeTarget.supports_cuda_graphs and on and drafter
    for cls, d, flag in ((Gemma4Target, dirs["base"], "true"), (Gemma4MoeTarget, dirs["dense"], "false")):
        with pytest.raises(UnsupportedError, match=f"enable_moe_block={flag} is not a {cls.__name__} target") as err:
            cls.from_dir(d)
        assert "\n" not in str(err.value)


def test_declared_moe_settings_price_the_verify_window(models):
    target = models["base"][0]
    moe = target.moe
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size) == MOE and moe.sparse_layers == frozenset(range(5))
    cost = step_cost_of(target)
    assert cost.sparse_layers == 5 and cost.expert_bytes == 3 * 64 * MOE_INTER * 4 and cost.bytes(16) > cost.bytes(1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_rows_run_no_experts(models, variant):
    spec_arms.assert_padding_rows_run_no_experts(models[variant][0], VOCAB)  # (the plant: test_qwen3_moe.py)


def test_multimodal_and_per_expert_layouts_load_the_same_model_and_the_block_matters(dirs, models, tmp_path):
    base = models["base"][0]
    ids = prompt(20, 4)
    want = ours_logits(base, ids)
    state = load_file(str(dirs["base"] / "model.safetensors"))
    for i in range(5):  # the stacked experts split into the per-expert layout
        p = f"model.layers.{i}.experts."
        gate_up, down = state.pop(p + "gate_up_proj"), state.pop(p + "down_proj")
        for e in range(EXPERTS):
            gate, up = gate_up[e].chunk(2)
            state.update({f"{p}{e}.gate_proj.weight": gate.contiguous(), f"{p}{e}.up_proj.weight": up.contiguous(),
                          f"{p}{e}.down_proj.weight": down[e].contiguous()})
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((dirs["base"] / "config.json").read_text())
    per_expert = Gemma4MoeTarget.from_dir(tmp_path)
    assert "per-expert layout" in per_expert.load_note and "stacked layout" in base.load_note
    for other in (per_expert, Gemma4MoeTarget.from_dir(dirs["multimodal"])):
        assert torch.equal(ours_logits(other, ids), want)
    assert rel_err(ours_logits(load_target(dirs["dense"]), ids), want) > 0.1


# --------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(models, variant, monkeypatch):
    target, hf = models[variant]
    rec = RouteRecorder(gemma4_moe.gemma_route)
    monkeypatch.setattr(gemma4_moe, "gemma_route", rec)
    for n, seed in ((1, 0), (7, 1), (40, 2)):  # 40 > the window of 8
        ids = prompt(n, seed)
        rec.calls.clear()
        ours = ours_logits(target, ids)
        ref, routes = hf_logits_and_routes(hf, ids, ROUTER)
        # every row routed to the experts transformers picked, layer by layer, in its order
        assert len(routes) == len(rec.calls) == target.n_layers
        assert all(torch.equal(a, b) for a, b in zip(rec.calls, routes)), (variant, n)
        assert rel_err(ours, ref) < logits_bound(target.cfg, n), (variant, n)


def test_greedy_equals_transformers(models):
    target, hf = models["ple-shared"]  # untied: a tied random Gemma echoes its last token
    ids = prompt(11, 5)
    ref = hf_greedy(hf, ids, 256, VOCAB, pad=EOS)
    assert greedy_reference(StepRunner(target, 16), ids, 256) == ref
    assert len(set(ref)) > 20, "degenerate tiny model"


# --------------------------------------------------------------------------- speculative arms


SPEC_PROMPTS, SPEC_NEW = [prompt(9, 3), prompt(14, 8)], 48


@pytest.fixture(scope="module")
def drafts(models, tmp_path_factory):
    target = models["ple-shared"][0]
    return make_drafts(tmp_path_factory.mktemp("drafts"), target, SPEC_PROMPTS, SPEC_NEW, taps=(-1, 1, 3))


@pytest.mark.parametrize("mode,vt", [("dflash", "ladder"), ("dspark", "priced")])
def test_speculative_arms_equal_plain_greedy(models, drafts, mode, vt):
    assert_arm_equals_plain(models["ple-shared"][0], drafts, mode, vt, SPEC_PROMPTS, SPEC_NEW)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fixed_width_logits_do_not_depend_on_the_grouping(dirs, dtype, monkeypatch):
    rec = RouteRecorder(gemma4_moe.gemma_route)
    monkeypatch.setattr(gemma4_moe, "gemma_route", rec)
    assert_groupings_equal(Gemma4MoeTarget.from_dir(dirs["ple-shared"], dtype=dtype), recorded=rec)


def test_bf16_dflash_session_equals_plain_greedy(dirs, tmp_path):
    from memra_cli.tiny.draft import make_tiny_draft

    target = Gemma4MoeTarget.from_dir(dirs["ple-shared"], dtype=torch.bfloat16)
    draft = make_tiny_draft(tmp_path / "zlab", "zlab", target_layer_ids=(-1, 1, 3), num_target_layers=target.n_layers,
                            dtype=torch.bfloat16)
    assert_session_equals_plain(target, draft, SPEC_PROMPTS, 32)


# --------------------------------------------------------------------------- graphs


@pytest.mark.parametrize("round_graphs", [False, True], ids=["step-graphs", "round-graphs"])
def test_graphed_sessions_read_nothing_on_the_host(dirs, tmp_path, monkeypatch, round_graphs):
    """The family declares itself capturable: on the CPU stand-in of a capture (the twin then
    runs every expert, as on CUDA), a graphed prefill, graphed steps or whole rounds and the
    drafter's graphs read nothing on the host, count their experts, and equal plain greedy."""
    from memra_cli.tiny.draft import make_tiny_draft

    captures = eager_capture(monkeypatch)
    target = Gemma4MoeTarget.from_dir(dirs["ple-shared"])
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(-1, 1, 3),
                            num_target_layers=target.n_layers)
    assert_graphed_session_equals_plain(target, draft, prompt(9, 5), 12, 8, round_graphs, captures)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_groupings_and_arms_equal_plain_greedy(dirs, tmp_path):
    """On CUDA in bfloat16 with the step ops' kernels (the MoE kernels, GELU-tanh, among them):
    the fixed-width logits do not depend on the grouping, and DFlash / DSpark sessions, eager
    and with CUDA graphs, equal plain greedy over eager steps."""
    from memra_cli.engine.layers.step_ops import select_step_ops
    from memra_cli.tiny.draft import make_tiny_draft

    target = Gemma4MoeTarget.from_dir(dirs["ple-shared"], dtype=torch.bfloat16, device="cuda")
    target.step_ops, _ = select_step_ops(target.device)
    assert_groupings_equal(target)
    for mode, fmt, extra in (("dflash", "zlab", {}), ("dspark", "deepspec", dict(markov_rank=16, confidence="markov"))):
        draft = make_tiny_draft(tmp_path / mode, fmt, target_layer_ids=(-1, 1, 3), num_target_layers=target.n_layers,
                                dtype=torch.bfloat16, **extra)
        for graphs in (False, True):
            assert_session_equals_plain(target, draft, SPEC_PROMPTS, 32, mode, graphs)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop("model.layers.3.experts.down_proj"), "tensor 'model.layers.3.experts.down_proj' is missing"),
    (lambda t: t.pop("model.layers.1.router.per_expert_scale"), "'model.layers.1.router.per_expert_scale' is missing"),
    (lambda t: t.update({"model.layers.0.router.proj.weight": torch.zeros(7, 64)}),
     "'model.layers.0.router.proj.weight' has shape [7, 64], expected shape [8, 64]"),
    (lambda t: t.update({"model.layers.2.experts.gate_up_proj": torch.zeros(EXPERTS, 2 * MOE_INTER, 63)}),
     "'model.layers.2.experts.gate_up_proj' has shape [8, 48, 63], expected shape [8, 48, 64]"),
])
def test_bad_checkpoints_are_refused_in_one_line(dirs, tmp_path, edit, words):
    state = load_file(str(dirs["base"] / "model.safetensors"))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((dirs["base"] / "config.json").read_text())
    with pytest.raises(CheckpointError) as info:
        load_target(tmp_path)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_more_routed_experts_than_experts_is_refused(dirs, tmp_path):
    import json

    cfg = json.loads((dirs["base"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "top_k_experts": 9}))
    (tmp_path / "model.safetensors").symlink_to(dirs["base"] / "model.safetensors")
    with pytest.raises(ConfigError, match="top_k_experts 9 is more than num_experts 8"):
        load_target(tmp_path)


# --------------------------------------------------------------------------- the GLU op


def test_the_gelu_expert_op_is_row_invariant_and_a_planted_row_order_combine_is_caught():
    """The twin with `activation="gelu_tanh"` (the op Gemma's experts run) under the rule SwiGLU's
    keeps: a row alone (zeros beside it, the same step width) gets the same bits as among 15
    others; a combine keeping one running sum across the step's rows (its rounding then depends
    on the rows before) is caught."""
    from memra_cli.engine.layers.moe import moe_swiglu, route

    g = torch.Generator().manual_seed(0)
    router, gate_up, down = (torch.randn(EXPERTS, 32, generator=g), torch.randn(EXPERTS, 32, 32, generator=g) * 0.3,
                             torch.randn(EXPERTS, 32, 16, generator=g) * 0.3)
    x = torch.randn(16, 32, generator=g)

    def run(rows, op):
        w, ids = route(rows, router, TOP_K, True)
        return op(rows, w, ids, gate_up, down, "gelu_tanh")

    def running_sum(rows, w, ids, gu, dn, act):
        per_row = moe_swiglu(rows, w, ids, gu, dn, act)
        total = torch.cumsum(per_row * 1000.0 + 1.0, dim=0)
        return (total - torch.cat([torch.zeros_like(total[:1]), total[:-1]]) - 1.0) / 1000.0

    def violations(op) -> int:
        together, bad = run(x, op), 0
        for r in range(16):
            alone = torch.zeros_like(x)
            alone[r] = x[r]
            bad += not torch.equal(run(alone, op)[r], together[r])
        return bad

    assert violations(moe_swiglu) == 0 and violations(running_sum) > 0
    assert torch.unique(route(x, router, TOP_K, True)[1]).numel() > TOP_K  # rows use different experts
