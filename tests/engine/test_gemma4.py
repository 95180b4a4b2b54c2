"""Gemma4Target against transformers' Gemma4ForCausalLM / Gemma4ForConditionalGeneration (5.25),
and under the step runner and the round loop.

- HF parity (CPU float32, HF's eager attention): tiny random checkpoints from
  `memra_cli.tiny.gemma4` covering every switch: sliding + full layers with prompts longer than
  the window (8), default rope on sliding layers and proportional partial rope on full ones,
  k_eq_v with the full layers' own head dim and KV heads, per-layer inputs, KV-shared layers with
  their double-wide MLP, softcap, tied and untied heads; both config layouts (`global_head_dim`,
  `per_layer_config`) and the multimodal checkpoint. Prompt logits, multi-row incremental steps,
  taps vs `output_hidden_states`, and 256-token greedy streams vs `generate`.
  Tolerance 1e-5 relative (Frobenius): both sides run the same float32 ops in the same order (on
  this CPU the logits are bit-identical); what may differ elsewhere is BLAS blocking, ~sqrt(K) *
  2^-24 ≈ 1e-6 relative per reduction of K ≤ 192 terms, compounded over ≤ 6 layers whose norms
  keep it O(1). HF's SDPA path is not the reference: with Gemma's attention scaling 1.0 the scores
  of normed q/k reach ~head_dim, and its fused CPU kernel's online softmax then differs from the
  math path by ~1e-5 relative on full layers (float32 rounding amplified by the score size, not a
  semantic difference: run in float64 the gap falls to ~1e-6, the float32 softmax HF keeps there).
- Exactness: fixed 16-row steps give the same logits whatever the grouping; a rollback then a
  continuation is bit-identical to running the kept prefix straight; the oracle proposer with
  partial acceptance and every speculative arm over a tiny z-lab DFlash drafter reproduce plain
  greedy (float32 and bfloat16).
- Refusals: an MoE block without its keys, an unknown layer type, a missing tensor: one line each
  (the MoE block itself: tests/engine/test_gemma4_moe.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.errors import CheckpointError, ConfigError, UnsupportedError
from memra_cli.engine.formats.gemma4_config import parse_gemma4_config
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.base import MODEL_FAMILIES, load_target, target_family
from memra_cli.engine.models.gemma4 import Gemma4Target, gemma_rms_norm
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import LADDER, Harvest, PolicySettings
from memra_cli.engine.spec.proposer import Program
from memra_cli.engine.spec.session import Session
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.gemma4 import make_tiny_gemma4
from memra_cli.tiny.target import special_token_ids

from scripted_oracle import ScriptedOracle, moving_wrong_slot

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB, WINDOW, WIDTH = 512, 8, 16
EOS = special_token_ids(VOCAB)["<|endoftext|>"]
# with two KV-shared layers the last sliding one reads layer 2's K/V and the last full one layer 3's
SIX = ("sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention",
       "full_attention")
VARIANTS = {
    # 3 sliding + 2 full, k_eq_v (full: head_dim 32, 1 KV head), softcap, tied
    "base": {},
    # per-layer inputs, 2 KV-shared layers (double-wide MLP), no k_eq_v, no softcap, untied, 2 shards
    "ple-shared": dict(ple=8, shared=2, layer_types=SIX, k_eq_v=False, softcap=None, tie=False, seed=1, shards=2),
    # the per_layer_config head layout, k_eq_v off but the full layers' own head dim
    "per-layer": dict(heads_layout="per_layer", k_eq_v=False, seed=2, ple=4),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    dirs = {name: make_tiny_gemma4(root / name, **kw) for name, kw in VARIANTS.items()}
    # the same weights as "base" in the other head layout and in the multimodal checkpoint
    dirs["base-per-layer"] = make_tiny_gemma4(root / "bpl", heads_layout="per_layer")
    dirs["multimodal"] = make_tiny_gemma4(root / "mm", layout="multimodal")
    return dirs


def load_hf(path, multimodal=False):
    cls = transformers.Gemma4ForConditionalGeneration if multimodal else transformers.Gemma4ForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {name: (Gemma4Target.from_dir(tiny_dirs[name]), load_hf(tiny_dirs[name])) for name in VARIANTS}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 4, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ours_logits(target, ids):
    state = target.new_state(len(ids))
    hidden, _ = target.forward(torch.tensor(ids), 0, state)
    return target.logits(hidden)


@torch.no_grad()
def hf_out(hf, ids, **kw):
    x = torch.tensor([ids])
    return hf(input_ids=x, attention_mask=torch.ones_like(x), **kw)


@torch.no_grad()
def hf_greedy(hf, ids, max_new):
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = VOCAB, EOS  # never stops early: VOCAB is never produced
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, max_new, None, None
    gc.top_k = gc.top_p = None
    x = torch.tensor([ids])
    return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)[0, len(ids):].tolist()


# --------------------------------------------------------------------------- config and registry


def test_registry_and_config_read_like_transformers(tiny_dirs, models):
    assert MODEL_FAMILIES["gemma4"]() is MODEL_FAMILIES["gemma4_text"]() is Gemma4Target
    assert target_family(tiny_dirs["multimodal"]) is Gemma4Target
    for target, hf in models.values():
        cfg, ref = target.cfg, hf.config
        assert cfg.layer_types == tuple(ref.layer_types)
        assert cfg.head_dims == tuple(ref.per_layer_config[i].head_dim for i in range(cfg.num_hidden_layers))
        assert cfg.kv_heads == tuple(ref.per_layer_config[i].num_key_value_heads for i in range(cfg.num_hidden_layers))
        modes = ref.kv_sharing_modes
        assert all((src != i) == (modes[i] == "reuse") for i, src in enumerate(cfg.kv_source))
        assert all(modes[src] == "store" for i, src in enumerate(cfg.kv_source) if src != i)
        assert cfg.final_logit_softcapping == ref.final_logit_softcapping
    assert models["ple-shared"][0].cfg.kv_source == (0, 1, 2, 3, 2, 3)
    base, _ = models["base"]
    assert base.cfg.head_dims == (16, 16, 32, 16, 32) and base.cfg.kv_heads == (2, 2, 1, 2, 1)
    assert base.lm_head_weight is base.embed_weight
    assert base.embed_scale == pytest.approx(64 ** 0.5)
    per_layer = Gemma4Target.from_dir(tiny_dirs["base-per-layer"])
    assert (per_layer.cfg.head_layout, base.cfg.head_layout) == ("per_layer_config", "global_head_dim")
    assert per_layer.cfg.head_dims == base.cfg.head_dims and per_layer.cfg.kv_heads == base.cfg.kv_heads


def test_embed_is_the_raw_row_and_the_model_scales_it(models):
    target, hf = models["base"]
    ids = torch.tensor([3, 7, 11])
    assert torch.equal(target.embed(ids), target.embed_weight[ids])
    _, taps = target.forward(ids, 0, target.new_state(3), taps=[-1])
    assert torch.equal(taps, hf.model.embed_tokens(ids[None])[0])


# --------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logits_match_hf(models, variant):
    target, hf = models[variant]
    for n, seed in ((1, 0), (7, 1), (40, 2)):  # 40 > the window of 8: sliding layers drop keys
        ids = prompt(n, seed)
        ours, ref = ours_logits(target, ids), hf_out(hf, ids).logits[0]
        assert rel_err(ours, ref) < 1e-5, (variant, n)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_taps_are_hf_hidden_states(models, variant):
    target, hf = models[variant]
    ids = prompt(30, 3)
    taps = [-1] + list(range(target.n_layers))
    _, ours = target.forward(torch.tensor(ids), 0, target.new_state(30), taps=taps)
    ref = hf_out(hf, ids, output_hidden_states=True).hidden_states
    h = target.hidden_size
    for j, tap in enumerate(taps[:-1]):
        assert rel_err(ours[:, j * h:(j + 1) * h], ref[tap + 1][0]) < 1e-5, (variant, tap)
    # HF's last hidden state is the final-normed one; the last tap is the raw layer output
    last = gemma_rms_norm(ours[:, -h:], target.norm, target.cfg.rms_norm_eps)
    assert rel_err(last, ref[-1][0]) < 1e-5


@pytest.mark.parametrize("width", [None, WIDTH], ids=["forward", "static-16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_several_row_steps_match_full_sequence(models, variant, width):
    """Verify-sized steps whose rows straddle the window edge see exactly their window, through
    the eager forward and through fixed 16-row static steps (padding rows included)."""
    target, hf = models[variant]
    runner = StepRunner(target, width)
    ids = prompt(90, 5)
    ref = hf_out(hf, ids).logits[0]
    state = target.new_state(len(ids) + WIDTH)
    rows, start = [], 0
    for chunk in (11, 1, 1, 6, 1, 16, 3, 9, 1, 25, 16):
        logits, _ = runner.step(torch.tensor(ids[start:start + chunk]), start, state)
        rows.append(logits)
        start += chunk
    assert start == len(ids) and rel_err(torch.cat(rows), ref) < 1e-5


@pytest.mark.parametrize("variant", ["base", "ple-shared"])
@pytest.mark.parametrize("width", [None, WIDTH], ids=["variable", "fixed-16"])
def test_greedy_matches_hf_generate(models, variant, width):
    target, hf = models[variant]
    runner = StepRunner(target, width)
    ids = prompt(20, 11)  # longer than the window
    ours = greedy_reference(runner, ids, 256)
    assert len(set(ours)) > 20, "degenerate tiny model"
    assert ours == hf_greedy(hf, ids, 256)


def test_layouts_and_multimodal_give_one_stream(tiny_dirs, models):
    base, _ = models["base"]
    ids = prompt(20, 12)
    want = greedy_reference(base, ids, 64)
    for name in ("base-per-layer", "multimodal"):
        target = load_target(tiny_dirs[name])
        assert greedy_reference(target, ids, 64) == want, name
    mm = Gemma4Target.from_dir(tiny_dirs["multimodal"])
    assert "multimodal layout" in mm.load_note and "skipped 3 vision/audio tensor(s)" in mm.load_note
    hf_mm = load_hf(tiny_dirs["multimodal"], multimodal=True)
    assert rel_err(ours_logits(mm, ids), hf_out(hf_mm, ids).logits[0]) < 1e-5


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_steps_do_not_depend_on_grouping(tiny_dirs, dtype):
    target = Gemma4Target.from_dir(tiny_dirs["ple-shared"], dtype=dtype)
    runner = StepRunner(target, WIDTH)
    ids = prompt(40, 21)
    outs = []
    for groups in ((12, 28), (1,) * 12 + (28,), (12, 5, 16, 7)):
        state = target.new_state(64)
        rows, start = [], 0
        for g in groups:
            logits, _ = runner.step(torch.tensor(ids[start:start + g]), start, state)
            rows.append(logits)
            start += g
        outs.append(torch.cat(rows))
    assert torch.equal(outs[0][12:], outs[1][12:]) and torch.equal(outs[0][12:], outs[2][12:])


def test_rollback_then_continue_is_the_straight_run(models):
    target, _ = models["ple-shared"]
    runner = StepRunner(target, WIDTH)
    ids, wrong = prompt(30, 31), prompt(10, 32)
    straight = target.new_state(64)
    want, _ = runner.step(torch.tensor(ids), 0, straight)
    state = target.new_state(64)
    runner.step(torch.tensor(ids[:20] + wrong), 0, state)
    state.rollback(20)
    got, _ = runner.step(torch.tensor(ids[20:]), 20, state)
    assert torch.equal(got, want[20:])


@pytest.mark.parametrize("width", [WIDTH, 4, None], ids=["fixed", "fixed-4-chunks", "variable"])
def test_partial_acceptance_equals_plain_greedy(tiny_dirs, width):
    engine = Engine.from_model(Gemma4Target.from_dir(tiny_dirs["ple-shared"]), step_width=width)
    block, max_new = 8, 48
    for seed, n in ((60, 9), (61, 30)):
        ids = prompt(n, seed)
        truth = greedy_reference(engine.runner, ids, max_new + block + 1)
        oracle = ScriptedOracle(truth, n, block - 1, moving_wrong_slot, VOCAB)
        session = Session(engine.runner, ids, max_new, proposer=oracle,
                          program=Program(Harvest.DFLASH, LADDER, False, block, False, block), taps=(-1, 1, 4))
        assert session.run() == truth[:max_new]
        hist = session.stats.accept_hist
        assert any(0 < m < block - 1 for m in hist if hist[m]) and hist[block - 1] > 0, hist


ARMS = {  # (mode, block, settings, verify cap)
    "dflash-b4": ("dflash", 4, {}, None),
    "dflash-b8-cap4-fixed": ("dflash", 8, {"adapt": "0"}, 4),
    "dflash-b16-hdspark": ("dflash", 16, {"harvest": "dspark"}, None),
    "dspark-b8": ("dspark", 8, {}, None),
    "dspark-b8-hdspark-cap3": ("dspark", 8, {"harvest": "dspark"}, 3),
    "auto-b8": ("auto", 8, {}, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arm_name", list(ARMS))
def test_zlab_drafter_arms_equal_plain_greedy(tiny_dirs, tmp_path, arm_name, dtype):
    mode, block, settings, cap = ARMS[arm_name]
    engine = Engine.from_model(Gemma4Target.from_dir(tiny_dirs["base"], dtype=dtype), step_width=WIDTH)
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=block, target_layer_ids=(-1, 1, 4),
                            num_target_layers=5, dtype=dtype, seed=block)
    arm = engine.arm(ArmConfig(draft=draft, mode=mode, settings=PolicySettings(**settings), verify_cap=cap))
    assert arm.taps == (-1, 1, 4)
    for seed in range(2):
        ids = prompt(9 + 14 * seed, 70 + seed)  # the second longer than the window
        plain = greedy_reference(engine.runner, ids, 40)
        assert engine.session(ids, 40, arm).run() == plain, (arm_name, seed)


def test_kernels_note_says_what_the_family_takes_from_them(tiny_dirs, monkeypatch):
    """With the Triton step ops selected (CUDA), the engine's note says which of the seam's ops
    Gemma 4 takes from them (its per-layer inputs stay torch); with the torch ops nothing is added."""
    import memra_cli.engine.api as api
    from memra_cli.engine.api import EngineConfig
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps

    class NamedTriton(TorchStepOps):
        name = "triton"

    monkeypatch.setattr(api, "select_step_ops", lambda dev, setting, env: (NamedTriton(), "step ops: Triton kernels"))
    engine = Engine.load(EngineConfig(target=tiny_dirs["base"], device="cpu"))
    assert ("step ops: Triton kernels; this target uses only linear, embed, gemma_qk_norm_rope_kv_write, "
            "windowed attention, gemma_add_norm, gelu_tanh_mul and softcap; Gemma 4's per-layer inputs run in torch"
            ) in engine.notes
    monkeypatch.setattr(api, "select_step_ops", lambda dev, setting, env: (TorchStepOps(), "step ops: torch"))
    assert "step ops: torch" in Engine.load(EngineConfig(target=tiny_dirs["base"], device="cpu")).notes


# --------------------------------------------------------------------------- refusals


def _text_cfg(tiny_dirs):
    return json.loads((tiny_dirs["base"] / "config.json").read_text())


def test_refusals_are_one_line(tiny_dirs, tmp_path):
    raw = _text_cfg(tiny_dirs)
    cases = [
        ({**raw, "enable_moe_block": True}, ConfigError, r"required key 'num_experts' is missing"),
        ({**raw, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8},
         ConfigError, r"top_k_experts 5 is more than num_experts 4"),
        ({**raw, "layer_types": raw["layer_types"][:-1] + ["chunked_attention"]}, UnsupportedError,
         r"layer_types has 'chunked_attention', a layer type Gemma 4 does not have"),
        ({**raw, "layer_types": raw["layer_types"][:-1] + ["sliding_attention"]}, ConfigError, r"last layer"),
        ({**raw, "rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1.0}}},
         UnsupportedError, r"rope_parameters.sliding_attention.rope_type='yarn' is not implemented"),
        ({**raw, "hidden_activation": "silu"}, UnsupportedError, r"hidden_activation='silu'"),
        ({**raw, "per_layer_config": {"2": {"sliding_window": 4}}}, UnsupportedError, r"per_layer_config.2.sliding_window"),
        ({"model_type": "gemma4", "text_config": {**raw, "enable_moe_block": True, "num_experts": 4}}, ConfigError,
         r"required key 'text_config.top_k_experts' is missing"),
    ]
    for cfg, err, pattern in cases:
        with pytest.raises(err, match=pattern) as info:
            parse_gemma4_config(cfg, "config.json")
        assert "\n" not in str(info.value)
    broken = make_tiny_gemma4(tmp_path / "broken")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.2.self_attn.k_norm.weight' is missing"):
        Gemma4Target.from_dir(broken)


def test_published_defaults_are_noted():
    raw = {"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    cfg = parse_gemma4_config(raw, "config.json")
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.head_dims == (8,) * 5 + (512,) and cfg.kv_heads == (2,) * 6
    assert cfg.rope["full_attention"].type == "proportional" and cfg.rope["full_attention"].partial_rotary_factor == 0.25
    assert len(cfg.notes) == 3 and any("global_head_dim absent" in n for n in cfg.notes)
    # per-layer inputs: absent -> transformers' 256; an explicit null (published large configs) -> none
    assert cfg.hidden_size_per_layer_input == 256
    assert parse_gemma4_config({**raw, "hidden_size_per_layer_input": None}, "c").hidden_size_per_layer_input == 0


# --------------------------------------------------------------------------- the GPU benchmark's pieces


def test_gemma4_step_benchmark_pieces_on_cpu():
    """benchmarks/gpu/gemma4_step.py (run on the H200 through target_step.py --shape gemma4-31b):
    its config is the 31B's layout, its random target steps, and its byte counts are the state's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma4_step.py"
    spec = importlib.util.spec_from_file_location("gemma4_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    big = mod.gemma4_config(mod.GEMMA4_31B)
    assert big.layer_types.count("full_attention") == 10 and big.head_dims[5] == 512 and big.kv_heads[5] == 4
    assert big.head_dims[0] == 256 and big.kv_heads[0] == 16 and big.k_eq_v(5) and not big.k_eq_v(0)
    target = mod.random_gemma4(mod.SMALL, torch.float32, torch.device("cpu"))
    assert mod.matmul_chain(target, 16)().shape == (16, 512)
    state = target.new_state(100)
    per_position = [kv[:, :, :1].numel() * kv.element_size() for kv in state.kv]
    window = target.cfg.sliding_window
    assert 0 < window < 100  # the floor counts a sliding layer's window only: what its attention reads
    assert mod.kv_bytes(target, 100) == sum(b * (window if kind == "sliding_attention" else 100)
                                            for b, kind in zip(per_position, target.cfg.layer_types))
    logits, _ = StepRunner(target, WIDTH).step(torch.arange(20), 0, state)
    assert logits.shape == (20, 512) and torch.isfinite(logits).all()
    assert logits.abs().max() <= 30.0  # the softcap
    # the torch-vs-Triton agreement check, here between two torch ops (the Triton ones need CUDA)
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    agree = mod.ops_agreement(target, {"torch": TorchStepOps(), "again": TorchStepOps()}, WIDTH, prompt=70)
    assert agree == {"again_vs_torch": {"rel_l2": 0.0, "argmax_agree": 1.0}}


def test_gemma4_step_benchmarks_exactness_gate_on_cpu():
    """gemma4_step.exactness_sweep, the 31B step benchmark's spec == plain gate, on the SMALL
    shape: a prompt inside the window and one past it (the sliding rings wrap) both pass with
    target_step's stream oracle, and the gate fails when the speculative stream differs (a
    planted oracle that flips one committed token)."""
    import importlib.util
    import types
    from pathlib import Path

    import benchmarks.gpu.target_step as helpers

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma4_step.py"
    spec = importlib.util.spec_from_file_location("gemma4_step_gate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    target = mod.random_gemma4(mod.SMALL, torch.float32, torch.device("cpu"))
    window = mod.SMALL["window"]
    gate = mod.exactness_sweep(target, helpers, WIDTH, lengths=(window // 2, 2 * window + 5), prompts=1,
                               tokens=24, cuda_graphs=False)
    assert gate["exact"] and [r["length"] for r in gate["runs"]] == [window // 2, 2 * window + 5]
    assert all(1.0 < r["oracle_tau"] for r in gate["runs"])  # rounds accepted drafts: rollback was exercised

    def flipped(engine, ids, stream, seed):
        out, tau = helpers.oracle_run(engine, ids, stream, seed)
        return out[:5] + [(out[5] + 1) % target.vocab_size] + out[6:], tau

    broken = mod.exactness_sweep(target, types.SimpleNamespace(oracle_run=flipped), WIDTH, lengths=(window // 2,),
                                 prompts=1, tokens=24, cuda_graphs=False)
    assert not broken["exact"] and not broken["runs"][0]["exact"]
