"""Precision policies (the spec's MEMRA_DFLASH_PREC seam): the per-tensor decision map, the
load-time weight_fn (same bytes as the gguf package), markov w2 following the policy, refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from memra_cli.engine.formats.checkpoint import open_checkpoint
from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.quant.precision import (
    FILE_POLICIES, POLICIES, PolicyWeightFn, PrecisionError, check_policy, decide, plan, role_of, weight_fn_for,
)
from memra_cli.engine.quant.blocks import QuantLinearRef, dequantize
from memra_cli.tiny.draft import make_tiny_draft

GG = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

ATTN, MLP, FC = "layers.3.self_attn.k_proj.weight", "layers.0.mlp.down_proj.weight", "fc.weight"
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
M = (64, 64)

# policy -> storage of (attention, MLP, fc, markov w2): the spec's `upw` and its markov branch
TABLE = {
    "f32": ("f32", "f32", "f32", "f32"),
    "bf16": ("bf16", "bf16", "bf16", "bf16"),
    "q8": ("q8_0", "q8_0", "q8_0", "q8_0"),
    "mixed": ("bf16", "q8_0", "bf16", "q8_0"),
    "fc": ("q8_0", "q8_0", "bf16", "q8_0"),
    "q4": ("q4_0", "q4_0", "q4_0", "q4_0"),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_decision_table(policy):
    got = tuple(decide(n, M, policy).storage for n in (ATTN, MLP, FC, W2))
    assert got == TABLE[policy]
    for name, shape in [("norm.weight", (64,)), ("hidden_norm.weight", (64,)), ("layers.1.input_layernorm.weight", (64,)),
                        ("layers.1.post_attention_layernorm.weight", (64,)), ("layers.0.self_attn.q_norm.weight", (16,)),
                        ("layers.0.self_attn.k_norm.weight", (16,))]:
        d = decide(name, shape, policy)
        assert (d.role, d.storage, d.quantized) == ("norm", "f32", False), name
    assert decide("confidence_head.proj.weight", (1, 96), policy).storage == "f32"
    assert decide("confidence_head.proj.bias", (1,), policy).storage == "f32"
    assert decide(W1, (512, 32), policy).storage == "stored"  # a gathered table
    assert decide("embed_tokens.weight", (512, 64), policy).storage == "stored"
    assert decide("lm_head.weight", (512, 64), policy).storage == "stored"


def test_roles():
    assert [role_of(n) for n in (ATTN, "layers.0.self_attn.o_proj.weight", MLP, "layers.12.mlp.gate_proj.weight", FC, W1, W2)] == [
        "attention", "attention", "mlp", "mlp", "fc", "markov_w1", "markov_w2"]
    assert role_of("layers.0.self_attn.q_norm.weight") == "norm"
    assert role_of("something.else") == "other"


@pytest.mark.parametrize("policy", ["q8", "mixed", "fc", "q4"])
def test_rows_not_whole_blocks_are_kept_and_say_why(policy):
    d = decide(W2, (512, 16), policy)  # markov rank 16
    assert d.kept and d.storage == "stored" and not d.quantized
    assert "rows of 16 values are not a multiple of 32" in d.why and "kept unquantized" in d.why
    assert decide(MLP, (64, 48), policy).kept == (TABLE[policy][1] in ("q8_0", "q4_0"))
    assert not decide(W2, (512, 16), "bf16").kept  # nothing asked for blocks


@pytest.mark.parametrize("bad", ["q5", "Q8", "", "int8"])
def test_unknown_policy_is_refused_in_one_line(bad):
    with pytest.raises(PrecisionError) as e:
        weight_fn_for(bad)
    msg = str(e.value)
    assert "\n" not in msg and "MEMRA_DFLASH_PREC" in msg and "--prec" in msg
    assert "f32|bf16|q8|mixed|fc|q4" in msg and repr(bad) in msg
    with pytest.raises(PrecisionError, match=r"--policy: unknown precision policy 'bf16' \(expected q8\|mixed\|fc\|q4\)"):
        check_policy("bf16", FILE_POLICIES, "--policy")
    with pytest.raises(PrecisionError):
        decide(MLP, M, bad)


def test_weight_fn_for():
    assert weight_fn_for("f32") is None
    for p in ("bf16", "q8", "mixed", "fc", "q4"):
        fn = weight_fn_for(p)
        assert isinstance(fn, PolicyWeightFn) and fn.policy == p and fn.kept == []


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    root = tmp_path_factory.mktemp("prec")
    return make_tiny_draft(root / "ds", "deepspec", markov_rank=32, confidence="markov",
                           target_layer_ids=(-1, 1, 3), dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("policy", ["q8", "mixed", "fc", "q4"])
def test_weight_fn_bytes_equal_the_gguf_package(dspark, policy):
    ckpt = open_checkpoint(dspark)
    fn = weight_fn_for(policy)
    decisions = plan(ckpt.tensors, policy)
    n_quant = 0
    for name, d in decisions.items():
        if d.role not in ("attention", "mlp", "fc", "markov_w2"):
            continue
        w = fn(name, ckpt, torch.float32, "cpu")
        src = ckpt.load(name, torch.float32)
        if d.quantized:
            n_quant += 1
            assert isinstance(w, QuantLinearRef) and w.qtype == d.storage and w.shape == tuple(src.shape)
            want = gguf.quants.quantize(src.numpy(), GG[d.storage])
            assert np.array_equal(w.raw.numpy().reshape(-1), want.reshape(-1)), name
            x = torch.randn(3, src.shape[1])
            assert torch.equal(w(x), x @ torch.from_numpy(dequantize(w.raw.numpy(), d.storage, src.shape)).T)
        else:
            assert d.storage == "bf16" and isinstance(w, torch.Tensor) and w.dtype == torch.float32
            assert torch.equal(w, src.to(torch.bfloat16).float()), name
    assert n_quant > 0 and fn.kept == []


def test_markov_w2_follows_the_policy_through_drafter_load(dspark):
    plain = Drafter.load(dspark)
    assert isinstance(plain.markov_w2, torch.Tensor)  # no weight_fn: as before
    for policy, qtype in (("q8", "q8_0"), ("mixed", "q8_0"), ("fc", "q8_0"), ("q4", "q4_0")):
        d = Drafter.load(dspark, weight_fn=weight_fn_for(policy))
        assert isinstance(d.markov_w2, QuantLinearRef) and d.markov_w2.qtype == qtype, policy
        assert isinstance(d.markov_w1, torch.Tensor) and torch.equal(d.markov_w1, plain.markov_w1)  # w1 as stored
        assert d.conf_w.dtype == torch.float32 and torch.equal(d.conf_w, plain.conf_w)  # head f32
        assert torch.equal(d.norm, plain.norm) and torch.equal(d.layers[0].q_norm, plain.layers[0].q_norm)
        # the chain runs through the quantized w2: argmax(logits + dequant(w2) @ w1[prev])
        logits = torch.randn(8, 512)
        anchor = torch.tensor(7)
        w2 = torch.from_numpy(dequantize(d.markov_w2.raw.numpy(), qtype, d.markov_w2.shape))
        prev, want = 7, []
        for k in range(8):
            prev = int(torch.argmax(logits[k] + d.markov_w1[prev] @ w2.T))
            want.append(prev)
        assert d.markov_chain(logits, anchor).tolist() == want
    bf = Drafter.load(dspark, weight_fn=weight_fn_for("bf16"))
    assert isinstance(bf.markov_w2, torch.Tensor) and torch.equal(bf.markov_w2, plain.markov_w2.bfloat16().float())


def test_kept_tensors_are_reported_at_load(tmp_path):
    d = make_tiny_draft(tmp_path / "r16", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    fn = weight_fn_for("q8")
    drafter = Drafter.load(d, weight_fn=fn)
    assert [k.name for k in fn.kept] == [W2]
    assert isinstance(drafter.markov_w2, torch.Tensor) and isinstance(drafter.layers[0].wq, QuantLinearRef)


# ----------------------------------------------------------- fused projections of quantized drafters


def unfused_load(monkeypatch, path, **kw) -> Drafter:
    """The same drafter with every layer's projections left as the loader made them (separate
    matmuls, outputs concatenated): the path a quantized drafter took before it fused."""
    from memra_cli.engine.models.drafter import DraftLayer

    with monkeypatch.context() as m:
        m.setattr(DraftLayer, "fuse", lambda self: self)
        return Drafter.load(path, **kw)


def every_output(d: Drafter, seed: int = 0) -> list[torch.Tensor]:
    """Everything the drafter computes from one context and block: the full (oracle) forward,
    eager ingest + round, and the static (graphed) ingest + round, with their K/V."""
    cfg, b, n_ctx, dev = d.cfg, d.cfg.block_size, 11, d.device
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(n_ctx, cfg.n_taps * cfg.hidden_size, generator=g).to(dev, d.dtype)
    noise = torch.randn(b, cfg.hidden_size, generator=g).to(dev, d.dtype)
    positions = torch.arange(n_ctx + b, device=dev)
    full = d.forward_full(taps, noise, positions)
    kv = d.new_cache(n_ctx)
    d.ingest(kv, taps[:4], positions[:4])
    d.ingest(kv, taps[4:], positions[4:n_ctx])
    rnd = d.forward_round(kv, noise, positions[n_ctx:], keep_layers=True)
    skv = d.new_cache(2 * b)
    d.static_ingest(skv, taps[:b], torch.tensor(0, device=dev))
    static = d.static_round(skv, noise, torch.tensor(b, device=dev))
    return [full.hidden_out, full.layer_out, full.ctx_features, rnd.hidden_out, rnd.layer_out, kv.k, kv.v,
            static, skv.k, skv.v]


def raw_of(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.raw


# policy, compute dtype -> (wqkv kind, w_gate_up kind): a qtype, or "plain" (bf16-rounded floats)
FUSED = {
    ("q8", torch.float32): ("q8_0", "q8_0"),
    ("q4", torch.float32): ("q4_0", "q4_0"),
    ("q4", torch.bfloat16): ("q4_0", "q4_0"),
    ("mixed", torch.float32): ("plain", "q8_0"),
    ("fc", torch.float32): ("q8_0", "q8_0"),
}


@pytest.mark.parametrize("policy,dtype", list(FUSED), ids=[f"{p}-{str(t)[6:]}" for p, t in FUSED])
def test_quantized_drafter_fuses_at_load_and_computes_what_the_separate_matmuls_did(dspark, monkeypatch, policy, dtype):
    """Under a policy that gives q/k/v (and gate/up) one qtype, the layers stack them at load as
    plain ones do: one quantized weight each, the separate projections and the ctx rows' k/v
    views of its block rows. The drafter's every output is bit-identical to the unfused copy's
    (the reference dequantizes row by row, so the stacked matmul is the parts' side by side)."""
    fused = Drafter.load(dspark, dtype, weight_fn=weight_fn_for(policy))
    plain = unfused_load(monkeypatch, dspark, dtype=dtype, weight_fn=weight_fn_for(policy))
    want_qkv, want_gu = FUSED[(policy, dtype)]
    for w, u in zip(fused.layers, plain.layers):
        assert u.wqkv is None and u.wkv is None and u.w_gate_up is None
        for stack, kind, names in ((w.wqkv, want_qkv, ("wq", "wk", "wv")), (w.w_gate_up, want_gu, ("w_gate", "w_up"))):
            if kind == "plain":
                assert isinstance(stack, torch.Tensor)
            else:
                assert isinstance(stack, QuantLinearRef) and stack.qtype == kind
            # the stack holds the loader's bytes, in order; the parts are views of its rows
            assert torch.equal(raw_of(stack), torch.cat([raw_of(getattr(u, n)) for n in names]))
            row = 0
            for n in names:
                part = raw_of(getattr(w, n))
                assert part.data_ptr() == raw_of(stack)[row].data_ptr(), n
                row += part.shape[0]
        assert raw_of(w.wkv).data_ptr() == raw_of(w.wk).data_ptr()
        assert raw_of(w.wkv).shape[0] == raw_of(w.wk).shape[0] + raw_of(w.wv).shape[0]
    for a, b in zip(every_output(fused), every_output(plain)):
        assert torch.equal(a, b)


class _MixedQtypes:
    """A weight_fn whose first layer mixes kinds: q4_0 q beside q8_0 k/v, a plain (f32) gate
    beside a q4_0 up; every other matmul q8_0."""

    def __call__(self, name, ckpt, dtype, device):
        w = ckpt.load(name, torch.float32)
        if name.startswith("layers.0."):
            if "q_proj" in name or "up_proj" in name:
                return QuantLinearRef.from_float(w, "q4_0", name)
            if "gate_proj" in name:
                return w.to(dtype)
        return QuantLinearRef.from_float(w, "q8_0", name)


def test_projections_of_mixed_kinds_stay_separate_and_still_compute(dspark, monkeypatch):
    fused = Drafter.load(dspark, weight_fn=_MixedQtypes())
    plain = unfused_load(monkeypatch, dspark, weight_fn=_MixedQtypes())
    mixed, same = fused.layers[0], fused.layers[1]
    assert mixed.wqkv is None and mixed.wkv is None and mixed.w_gate_up is None
    assert (mixed.wq.qtype, mixed.wk.qtype, mixed.wv.qtype, mixed.w_up.qtype) == ("q4_0", "q8_0", "q8_0", "q4_0")
    assert isinstance(mixed.w_gate, torch.Tensor)
    # the layer where every part is q8_0 fuses all the same
    assert same.wqkv.qtype == same.w_gate_up.qtype == same.wkv.qtype == "q8_0"
    got, want = every_output(fused, seed=1), every_output(plain, seed=1)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    # and the cached round still computes the full forward (the paths agree, as unquantized)
    full, rnd = got[1], got[4]
    assert ((rnd - full).norm() / full.norm()).item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["q8", "q4"])
def test_cuda_quantized_drafter_fuses_into_one_kernel_weight(dspark, monkeypatch, policy):
    """On CUDA the stacks are what `for_device` packs quantized weights into (`QuantLinear`:
    one launch for q/k/v, one for k/v, one for gate/up; the reference where memra_kernels is
    not importable), with the parts views of their rows. Outputs match the unfused drafter
    within float32 rounding, not bit for bit: a stack's tiles come from its own shape."""
    from memra_cli.engine.layers.quantized import for_device

    cuda = torch.device("cuda")
    kind = type(for_device(QuantLinearRef.from_float(torch.ones(32, 32), "q8_0").to(cuda), cuda))
    fused = Drafter.load(dspark, torch.float32, cuda, weight_fn=weight_fn_for(policy))
    plain = unfused_load(monkeypatch, dspark, dtype=torch.float32, device=cuda, weight_fn=weight_fn_for(policy))

    def first_byte(w):
        return (w.packed.qweight if hasattr(w, "packed") else w.raw).data_ptr()

    for w in fused.layers:
        for stack, part in ((w.wqkv, w.wq), (w.wkv, w.wk), (w.w_gate_up, w.w_gate)):
            assert type(stack) is kind and type(part) is kind
            assert first_byte(part) == first_byte(stack)
    for a, b in zip(every_output(fused), every_output(plain)):
        assert a.is_cuda and ((a - b).norm() / b.norm()).item() < 1e-4
