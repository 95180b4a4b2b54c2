"""DeepSpec's Gemma4DSparkModel drafter (models/drafter_gemma4.py) on tiny checkpoints from
`memra_cli.tiny.gemma4_dspark`, over the tiny Gemma 4 target of `memra_cli.tiny.gemma4`.

- DeepSpec's own forward: oracles it computed once on these tiny drafters (tests/data/gemma4_dspark)
  pass parity on both engine paths, float32 and bfloat16.
- Reference: `parity/reference.py`'s `Gemma4ReferenceDrafter`, a float64 drafter built from
  transformers' own Gemma 4 pieces (`Gemma4RMSNorm`, `Gemma4TextMLP`, `Gemma4TextRotaryEmbedding`
  over `global_head_dim`, `apply_rotary_pos_emb`, `Gemma4TextScaledWordEmbedding`), sharing no code
  with the engine's drafter. Every engine path (fresh forward, ingest + cached round, the static
  path CUDA graphs replay) matches it stage by stage, and `parity` passes on the oracle it writes.
- Exactness: speculative == plain greedy for the dspark arm under every policy (harvest, verify
  window, verify cap, markov on/off, confidence heads with and without markov) in float32 and
  bfloat16, with partial acceptance (a drafter whose layers barely move the block rows re-proposes
  its anchor: the tiny target's streams repeat tokens, so some drafts are accepted, most not);
  and under temperature sampling (the position-keyed sampler) the same stream as plain sampling.
- Refusals: malformed configs, a Gemma drafter over a Qwen target, `emb_scale` off: one line each.
- `memra train`'s trainable twin (train/drafter_gemma4.py) and the engine's drafter loaded from its
  export compute the same block forward within the float32 reordering bound (fp32_bounds.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.api import ArmConfig, Engine, drafter_class
from memra_cli.engine.errors import CensusError, ConfigError, SettingError, UnsupportedError
from memra_cli.engine.formats.census import take_census
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.models.drafter_gemma4 import Gemma4Drafter
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.parity.oracle import parity, read_oracle
from memra_cli.tiny.gemma4 import make_tiny_gemma4
from memra_cli.tiny.gemma4_dspark import make_tiny_gemma4_dspark
from memra_cli.tiny.target import make_tiny_qwen3

from fp32_bounds import U, assert_close_at_scale, layer_reductions, reorder_bound

pytest.importorskip("transformers")
from memra_cli.parity.reference import Gemma4ReferenceDrafter, make_oracle  # noqa: E402

VOCAB = 512
# float32 engine against the float64 reference: each matmul / norm rounds at ~2^-24 * sqrt(K)
# relative (K <= 192, the fc's reduction) ~ 1e-6; two layers, attention scaling 1.0 (scores of
# RMS-normed q/k reach ~head_dim = 32, which the softmax turns into at most ~32x a score's
# relative error in its probabilities' relative error, i.e. still ~1e-6 per layer after the
# o_proj average). 1e-5 relative (Frobenius), parity's f32 bound, leaves ~5x headroom over that.
F32_TOL = 1e-5
DRAFTERS = {
    # k_eq_v (full-layer KV heads: 1 x 32), softcap 30, markov + confidence-with-markov
    "k_eq_v": {},
    # a v_proj (2 KV heads x 32), no softcap, plain confidence head, no markov
    "v_proj": dict(k_eq_v=False, softcap=None, markov_rank=0, confidence="plain", seed=6),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4dspark")
    target = make_tiny_gemma4(root / "target")
    drafts = {name: make_tiny_gemma4_dspark(root / name, target=target, **kw) for name, kw in DRAFTERS.items()}
    return target, drafts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def inputs(ctx: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ctx, 3 * 64, generator=gen) * 2, torch.randn(8, 64, generator=gen) * 0.5


# --------------------------------------------------------------------------- config and census


def test_census_reads_the_gemma_layers(pair):
    _, drafts = pair
    c = take_census(drafts["k_eq_v"])
    cfg = c.config
    assert cfg.backbone == "gemma4" and cfg.exporter == "deepspec" and c.kind == "dspark"
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads) == (32, 1, 4)  # global_head_dim, k_eq_v
    assert cfg.gemma4.attention_k_eq_v and cfg.gemma4.final_logit_softcapping == 30.0
    assert (c.rope.type, c.rope.theta, c.rope.partial_rotary_factor) == ("proportional", 1e6, 0.25)
    assert all(lay.attention == "full" and not lay.causal_in_block and lay.window is None for lay in c.layers)
    names = {t.name for t in c.tensors}
    assert "layers.0.self_attn.v_proj.weight" not in names and "layers.1.layer_scalar" in names
    assert c.markov.rank == 16 and c.confidence.with_markov and not c.unknown_tensors
    v = take_census(drafts["v_proj"]).config
    assert (v.num_key_value_heads, v.gemma4.attention_k_eq_v, v.gemma4.final_logit_softcapping) == (2, False, None)
    assert drafter_class(c) is Gemma4Drafter


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_path_matches_the_transformers_reference(pair, name):
    path = pair[1][name]
    ref = Gemma4ReferenceDrafter(path)
    drafter = Gemma4Drafter.load(path)
    ctx = 21
    taps, noise = inputs(ctx, seed=3)
    pos = torch.arange(ctx + 8)
    with torch.no_grad():
        want = ref.forward(taps, noise, pos)
        full = drafter.forward_full(taps, noise, pos)
        kv = drafter.new_cache(32)
        feats = torch.cat([drafter.ingest(kv, taps[lo:hi], pos[lo:hi]) for lo, hi in ((0, 9), (9, ctx))])
        cached = drafter.forward_round(kv, noise, pos[ctx:], keep_layers=True)
        skv = drafter.new_cache(48)  # the static path: row index == position, padding rows overwritten
        drafter.static_ingest(skv, torch.cat([taps[:16]]), torch.tensor(0))
        drafter.static_ingest(skv, torch.cat([taps[16:], torch.zeros(3, taps.shape[1])]), torch.tensor(16))
        static = drafter.static_round(skv, noise, torch.tensor(ctx))
    assert rel_err(full.ctx_features, want["ctx_features"]) < F32_TOL
    assert rel_err(feats, want["ctx_features"]) < F32_TOL
    for got in (full.layer_out, cached.layer_out):
        for li in range(2):
            assert rel_err(got[li], want["layer_out"][li]) < F32_TOL, li
    for got in (full.hidden_out, cached.hidden_out, static):
        assert rel_err(got, want["hidden_out"]) < F32_TOL
    # the static path computes the fresh forward's ops in its order: the same bits
    assert torch.equal(static, full.hidden_out)


@pytest.mark.parametrize("dtype,policy", [(torch.float32, "f32"), (torch.bfloat16, "bf16")])
def test_parity_passes_on_the_reference_oracle(pair, tmp_path, dtype, policy):
    """The oracle `memra parity --make-oracle` writes for this format (block rows = the target's
    embedding scaled by √hidden, softcapped logits, markov chain, confidence raws) and the engine
    within parity's bounds of that precision (oracle.py THRESHOLDS)."""
    target, drafts = pair
    for name, path in drafts.items():
        out = tmp_path / f"{name}.npz"
        meta = make_oracle(path, out, target_dir=target, ctx=24, seed=1)
        assert "Gemma4TextRotaryEmbedding" in meta["source"] and "draft_logits" in meta["stages"]
        oracle = read_oracle(out)
        scale = float(torch.tensor(64 ** 0.5))
        embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
        assert torch.allclose(torch.from_numpy(oracle.arrays["noise_embedding"][0]), embed[oracle.anchor] * scale)
        drafter = Gemma4Drafter.load(path, dtype=dtype)
        report = parity(drafter, oracle, embed.to(dtype), policy)
        assert report.passed, [(r.stage, r.path, r.rel_l2) for r in report.results if not r.passed]


def test_softcap_is_applied_to_the_oracle_and_the_engine(pair, tmp_path):
    """A drafter capped at 0.5 (the tiny logits are ~1, so 30 would barely bend them): the oracle's
    logits are `0.5 * tanh(z / 0.5)` of the raw ones, far from them, and the engine passes parity
    on them (its drafter applies its own cap there)."""
    target, _ = pair
    path = make_tiny_gemma4_dspark(tmp_path / "capped", target=target, softcap=0.5)
    out = tmp_path / "o.npz"
    make_oracle(path, out, target_dir=target, ctx=8, seed=2)
    oracle = read_oracle(out)
    logits = torch.from_numpy(oracle.arrays["draft_logits"]).double()
    hidden = torch.from_numpy(oracle.arrays["hidden_out"]).double()
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    raw = hidden @ embed.double().T
    assert logits.abs().max() < 0.5 and torch.allclose(logits, torch.tanh(raw / 0.5) * 0.5, rtol=1e-5, atol=1e-6)
    assert (logits - raw).abs().max() > 0.3
    assert parity(Gemma4Drafter.load(path), oracle, embed, "f32").passed


DATA = Path(__file__).resolve().parents[1] / "data" / "gemma4_dspark"


@pytest.mark.parametrize("dtype,policy", [(torch.float32, "f32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_parity_against_deepspecs_own_forward(pair, name, dtype, policy):
    """Oracles computed once by DeepSpec's Gemma4DSparkModel itself on these tiny drafters
    (tests/data/gemma4_dspark/README.md says how): every stage of both engine paths within parity's
    bounds. The drafter is regenerated here, so its tensors' hash must be the one the oracle saw."""
    target, drafts = pair
    oracle = read_oracle(DATA / f"deepspec-{name}.npz")
    weights = load_file(str(drafts[name] / "model.safetensors"))
    digest = hashlib.sha256(b"".join(weights[k].numpy().tobytes() for k in sorted(weights))).hexdigest()
    assert digest == oracle.meta["weights_sha256"], "the tiny maker's weights changed: remake the oracle (README)"
    assert oracle.meta["source"].startswith("DeepSpec Gemma4DSparkModel")
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    report = parity(Gemma4Drafter.load(drafts[name], dtype=dtype), oracle, embed.to(dtype), policy)
    assert report.passed, [(r.stage, r.path, r.rel_l2) for r in report.results if not r.passed]
    assert set(oracle.stages) >= {"ctx_features", "layer_out", "hidden_out", "draft_logits", "confidence_raw"}


# --------------------------------------------------------------------------- exactness


def repeater(path):
    """The drafter with its layers' post-attention / post-feed-forward norm weights shrunk 50x
    (their sandwich norms would renormalize any smaller projection): each block row leaves its
    layers near its own scaled embedding row, so row 0 proposes the anchor again, which the tiny
    target's repetitive greedy streams accept now and then. The markov bias is shrunk likewise."""
    w = load_file(str(path / "model.safetensors"))
    for k in w:
        if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            w[k] = w[k] * 0.02
        if k.endswith("markov_w2.weight"):
            w[k] = w[k] * 0.1
    save_file(w, str(path / "model.safetensors"))
    return path


ARMS = {  # name: (drafter, settings, markov, verify cap)
    "dspark": ("k_eq_v", {}, None, None),
    "dspark-no-markov-ladder": ("k_eq_v", {"vt": "ladder"}, False, None),
    "dspark-confidence-cap3": ("k_eq_v", {"vt": "confidence", "tau": "0.3"}, None, 3),
    "dspark-harvest-dflash-fixed": ("k_eq_v", {"harvest": "dflash", "adapt": "0"}, None, None),
    "dspark-v-proj-plain-confidence": ("v_proj", {"vt": "confidence-slot"}, None, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arm_name", list(ARMS))
def test_dspark_arms_equal_plain_greedy(pair, tmp_path, arm_name, dtype):
    target, _ = pair
    which, settings, markov, cap = ARMS[arm_name]
    draft = repeater(make_tiny_gemma4_dspark(tmp_path / "d", target=target, **DRAFTERS[which]))
    engine = Engine.from_model(Gemma4Target.from_dir(target, dtype=dtype), step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark", settings=PolicySettings(**settings), markov=markov,
                               verify_cap=cap))
    assert arm.receipts.embedding.scaled and arm.receipts.embedding.scale == 8.0
    # the uncapped drafter over the capped target is said (its drafts take the target's cap)
    assert [w.split(";")[0] for w in arm.warnings] == (
        [] if which == "k_eq_v" else ["drafter final_logit_softcapping None differs from the target's 30.0"])
    accepted = rejected = 0
    for seed in range(3):
        ids = torch.randint(0, VOCAB - 4, (9 + 14 * seed,), generator=torch.Generator().manual_seed(70 + seed)).tolist()
        plain = greedy_reference(engine.runner, ids, 48)
        session = engine.session(ids, 48, arm)
        assert session.run() == plain, (arm_name, seed)
        hist = session.stats.accept_hist
        accepted += sum(n for m, n in enumerate(hist) if m > 0)
        rejected += hist[0]
    assert rejected > 0
    # partial acceptance happened, wherever row 0 (the re-proposed anchor) is a draft: DFlash's
    # harvest drafts from rows 1.. only, the mask rows, which this drafter never gets right
    assert accepted > 0 or settings.get("harvest") == "dflash", (accepted, rejected)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 0.9)])
def test_sampled_dspark_stream_equals_plain_sampling(pair, tmp_path, temperature, top_p):
    """Temperature sampling: the position-keyed sampler's speculative stream (drafts sampled with the
    target's noise through the markov chain) is plain sampling's, token for token."""
    from memra_cli.engine.spec.keyed import SamplingParams, make_sampler

    target, _ = pair
    draft = repeater(make_tiny_gemma4_dspark(tmp_path / "d", target=target))
    engine = Engine.from_model(Gemma4Target.from_dir(target), step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    for seed in range(2):
        sampler = make_sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=seed))
        ids = torch.randint(0, VOCAB - 4, (12,), generator=torch.Generator().manual_seed(90 + seed)).tolist()
        plain = engine.session(ids, 40, None, sampler=sampler, eos_ids=()).run()
        assert engine.session(ids, 40, arm, sampler=sampler, eos_ids=()).run() == plain, seed


# --------------------------------------------------------------------------- refusals


def _rewrite(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes,error,words", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, UnsupportedError,
     "drafter's layers are all 'full_attention'"),
    ({"hidden_size_per_layer_input": 8}, UnsupportedError, "has no per-layer inputs"),
    ({"global_head_dim": None}, ConfigError, "required key 'global_head_dim' is missing"),
    ({"num_global_key_value_heads": None}, ConfigError, "required key 'num_global_key_value_heads' is missing"),
    ({"enable_moe_block": True}, UnsupportedError, "enable_moe_block=true"),
    ({"num_kv_shared_layers": 1, "use_double_wide_mlp": True}, UnsupportedError, "use_double_wide_mlp=true"),
    ({"model_type": "gemma4_unified_text"}, UnsupportedError, "model_type 'gemma4_unified_text'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}}, UnsupportedError,
     "rope_type='yarn' is not implemented for Gemma 4"),
    ({"block_size": None}, ConfigError, "required key 'block_size' is missing"),
])
def test_malformed_configs_are_refused_by_name(tmp_path, changes, error, words):
    path = _rewrite(make_tiny_gemma4_dspark(tmp_path / "d"), **changes)
    with pytest.raises(error) as info:
        take_census(path)
    msg = str(info.value)
    assert words in msg and str(path / "config.json") in msg and "\n" not in msg


def test_a_missing_gemma_tensor_is_named(tmp_path):
    path = make_tiny_gemma4_dspark(tmp_path / "d")
    w = load_file(str(path / "model.safetensors"))
    del w["layers.1.pre_feedforward_layernorm.weight"]
    save_file(w, str(path / "model.safetensors"))
    with pytest.raises(CensusError, match=r"tensor 'layers\.1\.pre_feedforward_layernorm\.weight' is missing"):
        take_census(path)


def test_pair_refusals(pair, tmp_path):
    target, drafts = pair
    qwen = Engine.from_model(Gemma4Target.from_dir(target))
    with pytest.raises(SettingError, match="block embedding is scaled"):
        qwen.arm(ArmConfig(draft=drafts["k_eq_v"], mode="dspark", emb_scale=False))
    from memra_cli.engine.models.qwen3 import Qwen3Target

    q = Engine.from_model(Qwen3Target.from_dir(make_tiny_qwen3(tmp_path / "q", hidden=64, vocab=VOCAB)))
    with pytest.raises(ConfigError, match="drafts for a Gemma 4 target, not model_type 'qwen3'"):
        q.arm(ArmConfig(draft=drafts["k_eq_v"], mode="dspark"))


# --------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_graphed_dspark_rounds_equal_plain_greedy_on_the_cpu_stand_in(pair, tmp_path, monkeypatch, name):
    """The CUDA test below with the CPU's capture stand-in (spec_arms.eager_capture): whole
    rounds graphed run the Gemma drafter's static path (its static_round and static_ingest, with
    the positions the round body makes once) and the stream is an eager plain run's."""
    from spec_arms import eager_capture, graphed_on_cpu

    captures = eager_capture(monkeypatch)
    target, _ = pair
    draft = repeater(make_tiny_gemma4_dspark(tmp_path / "d", target=target, **DRAFTERS[name]))
    model = Gemma4Target.from_dir(target)
    engine = graphed_on_cpu(model, 16, round_graphs=True)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    ids = torch.randint(0, VOCAB - 4, (23,), generator=torch.Generator().manual_seed(71)).tolist()
    plain = greedy_reference(StepRunner(model, 16), ids, 40)
    with engine.session(ids, 40, arm, eos_ids=()) as session:
        assert session.graphed_rounds
        assert session.run() == plain
        assert any(k[0] == "spec-chain" for k in session.cache.graphs)
    assert captures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_cuda_graphed_dspark_rounds_equal_plain_greedy(pair, tmp_path, name):
    """bf16 on CUDA with the target's steps, the drafter's rounds and whole rounds as CUDA graphs
    (the drafter's static path replayed), queued ahead and not: the stream is an eager plain run's."""
    from memra_cli.engine.layers.step_ops import select_step_ops

    target, _ = pair
    draft = repeater(make_tiny_gemma4_dspark(tmp_path / "d", target=target, **DRAFTERS[name]))
    ref_model = Gemma4Target.from_dir(target, dtype=torch.bfloat16, device="cuda")
    ref_model.step_ops, _ = select_step_ops(ref_model.device)  # the same kernels: the same bits
    reference = Engine.from_model(ref_model, step_width=16)
    model = Gemma4Target.from_dir(target, dtype=torch.bfloat16, device="cuda")
    model.step_ops, _ = select_step_ops(model.device)
    engine = Engine.from_model(model, step_width=16, cuda_graphs=True, draft_graphs=True, round_graphs=True)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    for seed in range(3):
        ids = torch.randint(0, VOCAB - 4, (9 + 14 * seed,), generator=torch.Generator().manual_seed(70 + seed)).tolist()
        plain = greedy_reference(reference.runner, ids, 48)
        for pipelined in (True, False):
            engine.pipelined = pipelined
            with engine.session(ids, 48, arm, eos_ids=()) as session:
                assert session.graphed_rounds, (name, seed)
                assert session.run() == plain, (name, seed, pipelined)


# --------------------------------------------------------------------------- memra train's twin


def _twin_bound(drafter, hidden: int, n_taps: int, ffn: int, keys: int) -> float:
    """fp32_bounds' reordering bound through the fc and every layer's reductions, with each layer's
    score error amplified by its largest possible score: q and k are RMS-normed (norm ~sqrt(hd))
    and scaled by their norm weights, with attention scaling 1.0, so |q.k| <= hd * max|w_q| *
    max|w_k|, and a score's absolute error (its relative error times that) is what the softmax
    passes on as its probabilities' relative error."""
    hd, total = drafter.hd, reorder_bound(n_taps * hidden)
    for layer in drafter.layers:
        a = layer.self_attn
        amplify = hd * a.q_norm.weight.abs().max().item() * a.k_norm.weight.abs().max().item()
        total += reorder_bound(*layer_reductions(hidden, drafter.heads * hd, hd, keys, ffn))
        total += 2 * U * amplify * hd ** 0.5
    return total


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_memra_train_twin_computes_the_engine_drafter(tmp_path, k_eq_v):
    """`memra train`'s trainable Gemma4DSparkModel (train/drafter_gemma4.py) and the engine's
    drafter loaded from what train exports compute the same block forward on the same inputs,
    within the float32 reordering bound: what training optimises is what the engine drafts with."""
    from memra_cli.train.export import write_drafter
    from memra_cli.train.geometry import resolve_geometry, text_config
    from memra_cli.train.job import new_drafter
    from memra_cli.train.losses import DraftSpec, block_batch
    from memra_cli.train.taps import EngineTaps

    target = make_tiny_gemma4(tmp_path / "target", k_eq_v=k_eq_v)
    geo, _ = resolve_geometry(target, "dspark", layers=2, block=8, taps=(-1, 1, 3), mask_token=VOCAB - 1,
                              markov_rank=16, confidence=True)
    assert geo.backbone == "gemma4" and geo.k_eq_v is k_eq_v and (geo.head_dim, geo.kv_heads) == (32, 1 if k_eq_v else 2)
    twin = new_drafter(geo, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms, scalars and heads (fresh ones are ones / zeros)
        for name, p in twin.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.4)  # unsaturated scores, as the tiny drafter (tiny/gemma4_dspark.py)
    tables = Gemma4Target.from_dir(target)
    out = write_drafter(tmp_path / "d", twin, geo, EngineTaps(tables), dtype="float32", target_config=text_config(target))
    engine = Gemma4Drafter.load(out)
    assert [t.name for t in take_census(out).tensors if "v_proj" in t.name] == ([] if k_eq_v else
                                                                                  ["layers.0.self_attn.v_proj.weight",
                                                                                   "layers.1.self_attn.v_proj.weight"])
    L, anchor = 24, 13
    ids = torch.randint(2, VOCAB - 1, (1, L), generator=gen)
    noise_ids, blk_pos, _, _, mask = block_batch(ids, torch.tensor([[anchor]]), DraftSpec("dspark", 8, geo.taps, VOCAB - 1))
    taps = torch.randn(1, L, 3 * 64, generator=gen)
    noise = torch.nn.functional.embedding(noise_ids, tables.embed_weight) * 8.0  # √hidden, as the arm scales it
    with torch.no_grad():
        want = twin(taps, noise, torch.arange(L)[None], blk_pos, mask)[0]
        got = engine.forward_full(taps[0, :anchor], noise[0], torch.cat([torch.arange(anchor), blk_pos[0]])).hidden_out
    assert_close_at_scale(got, want, _twin_bound(twin, 64, 3, geo.ffn, anchor + 8), "twin vs engine")
    assert not torch.equal(want, noise[0])  # the layers moved the rows
