"""memra-oracle/1: schema refusals, the independent reference, and f32 parity on both paths."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.api import resolve_precision
from memra_cli.engine.errors import PolicyError
from memra_cli.parity.oracle import (
    FORMAT, OPTIONAL, REQUIRED, THRESHOLDS, OracleError, compare_stage, confidence_scale, parity,
    read_oracle, target_tables, write_oracle,
)
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

pytest.importorskip("transformers", reason="the reference oracle maker needs transformers (a test dependency)")
from memra_cli.parity.reference import ReferenceDrafter, make_oracle  # noqa: E402

CTX, WINDOW = 32, 12  # a sliding window smaller than the context, so it masks real keys
SLIDING = ("sliding_attention", "full_attention")
ZLAB = dict(yarn=True, layer_types=SLIDING, sliding_window=WINDOW, target_layer_ids=(0, 2))
DSPARK = dict(yarn=True, layer_types=("full_attention", "sliding_attention"), sliding_window=WINDOW,
              markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, a z-lab and a DeepSpec drafter, and reference oracles for both."""
    root = tmp_path_factory.mktemp("oracle")
    target = make_tiny_qwen3(root / "target")
    zlab = make_tiny_draft(root / "zlab", "zlab", **ZLAB)
    dspark = make_tiny_draft(root / "dspark", "deepspec", **DSPARK)
    make_oracle(zlab, root / "zlab.npz", target_dir=target, ctx=CTX, seed=1)
    make_oracle(dspark, root / "dspark.npz", ctx=CTX, seed=2)
    return root, target, zlab, dspark


def _lm_head(drafter, target=None):
    if target is not None:
        return target_tables(target, drafter.dtype, "cpu", drafter.cfg.hidden_size)[1]
    return drafter.own_lm_head


def _arrays(path):
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _rewrite(src, dst, drop=(), **replace):
    arrays = _arrays(src)
    for k in drop:
        arrays.pop(k)
    arrays.update(replace)
    np.savez(dst, **arrays)
    return dst


# --------------------------------------------------------------------------- parity in float32


def test_zlab_parity_f32_both_paths(pair):
    root, target, zlab, _ = pair
    oracle = read_oracle(root / "zlab.npz")
    assert oracle.stages == ("ctx_features", "layer_out", "hidden_out", "draft_logits")
    assert oracle.meta["harvest"] == "dflash" and oracle.ctx == CTX
    drafter = Drafter.load(zlab)
    report = parity(drafter, oracle, _lm_head(drafter, target), "f32")
    assert report.passed, [r for r in report.results if not r.passed]
    assert {(r.stage, r.path) for r in report.results} == {(s, p) for s in oracle.stages for p in ("full", "cached")}
    assert all(r.rel_l2 < 1e-5 for r in report.results)
    assert all(r.argmax_agree == 1.0 for r in report.results if r.stage == "draft_logits")


def test_deepspec_parity_f32_both_paths_with_heads(pair):
    root, _, _, dspark = pair
    oracle = read_oracle(root / "dspark.npz")
    assert oracle.stages == ("ctx_features", "layer_out", "hidden_out", "draft_logits", "markov_tokens", "confidence_raw")
    assert oracle.meta["harvest"] == "dspark"
    drafter = Drafter.load(dspark)
    report = parity(drafter, oracle, drafter.own_lm_head, "f32")
    assert report.passed, [r for r in report.results if not r.passed]
    tokens = [r for r in report.results if r.stage == "markov_tokens"]
    assert len(tokens) == 2 and all(r.max_abs == 0 and r.threshold == "exact" for r in tokens)
    assert len(report.engine["cached"]["markov_tokens"]) == oracle.block  # all b rows, not a harvest


def test_the_sliding_window_and_block_causality_shape_the_oracle(pair, tmp_path):
    """The test oracles are not blind to the layout: removing the window, or the causal-in-block
    rule of the sliding layer, changes hidden_out far beyond any threshold."""
    root, _, _, _ = pair
    a = read_oracle(root / "zlab.npz").arrays
    inputs = [torch.from_numpy(a[k]) for k in ("target_hidden", "noise_embedding", "position_ids")]

    def hidden(**kw):
        d = make_tiny_draft(tmp_path / ("-".join(kw) or "base"), "zlab", **{**ZLAB, **kw})
        with torch.no_grad():
            return ReferenceDrafter(d).forward(*inputs)["hidden_out"].float().numpy()

    base = a["hidden_out"]
    assert np.abs(hidden() - base).max() == 0  # same weights and inputs: the stored oracle
    for variant in (dict(layer_types=("full_attention",) * 2), dict(is_causal=False), dict(sliding_window=4 * CTX)):
        rel = np.linalg.norm(hidden(**variant) - base) / np.linalg.norm(base)
        assert rel > 1e-3, variant


def test_reference_is_not_the_engine():
    code = ("import sys, memra_cli.parity.reference; "
            "print(sorted(m for m in sys.modules if m in ('memra_cli.engine.models.drafter', 'memra_cli.engine.layers.ops')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reference_without_an_lm_head_leaves_head_stages_out(pair, tmp_path):
    _, _, _, dspark = pair
    d = make_tiny_draft(tmp_path / "noheads", "deepspec", own_tables=False, **DSPARK)
    meta = make_oracle(d, tmp_path / "o.npz", ctx=8, seed=0)
    assert meta["stages"] == ["ctx_features", "layer_out", "hidden_out"]
    assert set(meta["omitted"]) == {"draft_logits", "markov_tokens", "confidence_raw"}
    assert "random rows" in meta["source"]
    drafter = Drafter.load(d)
    assert parity(drafter, read_oracle(tmp_path / "o.npz"), None, "f32").passed


# --------------------------------------------------------------------------- comparisons


def test_a_nudge_of_1e3_fails_f32_and_passes_bf16():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((8, 64)).astype(np.float32)
    got = want * np.float32(1 + 1e-3)
    r = compare_stage("hidden_out", "full", got, want, THRESHOLDS["f32"])
    assert not r.passed and r.rel_l2 == pytest.approx(1e-3, rel=1e-3)
    assert compare_stage("hidden_out", "full", got, want, THRESHOLDS["bf16"]).passed
    assert compare_stage("hidden_out", "full", want.copy(), want, THRESHOLDS["f32"]).passed


def test_markov_tokens_exact_in_f32_reported_in_bf16():
    want = np.arange(8)
    got = want.copy()
    got[5] = 99
    r = compare_stage("markov_tokens", "cached", got, want, THRESHOLDS["f32"])
    assert not r.passed and r.argmax_agree == 7 / 8 and "slot 5" in r.note
    assert compare_stage("markov_tokens", "cached", got, want, THRESHOLDS["bf16"]).passed


def test_logits_argmax_required_in_f32_except_near_ties():
    want = np.zeros((2, 16), np.float32)
    want[0, 3], want[1, 4] = 5.0, 5.0
    want[1, 7] = 5.0 - 1e-6  # row 1 is a near-tie
    got = want.copy()
    got[1, 7] += 2e-6  # flips row 1's argmax, within rounding
    r = compare_stage("draft_logits", "full", got, want, THRESHOLDS["f32"])
    assert r.passed and r.argmax_agree == 0.5 and "near-tie" in r.note
    got[0, 9] = 5.0 + 1e-5  # a real flip on row 0 (rel L2 tiny, argmax wrong)
    r = compare_stage("draft_logits", "full", got, want, THRESHOLDS["f32"])
    assert not r.passed and "argmax" in r.note


def test_confidence_floor_only_replaces_a_cancelled_denominator():
    """A head score vector that cancels (‖y‖ below the head's scale) is judged against the scale;
    one that does not is judged by plain relative L2, floor or no floor."""
    want = np.array([0.5, -0.4, 0.3, -0.2], np.float32)  # ‖y‖ ≈ 0.73
    got = want + np.float32(0.02)  # ‖δ‖ = 0.04
    plain = compare_stage("confidence_raw", "full", got, want, THRESHOLDS["bf16"])
    assert not plain.passed and plain.rel_l2 == pytest.approx(0.04 / np.linalg.norm(want), rel=1e-5)
    floored = compare_stage("confidence_raw", "full", got, want, THRESHOLDS["bf16"], scale_floor=4.0)
    assert floored.passed and floored.rel_l2 == pytest.approx(0.04 / 4.0, rel=1e-5)
    assert "head scale" in floored.note and f"{plain.rel_l2:.2e}" in floored.note
    low = compare_stage("confidence_raw", "full", got, want, THRESHOLDS["bf16"], scale_floor=0.1)
    assert low.rel_l2 == plain.rel_l2 and low.note == ""


def test_confidence_scale_is_the_heads_rms_over_input_directions(pair):
    """s_k = ‖w‖·‖[hidden_k ; W1[prev_k]]‖/√d with prev = [anchor, chain[:-1]] from the oracle."""
    root, _, _, dspark = pair
    oracle = read_oracle(root / "dspark.npz")
    drafter = Drafter.load(dspark)
    a = oracle.arrays
    w = drafter.conf_w[0].double().numpy()
    prev = np.concatenate([[oracle.anchor], a["markov_tokens"][:-1]]).astype(np.int64)
    x = np.concatenate([a["hidden_out"].astype(np.float64), drafter.markov_w1[prev].double().numpy()], axis=-1)
    s = np.linalg.norm(w) * np.linalg.norm(x, axis=-1) / np.sqrt(w.size)
    assert confidence_scale(drafter, oracle) == pytest.approx(float(np.linalg.norm(s)), rel=1e-12)
    # it is a scale, not a target: an exact engine passes in f32 whatever the floor
    report = parity(drafter, oracle, drafter.own_lm_head, "f32")
    assert all(r.passed and r.rel_l2 < 1e-5 for r in report.results if r.stage == "confidence_raw")


def test_the_floor_does_not_hide_a_confidence_head_bug(pair, tmp_path):
    """An oracle whose scores lack the markov half of the features (the bug of a head that drops
    W1[prev]) fails even the bf16 bound: a wrong feature is off by about the head's scale."""
    root, _, _, dspark = pair
    drafter = Drafter.load(dspark)
    src = read_oracle(root / "dspark.npz")
    a = src.arrays
    h = a["hidden_out"].shape[-1]
    w_hidden = drafter.conf_w[0, :h].double().numpy()
    wrong = a["hidden_out"].astype(np.float64) @ w_hidden + float(drafter.conf_b[0])
    bad = read_oracle(_rewrite(root / "dspark.npz", tmp_path / "bad.npz", confidence_raw=wrong.astype(np.float32)))
    report = parity(drafter, bad, drafter.own_lm_head, "bf16")
    conf = [r for r in report.results if r.stage == "confidence_raw"]
    assert conf and not any(r.passed for r in conf) and all(r.rel_l2 > 4 * THRESHOLDS["bf16"].rel_l2 for r in conf)
    assert report.failed_stages == ["confidence_raw"]


def test_thresholds_are_ordered_by_precision():
    t = THRESHOLDS
    assert t["f32"].rel_l2 == 1e-5 and t["f32"].tokens_exact and t["f32"].argmax_required
    assert t["f32"].rel_l2 < t["bf16"].rel_l2 < t["q8"].rel_l2 == t["mixed"].rel_l2 == t["fc"].rel_l2 < t["q4"].rel_l2
    assert not any(t[p].tokens_exact or t[p].argmax_required for p in ("bf16", "q8", "mixed", "fc", "q4"))


# --------------------------------------------------------------------------- schema refusals


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_key(pair, tmp_path, key):
    root, *_ = pair
    bad = _rewrite(root / "zlab.npz", tmp_path / "bad.npz", drop=(key,))
    with pytest.raises(OracleError, match=f"required key '{key}' is missing"):
        read_oracle(bad)


@pytest.mark.parametrize("key,value,match", [
    ("target_hidden", lambda a: a.astype(np.float64), "'target_hidden' has dtype float64, expected float32"),
    ("position_ids", lambda a: a.astype(np.float32), "'position_ids' has dtype float32, expected an integer"),
    ("hidden_out", lambda a: a[:-1], r"'hidden_out' has shape \[7, 64\], expected \[8, 64\]"),
    ("layer_out", lambda a: a[:, :, :32], r"'layer_out' has shape \[2, 8, 32\], expected \[\*, 8, 64\]"),
    ("position_ids", lambda a: a[:-1], r"'position_ids' has shape \[39\], expected \[40\]"),
    ("draft_logits", lambda a: np.where(a > 0, np.nan, a).astype(np.float32), "'draft_logits' holds NaN"),
])
def test_wrong_dtype_or_shape(pair, tmp_path, key, value, match):
    root, *_ = pair
    a = _arrays(root / "zlab.npz")
    bad = _rewrite(root / "zlab.npz", tmp_path / "bad.npz", **{key: value(a[key])})
    with pytest.raises(OracleError, match=match):
        read_oracle(bad)


@pytest.mark.parametrize("meta,match", [
    ({"format": "memra-oracle/2"}, "meta 'format' is 'memra-oracle/2', expected 'memra-oracle/1'"),
    ({"format": None}, "meta 'format' is missing"),
    ({"ctx": 31}, "meta ctx 31 but target_hidden has 32 rows"),
    ({"block_size": "8"}, "meta 'block_size' must be a non-negative integer"),
    ({"harvest": "rows"}, "meta 'harvest'"),
])
def test_bad_meta(pair, tmp_path, meta, match):
    root, *_ = pair
    m = json.loads(str(_arrays(root / "zlab.npz")["meta"]))
    m.update(meta)
    m = {k: v for k, v in m.items() if v is not None}
    bad = _rewrite(root / "zlab.npz", tmp_path / "bad.npz", meta=np.array(json.dumps(m)))
    with pytest.raises(OracleError, match=match):
        read_oracle(bad)


def test_meta_not_json_and_pickles_refused(pair, tmp_path):
    root, *_ = pair
    bad = _rewrite(root / "zlab.npz", tmp_path / "a.npz", meta=np.array("{not json"))
    with pytest.raises(OracleError, match="key 'meta' is not JSON"):
        read_oracle(bad)
    obj = np.empty((), dtype=object)
    obj[()] = {"format": FORMAT}
    bad = _rewrite(root / "zlab.npz", tmp_path / "b.npz", meta=obj)
    with pytest.raises(OracleError, match="never unpickles"):
        read_oracle(bad)
    (tmp_path / "c.npz").write_bytes(b"not a zip")
    with pytest.raises(OracleError, match="not a readable .npz"):
        read_oracle(tmp_path / "c.npz")
    bad = _rewrite(root / "zlab.npz", tmp_path / "d.npz", extra=np.zeros(3, np.float32))
    with pytest.raises(OracleError, match="unknown key 'extra'"):
        read_oracle(bad)


def test_oracle_that_does_not_fit_the_drafter(pair):
    root, target, zlab, dspark = pair
    drafter = Drafter.load(dspark)
    with pytest.raises(OracleError, match=r"'target_hidden' has shape \[32, 128\], expected \[32, 192\].*n_taps=3"):
        parity(drafter, read_oracle(root / "zlab.npz"), drafter.own_lm_head, "f32")
    zd = Drafter.load(zlab)
    with pytest.raises(OracleError, match="holds draft_logits but there is no lm_head"):
        parity(zd, read_oracle(root / "zlab.npz"), None, "f32")


def test_write_is_atomic_and_validated(pair, tmp_path):
    root, *_ = pair
    o = read_oracle(root / "zlab.npz")
    meta = {k: v for k, v in o.meta.items() if k != "format"}
    out = tmp_path / "copy.npz"
    out.write_bytes(b"old")
    write_oracle(out, meta, o.arrays)
    assert read_oracle(out).meta == o.meta
    with pytest.raises(OracleError, match="'hidden_out' has shape"):
        write_oracle(tmp_path / "never.npz", meta, {**o.arrays, "hidden_out": o.arrays["hidden_out"][:3]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.npz"]  # no temp file, no partial oracle
    assert set(OPTIONAL) >= set(o.stages) - {"hidden_out"}
    # the rule of every output: memra creates no directories
    with pytest.raises(OracleError, match="directory .*missing does not exist"):
        write_oracle(tmp_path / "missing" / "o.npz", meta, o.arrays)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.npz"]


# --------------------------------------------------------------------------- precision


def test_resolve_precision():
    cpu = torch.device("cpu")
    assert resolve_precision(None, "auto", cpu)[:2] == ("f32", torch.float32)
    assert resolve_precision(None, "bfloat16", cpu)[:2] == ("bf16", torch.bfloat16)
    assert resolve_precision("bf16", "auto", cpu)[:2] == ("bf16", torch.bfloat16)
    with pytest.raises(PolicyError, match="prec='f32' with dtype='bfloat16' is contradictory") as e:
        resolve_precision("f32", "bfloat16", cpu)
    assert e.value.render(lambda name, value: f"--{name} {value}") == "--prec f32 with --dtype bfloat16 is contradictory (drop one)"
    with pytest.raises(PolicyError, match=r"prec='q5': unknown precision policy \(expected f32\|"):
        resolve_precision("q5", "auto", cpu)


@pytest.mark.parametrize("policy", ["q8", "mixed", "fc", "q4"])
def test_quantized_parity_within_its_bounds(pair, policy):
    root, _, _, dspark = pair
    name, dt, weight_fn = resolve_precision(policy, "auto", torch.device("cpu"))
    drafter = Drafter.load(dspark, dtype=dt, weight_fn=weight_fn)
    report = parity(drafter, read_oracle(root / "dspark.npz"), drafter.own_lm_head, name)
    assert report.passed, [(r.stage, r.path, r.rel_l2) for r in report.results if not r.passed]
    # quantization is really applied: the floats are not f32-exact
    assert max(r.rel_l2 for r in report.results if r.stage == "hidden_out") > 1e-4


def _stand_in_weight_fn_for(policy):
    """A stand-in for memra_cli.engine.quant.precision (the policy map of the spec, reference quantized
    linears): lets the --prec plumbing be tested before the real module lands."""
    from memra_cli.engine.quant.blocks import QuantLinearRef

    def weight_fn(name, ckpt, dtype, device):
        w = ckpt.load(name, torch.float32)
        keep = (policy == "mixed" and ".mlp." not in name) or (policy == "fc" and name == "fc.weight")
        if keep:
            return w.to(dtype).to(device)
        return QuantLinearRef.from_float(w, "q4_0" if policy == "q4" else "q8_0", name).to(device)

    return weight_fn


@pytest.mark.parametrize("policy", ["q8", "q4"])
def test_quantized_plumbing_with_a_stand_in(pair, monkeypatch, policy):
    import types

    root, _, _, dspark = pair
    fake = types.ModuleType("memra_cli.engine.quant.precision")
    fake.weight_fn_for = _stand_in_weight_fn_for
    monkeypatch.setitem(sys.modules, "memra_cli.engine.quant.precision", fake)
    name, dt, weight_fn = resolve_precision(policy, "auto", torch.device("cpu"))
    assert (name, dt) == (policy, torch.float32) and weight_fn is not None
    drafter = Drafter.load(dspark, dtype=dt, weight_fn=weight_fn)
    report = parity(drafter, read_oracle(root / "dspark.npz"), drafter.own_lm_head, name)
    assert report.passed, [(r.stage, r.path, r.rel_l2) for r in report.results if not r.passed]
    worst = max(r.rel_l2 for r in report.results if r.rel_l2 is not None)
    assert 1e-4 < worst < THRESHOLDS[policy].rel_l2
    # the same quantized drafter fails the float32 bounds: the thresholds tell precisions apart
    assert not parity(drafter, read_oracle(root / "dspark.npz"), drafter.own_lm_head, "f32").passed
