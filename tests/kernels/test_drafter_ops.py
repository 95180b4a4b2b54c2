"""The drafter through the Triton step ops (interpreter on CPU) against the torch step ops.

The drafter's static path (what CUDA graphs replay) takes its norms, q/k norm + rope + K/V
write, SiLU·mul and, on plain layers, attention from the step-ops seam; the eager paths take
the block-level norms and SiLU·mul from it. The torch ops are the reference (bit-identical to
the drafter before the seam); the kernels must agree with them to float32 rounding, and must
keep a round's drafts independent of the storage size and of how the context was ingested.
"""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.layers.ops import gqa_attention
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.quant.precision import weight_fn_for
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 relative L2 error, kernels vs torch ops: a different summation order in the norms'
# statistics and attention, and rope rounded once instead of three times (kernels/rope.py)
F32_TOL = 1e-5
# bfloat16: the same differences, each able to flip a last bf16 bit, compounded over 2 layers
# (measured ~4e-3 on these drafters; a block row made causal in the block measures ~4e-2)
BF16_TOL = 1e-2
LAYOUTS = {
    "full": {},
    "sliding": dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5),
    "causal": dict(is_causal=True),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: make_tiny_draft(root / name, "zlab", **kw) for name, kw in LAYOUTS.items()}


def _drafter(path, ops, dtype=torch.float32, prec=None) -> Drafter:
    d = Drafter.load(path, dtype, DEVICE, weight_fn=weight_fn_for(prec) if prec else None)
    d.step_ops = ops
    return d


def _inputs(d: Drafter, n_ctx: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    width = d.cfg.hidden_size * len(d.cfg.target_layer_ids)
    taps = torch.randn(n_ctx, width, generator=g).to(DEVICE, d.dtype)
    noise = torch.randn(d.cfg.block_size, d.cfg.hidden_size, generator=g).to(DEVICE, d.dtype)
    return taps, noise


def _static(d: Drafter, taps: torch.Tensor, noise: torch.Tensor, cap: int, kept=None):
    """Eager-ingest the first rows (the prompt), static-ingest the last block of rows in blocks
    of `kept` rows each padded to `b` by repeating its last row (as runtime/draft_graphs.py
    `IngestGraph` does with a round's kept rows; default: one block), then a static round.
    Returns (hidden [b, hidden], the cache)."""
    b = d.cfg.block_size
    n_eager = taps.shape[0] - b
    kv = d.new_cache(cap)
    d.ingest(kv, taps[:n_eager], torch.arange(n_eager, device=DEVICE))
    lo = n_eager
    for m in kept or [b]:
        rows = taps[lo:lo + m]
        rows = torch.cat([rows, rows[-1:].expand(b - m, -1)])
        d.static_ingest(kv, rows, torch.tensor(lo, device=DEVICE))
        lo += m
    assert lo == n_eager + b
    kv.length = lo
    return d.static_round(kv, noise, torch.tensor(kv.length, device=DEVICE)), kv


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, F32_TOL), (torch.bfloat16, BF16_TOL)], ids=["f32", "bf16"])
def test_static_round_through_the_kernels_matches_the_torch_ops(drafts, layout, dtype, tol):
    """The kernels' static round and ingest against the torch ops' (the same code), and against
    the torch eager round over an eagerly ingested context (other code: the reference)."""
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        d = _drafter(drafts[layout], ops, dtype)
        taps, noise = _inputs(d, 21)
        hidden, kv = _static(d, taps, noise, 48)
        out[name] = hidden, kv.k[:, :, : kv.length].clone(), kv.v[:, :, : kv.length].clone()
    for got, ref in zip(out["triton"], out["torch"]):
        assert torch.isfinite(got).all()
        assert _rel(got, ref) < tol
    d = _drafter(drafts[layout], TorchStepOps(), dtype)
    kv = d.new_cache(48)
    d.ingest(kv, taps, torch.arange(21, device=DEVICE))
    eager = d.forward_round(kv, noise, torch.arange(21, 21 + d.cfg.block_size, device=DEVICE)).hidden_out
    assert _rel(out["triton"][0], eager) < tol


@pytest.mark.parametrize("prec", ["q8", "q4"])
def test_quantized_static_round_through_the_kernels(drafts, prec):
    """Unfused (quantized) projections are concatenated for the fused ops: same function."""
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        d = _drafter(drafts["full"], ops, prec=prec)
        taps, noise = _inputs(d, 21)
        out[name] = _static(d, taps, noise, 48)[0]
    assert _rel(out["triton"], out["torch"]) < F32_TOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_eager_paths_through_the_kernels_match_the_torch_ops(drafts, layout):
    """forward_full, ingest and forward_round take the block norms and SiLU·mul from the seam."""
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        d = _drafter(drafts[layout], ops)
        taps, noise = _inputs(d, 19)
        b = d.cfg.block_size
        full = d.forward_full(taps, noise, torch.arange(19 + b, device=DEVICE))
        kv = d.new_cache(40)
        d.ingest(kv, taps, torch.arange(19, device=DEVICE))
        rnd = d.forward_round(kv, noise, torch.arange(19, 19 + b, device=DEVICE), keep_layers=True)
        out[name] = full.hidden_out, full.layer_out, full.ctx_features, rnd.hidden_out, rnd.layer_out
    for got, ref in zip(out["triton"], out["torch"]):
        assert _rel(got, ref) < F32_TOL


def test_block_attention_is_causal_attention_at_the_last_position():
    """The claim the static round rests on: every query row at the block's last position `n-1`
    under the causal kernel == unmasked attention over keys `[0, n)`, whatever lies after."""
    from memra_kernels.attention import decode_attention

    g = torch.Generator().manual_seed(0)
    t, nh, nkv, hd, n, rows = 8, 4, 2, 16, 37, 64
    q = torch.randn(t, nh, hd, generator=g).to(DEVICE)
    k = torch.randn(nkv, rows, hd, generator=g).to(DEVICE)
    v = torch.randn(nkv, rows, hd, generator=g).to(DEVICE)
    k[:, n:], v[:, n:] = float("nan"), float("nan")  # stale storage past the block: never read
    last = torch.full((t,), n - 1, dtype=torch.long, device=DEVICE)
    got = decode_attention(q, k, v, last, hd ** -0.5)
    ref = gqa_attention(q, k[:, :n], v[:, :n], None, hd ** -0.5)
    assert torch.isfinite(got).all()
    assert _rel(got, ref) < F32_TOL


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16],
                         ids=["f32", "bf16"])  # quick: bf16, whose rounding would show a changed order first
def test_kernel_round_is_invariant_to_the_storage_and_the_ingest_chunks(drafts, dtype):
    """With the kernels, a round's hidden rows (hence its drafts) are bit-identical whether the
    draft cache storage is small or large (pooled storages come in 256-row buckets) and whether
    the kept rows were ingested in one block or over several rounds (each block padded to b
    rows: a row's K/V must not depend on the rows beside it)."""
    d = _drafter(drafts["full"], TritonStepOps(), dtype)
    taps, noise = _inputs(d, 29)
    ref, _ = _static(d, taps, noise, 40)
    big, _ = _static(d, taps, noise, 300)
    chunked, _ = _static(d, taps, noise, 40, kept=[1, 3, d.cfg.block_size - 4])
    assert torch.equal(big, ref)
    assert torch.equal(chunked, ref)


def test_an_engine_arms_its_drafter_with_its_step_ops(drafts, tmp_path):
    target = make_tiny_qwen3(tmp_path / "target", layers=2, head_dim=32, hidden=64)
    model = Qwen3Target.from_dir(target, torch.float32, DEVICE)
    model.step_ops = TritonStepOps()
    draft = make_tiny_draft(tmp_path / "d", "zlab", target_layer_ids=(0, 1), num_target_layers=2)
    engine = Engine.from_model(model, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    assert arm.drafter.step_ops is model.step_ops


@pytest.mark.exhaustive  # a bf16 round through the dense kernel in the interpreter; the fold's own tests are quick
def test_the_folded_norm_after_the_attention_in_a_drafter_round(drafts, monkeypatch):
    """With the tiny drafter's o and gate/up shapes in the dense kernel's table, each layer's o
    projection adds the residual in its epilogue and the gate/up matmul applies the norm after it
    (`linear_add_rms_norm`, one fold a layer): the round stays within bf16 tolerance of the torch
    ops'."""
    from memra_kernels import dense_linear as dl

    d = _drafter(drafts["full"], TritonStepOps(), torch.bfloat16)
    layer = d.layers[0]
    assert layer.w_gate_up is not None
    monkeypatch.setitem(dl.TUNED, tuple(layer.wo.shape), dl.KernelConfig(block_n=16, block_k=32, split_k=2,
                                                                          num_stages=2))
    monkeypatch.setitem(dl.TUNED, tuple(layer.w_gate_up.shape), dl.KernelConfig(block_n=32, block_k=32, split_k=1,
                                                                                 num_stages=2))
    folds = []
    real = dl.dense_linear_add_norm
    monkeypatch.setattr(dl, "dense_linear_add_norm", lambda *a, **kw: folds.append(1) or real(*a, **kw))
    taps, noise = _inputs(d, 21)
    got = _static(d, taps, noise, 48)[0]
    assert len(folds) == len(d.layers)
    ref = _static(_drafter(drafts["full"], TorchStepOps(), torch.bfloat16), taps, noise, 48)[0]
    assert _rel(got, ref) < BF16_TOL


def test_the_fused_qkv_projection_in_a_drafter_round_and_ingest(drafts, monkeypatch):
    """With the tiny drafter's fused q/k/v and k/v shapes in the dense kernel's table, each layer's
    round projection and each layer's ingest projection take one launch that norms, ropes and
    writes K/V in its epilogue (`qkv_rope_kv_write`): the round's hidden rows and the cache stay
    within tolerance of the torch ops', and a planted rope that skips the epilogue's rotation is
    caught by the same check. (bf16: the dense kernel takes 16-bit weights only.)"""
    from memra_kernels import dense_linear as dl

    dtype, tol = torch.bfloat16, BF16_TOL
    d = _drafter(drafts["full"], TritonStepOps(), dtype)
    layer, hd = d.layers[0], d.cfg.head_dim
    assert layer.wqkv is not None and layer.wkv is not None
    for w in (layer.wqkv, layer.wkv):
        monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=min(16, hd), block_k=32, split_k=1,
                                                                       num_stages=2))
    fused = []
    real = dl.dense_qkv_rope_kv_write
    monkeypatch.setattr(dl, "dense_qkv_rope_kv_write", lambda *a, **kw: fused.append(a[9]) or real(*a, **kw))
    taps, noise = _inputs(d, 21)
    got, kv = _static(d, taps, noise, 48)
    # one fused ingest (no q heads) and one fused round projection a layer
    assert sorted(fused) == [0] * len(d.layers) + [d.cfg.num_attention_heads] * len(d.layers)
    ref, kv_ref = _static(_drafter(drafts["full"], TorchStepOps(), dtype), taps, noise, 48)
    n = kv.length
    assert _rel(got, ref) < tol
    assert _rel(kv.k[:, :, :n], kv_ref.k[:, :, :n]) < tol and _rel(kv.v[:, :, :n], kv_ref.v[:, :, :n]) < tol
    # planted: the rotation dropped (cos 1, sin 0) in the fused launch only: the check above fails
    monkeypatch.setattr(dl, "dense_qkv_rope_kv_write",
                        lambda x, w, qn, kn, cos, sin, *rest: real(x, w, qn, kn, torch.ones_like(cos),
                                                                   torch.zeros_like(sin), *rest))
    bad, _ = _static(d, taps, noise, 48)
    assert _rel(bad, ref) > tol


@pytest.mark.parametrize("ops", [TorchStepOps, TritonStepOps], ids=["torch", "triton"])
def test_a_block_of_tokens_is_embedded_in_the_first_norms_launch(drafts, ops):
    """`static_round` given the block as `BlockTokens` (the target's table, the mask ids, the
    anchor on the device) equals it given the embedded rows of [anchor, mask...], bit for bit
    (`embed_rms_norm` with `first` is the gather then the norm); the mask ids are not written.
    Planted: a block whose anchor is another token is seen."""
    from memra_cli.engine.models.drafter import BlockTokens

    d = _drafter(drafts["full"], ops(), torch.bfloat16)
    b, hidden = d.cfg.block_size, d.cfg.hidden_size
    table = (torch.randn(64, hidden, generator=torch.Generator().manual_seed(5)) * 0.5).to(DEVICE, d.dtype)
    mask_ids = torch.full((b,), 63, device=DEVICE)
    anchor = torch.tensor([9], device=DEVICE)
    taps, _ = _inputs(d, 21)

    def round_of(block):
        kv = d.new_cache(48)
        d.ingest(kv, taps, torch.arange(21, device=DEVICE))
        return d.static_round(kv, block, torch.tensor(21, device=DEVICE))

    got = round_of(BlockTokens(table, mask_ids, anchor))
    assert torch.equal(got, round_of(table[torch.cat([anchor, mask_ids[1:]])]))
    assert (mask_ids == 63).all()
    assert not torch.equal(got, round_of(BlockTokens(table, mask_ids, torch.tensor([10], device=DEVICE))))


def test_the_mlp_and_context_norms_fold_into_the_next_projections(drafts, monkeypatch):
    """With the tiny drafter's weights in the dense kernel's table, a layer's down projection adds
    the residual and leaves the norm after it to the next layer's q/k/v (`linear_add_rms_norm`:
    each layer but the last, whose final norm feeds the heads), and a static ingest's context
    features leave their norm to the k/v projections (`linear_rms_norm`, one launch): the round and
    the cache stay within bf16 tolerance of the torch ops'. Planted: the context's norm folded
    without its weight is seen in the cache's values."""
    from memra_kernels import dense_linear as dl

    d = _drafter(drafts["full"], TritonStepOps(), torch.bfloat16)
    layer, hd = d.layers[0], d.cfg.head_dim
    assert len(d.layers) > 1 and layer.wqkv is not None and layer.wkv is not None
    for w in (layer.wqkv, layer.wkv):
        monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=min(16, hd), block_k=32, split_k=1,
                                                                       num_stages=2))
    for w in (layer.w_down, d.fc):
        monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=16, block_k=32, split_k=1,
                                                                       num_stages=2))
    calls = {"add_norm": 0, "norm": 0}
    real_add, real_norm = dl.dense_linear_add_norm, dl.dense_linear_norm

    def add_norm(*a, **kw):
        calls["add_norm"] += 1
        return real_add(*a, **kw)

    def norm_only(*a, **kw):
        calls["norm"] += 1
        return real_norm(*a, **kw)

    monkeypatch.setattr(dl, "dense_linear_add_norm", add_norm)
    monkeypatch.setattr(dl, "dense_linear_norm", norm_only)
    taps, noise = _inputs(d, 21)
    got, kv = _static(d, taps, noise, 48)
    assert calls == {"add_norm": len(d.layers) - 1, "norm": 1}  # one round, one static ingest
    ref, kv_ref = _static(_drafter(drafts["full"], TorchStepOps(), torch.bfloat16), taps, noise, 48)
    n = kv.length
    assert _rel(got, ref) < BF16_TOL
    assert _rel(kv.k[:, :, :n], kv_ref.k[:, :, :n]) < BF16_TOL and _rel(kv.v[:, :, :n], kv_ref.v[:, :, :n]) < BF16_TOL
    monkeypatch.setattr(dl, "dense_linear_norm", lambda x, w, nw, eps, **kw: real_norm(x, w, torch.ones_like(nw), eps))
    _, kv_bad = _static(d, taps, noise, 48)
    assert _rel(kv_bad.v[:, :, :n], kv_ref.v[:, :, :n]) > BF16_TOL


def test_the_final_norm_folds_into_the_heads_with_the_same_drafts(tmp_path, monkeypatch):
    """A DSpark round's static proposal on the kernels with the target's lm_head in the dense
    kernel's table: the drafter's last layer leaves its final norm to the heads (the static round
    returns a `PendingNorm`), and the drafts, the confidence raws and the candidates equal, bit for
    bit, the heads' over the same rows normed first (`rms_norm_partials`): the lm_head and the
    confidence head apply the norm as they load the rows with its roundings."""
    from memra_cli.engine.spec.proposer import draft_heads
    from memra_kernels import dense_linear as dl
    from memra_kernels.norm import rms_norm_partials

    target_dir = make_tiny_qwen3(tmp_path / "target", layers=2, head_dim=32, hidden=64)
    model = Qwen3Target.from_dir(target_dir, torch.bfloat16, DEVICE)
    model.step_ops = TritonStepOps()
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1),
                            num_target_layers=2)
    arm = Engine.from_model(model, step_width=16).arm(ArmConfig(draft=draft, mode="dspark"))
    d, p = arm.drafter, arm.program
    last_layer = d.layers[-1]
    for w, cfg in ((model.lm_head_weight, dl.KernelConfig(block_n=32, block_k=32, split_k=1, num_stages=2)),
                   (last_layer.w_down, dl.KernelConfig(block_n=16, block_k=32, split_k=1, num_stages=2))):
        monkeypatch.setitem(dl.TUNED, tuple(w.shape), cfg)
    taps, _ = _inputs(d, 21)
    kv = d.new_cache(48)
    d.ingest(kv, taps, torch.arange(21, device=DEVICE))
    noise = model.embed(torch.full((d.cfg.block_size,), 5, device=DEVICE))
    pending = d.static_round(kv, noise, torch.tensor(21, device=DEVICE), heads=model.lm_head_weight)
    assert isinstance(pending, dl.PendingNorm)
    last = torch.tensor([7], device=DEVICE)
    got = draft_heads(d, model, p, pending, last, want_raws=True, want_chain=True)
    normed = rms_norm_partials(pending.rows, pending.sumsq, pending.weight, pending.eps)
    want = draft_heads(d, model, p, normed, last, want_raws=True, want_chain=True)
    assert torch.equal(got.drafts, want.drafts) and torch.equal(got.raws, want.raws)
    assert torch.equal(got.chain, want.chain) and got.chain[0].item() == 7
    plain = d.static_round(kv, noise, torch.tensor(21, device=DEVICE))  # no heads named: a tensor
    assert isinstance(plain, torch.Tensor) and _rel(plain, normed) < BF16_TOL
