"""LlamaTarget against the real reference: HF `transformers.LlamaForCausalLM` on the same files.

Tiny random LLaMA checkpoints are written at test time (float32, CPU, eager attention on the HF
side) with `llama3` rope scaling over 64 original positions, so prompts and streams run well
past them: prefill logits within the float32 reordering bound, greedy streams of 256 tokens vs
`generate` (variable width and 16-row fixed steps, i.e. `static_step` through the step ops'
no-norm `rope_kv_write`), taps, tied and untied lm_head, both rope config keys and an absent
`head_dim`, refusals. Then the speculative arms over the LLaMA target: a z-lab DFlash drafter
and a DeepSpec DSpark drafter (a planted markov head, so acceptance is partial) through the
engine, and the oracle proposer with scheduled partial acceptance, all == plain greedy.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.errors import ConfigError, UnsupportedError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.base import load_target
from memra_cli.engine.models.llama import LlamaTarget
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import LLAMA3, make_tiny_llama, special_token_ids

from fp32_bounds import layer_reductions, reorder_bound
from test_spec import PARTIAL, World, check_ingested_taps, oracle_session, planted_tensors

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB = 512
EOS = special_token_ids(VOCAB)["<|endoftext|>"]
ORIGINAL = LLAMA3["original_max_position_embeddings"]  # 64: every long test runs past it
VARIANTS = {
    "untied": {},
    "tied": {"tie": True, "seed": 1},
    "default-rope": {"rope": None, "seed": 2},
}


def _legacy_layout(path):
    """Rewrite a tiny LLaMA config the way LLaMA-3.1's config.json is published: `rope_theta`
    beside a `rope_scaling` dict, and no `head_dim` (hidden / heads)."""
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    del cfg["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    dirs = {name: make_tiny_llama(root / name, **kw) for name, kw in VARIANTS.items()}
    dirs["rope-scaling-key"] = _legacy_layout(make_tiny_llama(root / "legacy", seed=3))
    return dirs


def load_hf(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {name: (load_target(d), load_hf(d)) for name, d in tiny_dirs.items()}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
    if n > 3:
        ids[n // 2] = EOS  # HF's pad-masking trap would bite if the mask were inferred
    return ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def hf_logits(hf, ids: list[int], **kw):
    x = torch.tensor([ids])
    return hf(x, attention_mask=torch.ones_like(x), **kw)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], max_new: int) -> list[int]:
    """HF greedy generate with no EOS (the never-produced id VOCAB) and an explicit mask."""
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = VOCAB, EOS
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, max_new, None, None
    x = torch.tensor([ids])
    return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)[0, len(ids):].tolist()


def whole_model_bound(target, keys: int) -> float:
    """Two float32 evaluations of the whole model (every layer's chained reductions, then the
    final norm and the lm_head over `hidden`) summed in any orders (fp32_bounds.py)."""
    cfg = target.cfg
    per_layer = layer_reductions(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, keys,
                                 cfg.intermediate_size)
    return reorder_bound(*per_layer * cfg.num_hidden_layers, cfg.hidden_size, cfg.hidden_size)


# --------------------------------------------------------------------------- the family


def test_the_family_loads_with_its_switches(models):
    target, _ = models["untied"]
    assert type(target) is LlamaTarget and target.cfg.model_type == "llama" and not target.cfg.qk_norm
    assert all(w.q_norm is None and w.k_norm is None for w in target.layers)
    assert target.cfg.rope.type == "llama3" and target.lm_head_weight is not target.embed_weight
    tied, _ = models["tied"]
    assert tied.lm_head_weight is tied.embed_weight
    legacy, _ = models["rope-scaling-key"]
    assert legacy.cfg.rope.source_key == "rope_scaling" and legacy.cfg.rope.type == "llama3"
    assert legacy.head_dim == 16  # hidden 64 / 4 heads


def test_llama3_frequencies_are_transformers_bit_for_bit(models):
    for name in ("untied", "rope-scaling-key"):
        target, hf = models[name]
        assert torch.equal(target._rope.inv_freq, hf.model.rotary_emb.inv_freq), name
        assert hf.model.rotary_emb.attention_scaling == 1.0
    # all three bands are exercised: kept, blended and divided by the factor
    target, _ = models["untied"]
    plain = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ratio = plain / target._rope.inv_freq
    assert (ratio == 1).any() and (ratio == LLAMA3["factor"]).any()
    assert ((ratio > 1) & (ratio < LLAMA3["factor"])).any()


@pytest.mark.parametrize("variant", list(VARIANTS) + ["rope-scaling-key"])
def test_prefill_logits_match_hf(models, variant):
    target, hf = models[variant]
    for n, seed in ((1, 0), (7, 1), (200, 3)):  # 200 > the 64 original positions
        ids = prompt(n, seed)
        cache = target.new_state(n)
        hidden, _ = target.forward(torch.tensor(ids), 0, cache)
        ours, ref = target.logits(hidden), hf_logits(hf, ids).logits[0]
        assert rel_err(ours, ref) < whole_model_bound(target, n), (variant, n)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant,n,seed", [("untied", 100, 13), ("default-rope", 5, 10), ("rope-scaling-key", 40, 11)])
def test_greedy_matches_hf_generate_past_the_original_positions(models, variant, n, seed):
    """256 tokens from an n-token prompt: positions up to n + 256, 4× past the 64 original.
    (The tied tiny model's greedy stream repeats its input token, the unit embedding row
    dominating its own logit: its logits are checked in the prefill test instead.)"""
    target, hf = models[variant]
    ids = prompt(n, seed)
    ours = greedy_reference(target, ids, 256)
    assert len(ours) == 256 and len(set(ours)) > 20, "degenerate tiny model: greedy loops on a few tokens"
    assert ours == hf_greedy(hf, ids, 256), variant


def test_greedy_at_fixed_width_matches_hf_generate(models):
    """Every decode step 16 rows through `static_step` (the no-norm rope + KV write)."""
    target, hf = models["untied"]
    ids = prompt(30, 14)
    ours = greedy_reference(StepRunner(target, 16), ids, 256)
    assert ours == hf_greedy(hf, ids, 256)


def test_taps_match_hf_hidden_states(models):
    target, hf = models["untied"]
    ids = prompt(90, 30)
    states = hf_logits(hf, ids, output_hidden_states=True).hidden_states
    cache = target.new_state(len(ids))
    _, tapped = target.forward(torch.tensor(ids), 0, cache, taps=(-1, 0, 2))
    h = target.hidden_size
    cfg = target.cfg
    per_layer = layer_reductions(h, cfg.num_attention_heads * cfg.head_dim, cfg.head_dim, len(ids),
                                 cfg.intermediate_size)
    for j, tap in enumerate((-1, 0, 2)):  # a tap after layer t chains t + 1 layers' reductions
        bound = reorder_bound(*per_layer * (tap + 1)) if tap >= 0 else 0.0
        assert rel_err(tapped[:, j * h:(j + 1) * h], states[tap + 1][0]) <= bound, tap


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("edit,match", [
    ({"attention_bias": True}, "attention_bias=true is not implemented for model_type 'llama'"),
    ({"mlp_bias": True}, "mlp_bias=true is not implemented for model_type 'llama'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not implemented"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='dynamic' is not implemented"),
])
def test_unsupported_switches_are_refused_by_name(tiny_dirs, tmp_path, edit, match):
    src = tiny_dirs["untied"]
    dst = tmp_path / "edited"
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(UnsupportedError, match=match):
        load_target(dst)


def test_a_family_class_refuses_the_other_family(tiny_dirs):
    with pytest.raises(ConfigError, match="model_type 'llama' is not a qwen3 target"):
        Qwen3Target.from_dir(tiny_dirs["untied"])


# --------------------------------------------------------------------------- speculative arms

N_TRUTH, MAX_NEW = 64, 40


@pytest.fixture(scope="module")
def world(tiny_dirs, tmp_path_factory) -> World:
    target = load_target(tiny_dirs["untied"])
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 21)]
    truths = [greedy_reference(target, p, N_TRUTH) for p in prompts]
    return World(tmp_path_factory.mktemp("llama-spec"), tiny_dirs["untied"], target, prompts, truths)


@pytest.fixture(scope="module")
def drafts(world):
    """z-lab DFlash drafters tapping the LLaMA target (one with its embedding output), and a
    DeepSpec DSpark drafter whose planted markov head knows most of the target's bigrams."""
    planted, _ = planted_tensors(world, torch.Generator().manual_seed(7))
    return {
        "zlab": make_tiny_draft(world.root / "zlab", "zlab", block_size=8, target_layer_ids=(0, 2)),
        "zlab-emb": make_tiny_draft(world.root / "zlab-emb", "zlab", block_size=4, seed=1, target_layer_ids=(-1, 1, 3)),
        "spark": make_tiny_draft(world.root / "spark", "deepspec", block_size=8, seed=108, markov_rank=VOCAB,
                                 confidence="markov", extra_tensors=planted),
    }


@pytest.mark.parametrize("width", [None, 16], ids=["variable", "w16"])
@pytest.mark.parametrize("draft,mode,settings", [
    ("zlab", "dflash", {}),
    ("zlab-emb", "dflash", {"adapt": "0"}),
    ("spark", "dflash", {}),
    ("spark", "dspark", {}),
    ("spark", "dspark", {"vt": "confidence"}),
])
def test_every_arm_equals_plain_greedy(world, drafts, width, draft, mode, settings):
    engine = Engine.from_model(world.target, step_width=width)
    arm = engine.arm(ArmConfig(draft=drafts[draft], mode=mode, settings=PolicySettings(**settings)))
    accepted = drafted = partial = 0
    for p, truth in zip(world.prompts, world.truths):
        plain = greedy_reference(engine.runner, p, MAX_NEW)
        assert plain == truth[:MAX_NEW]  # fixed-width plain decoding is the eager stream in f32
        session = engine.session(p, MAX_NEW, arm, eos_ids=())
        assert session.run() == plain, (draft, mode, settings)
        s = session.stats
        assert s.accepted + s.rounds == MAX_NEW
        accepted, drafted = accepted + s.accepted, drafted + s.drafted
        partial += sum(n for m, n in s.accept_hist.items() if m > 0)
    if mode == "dspark":  # the planted head is right often, and wrong sometimes
        assert 0 < accepted < drafted and partial > 0, (accepted, drafted)


def test_oracle_partial_acceptance_over_the_llama_target(world):
    """Scheduled rejections: verify, rollback and re-verify on the LLaMA target keep the stream
    and feed the drafter exactly the target's own taps."""
    session, oracle = oracle_session(world, 2, 24, PARTIAL)
    assert session.run() == world.truths[2][:24]
    assert 0 < session.stats.accepted < session.stats.drafted
    check_ingested_taps(world, 2, session, oracle)


# --------------------------------------------------------------------------- the benchmark preset


def test_the_gpu_benchmarks_llama_preset_builds_a_llama_target():
    """benchmarks/gpu/target_step.py --family llama builds its target with gpu_shapes.random_target
    from the `llama-8b` shape; its small twin here: a LlamaTarget (no q/k norms, llama3 rope) whose
    16-row fixed steps give the eager greedy stream past its 32 original positions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_shapes import SHAPES, random_target

    big = SHAPES["llama-8b"]
    assert (big["hidden"], big["layers"], big["heads"], big["kv"], big["ffn"], big["vocab"]) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert big["rope"]["original_max_position_embeddings"] == 8192 and big["rope"]["factor"] == 8.0
    target = random_target(SHAPES["llama-small"], torch.float32, torch.device("cpu"))
    assert type(target) is LlamaTarget and target.cfg.rope.type == "llama3"
    assert all(w.q_norm is None for w in target.layers)
    ids = prompt(20, 50)
    assert greedy_reference(StepRunner(target, 16), ids, 40) == greedy_reference(target, ids, 40)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_arms_with_kernels_and_graphs_equal_plain_greedy(tiny_dirs, world, drafts):
    """As `memra generate` runs on CUDA: bf16, 16-row steps, Triton step ops (the no-norm
    `rope_kv_write`), CUDA graphs by default; every arm's stream is the plain one."""
    from memra_cli.engine.api import EngineConfig

    engine = Engine.load(EngineConfig(target=tiny_dirs["untied"], device="cuda", dtype="bfloat16"))
    assert engine.target.step_ops.name == "triton"
    for draft, mode in (("zlab", "dflash"), ("spark", "dflash"), ("spark", "dspark")):
        arm = engine.arm(ArmConfig(draft=drafts[draft], mode=mode))
        for p in world.prompts:
            plain = greedy_reference(engine.runner, p, MAX_NEW)
            assert engine.session(p, MAX_NEW, arm, eos_ids=()).run() == plain, (draft, mode)
