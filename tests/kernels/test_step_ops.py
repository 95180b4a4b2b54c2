"""The fixed-width step through the Triton step ops (interpreter on CPU) against the torch ops:
close logits, the same greedy stream, and speculative == plain with the kernels in place."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.step_ops import select_step_ops
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.models.base import load_target
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.errors import SettingError
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_llama, make_tiny_qwen3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGIT_TOL = 1e-4  # f32 relative L2: the kernels accumulate in another order than torch


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("t") / "target", layers=2, head_dim=32, hidden=64)


def _model(target_dir, ops):
    model = Qwen3Target.from_dir(target_dir, torch.float32, DEVICE)
    model.step_ops = ops
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("t") / "llama", layers=2, head_dim=32, hidden=64)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_step_through_the_kernels_matches_the_torch_ops(target_dir, llama_dir, family):
    """LLaMA's step takes the no-norm `rope_kv_write` (and its llama3 tables past the 64
    original positions)."""
    ids = torch.randint(0, 512, (16,), device=DEVICE)
    out = {}
    for name, ops in (("torch", TorchStepOps()), ("triton", TritonStepOps())):
        model = load_target(target_dir if family == "qwen3" else llama_dir, torch.float32, DEVICE)
        model.step_ops = ops
        runner = StepRunner(model, 16)
        state = runner.new_state(96)
        runner.prefill(torch.arange(5, 25, device=DEVICE).repeat(3), state)  # 60 + 16 rows: past 64
        out[name], _ = runner.step(ids, state.length, state)
    ref, got = out["torch"], out["triton"]
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < LOGIT_TOL


@pytest.mark.exhaustive  # an end-to-end interpreter run; the ops' own tests and the model step above are quick
def test_greedy_and_speculative_streams_with_the_kernels(target_dir, tmp_path):
    prompt = list(range(3, 24))
    torch_stream = greedy_reference(StepRunner(_model(target_dir, TorchStepOps()), 16), prompt, 8)
    model = _model(target_dir, TritonStepOps())
    plain = greedy_reference(StepRunner(model, 16), prompt, 8)
    assert plain == torch_stream  # f32 on a tiny model: no near-ties at this tolerance
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=8, target_layer_ids=(0, 1), num_target_layers=2, block_size=8)
    engine = Engine.from_model(model, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    with engine.session(prompt, 8, arm, eos_ids=()) as session:
        assert session.run() == plain


@pytest.mark.exhaustive  # the epilogue's own tests (test_dense_linear, test_quant_linear) are quick
def test_the_swiglu_epilogue_in_a_model_step(target_dir, tmp_path, monkeypatch):
    """With the tiny target's gate/up and q/k/v shapes in the dense kernel's table (bf16: the
    kernel's dtypes), every layer's MLP runs the one-launch SwiGLU (dense_linear glu=True) and its
    q/k/v projection the one-launch norm + rope + K/V write (dense_qkv_rope_kv_write): logits stay
    within bf16 tolerance of the torch ops, and speculative == plain greedy through them."""
    from memra_kernels import dense_linear as dl

    def model_with(ops):
        model = Qwen3Target.from_dir(target_dir, torch.bfloat16, DEVICE)
        model.step_ops = ops
        return model

    model = model_with(TritonStepOps())
    w = model.layers[0].w_gate_up
    monkeypatch.setitem(dl.TUNED, tuple(w.shape), dl.KernelConfig(block_n=32, block_k=32, split_k=2, num_stages=2))
    # the fused q/k/v projection too: its norm, rope and K/V write in the dense kernel's epilogue
    monkeypatch.setitem(dl.TUNED, tuple(model.layers[0].wqkv.shape),
                        dl.KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2))
    glu_calls = []
    real = dl.dense_linear
    monkeypatch.setattr(dl, "dense_linear", lambda x, w, **kw: glu_calls.append(kw.get("glu", False)) or real(x, w, **kw))
    ids = torch.randint(0, 512, (16,), device=DEVICE)
    out = {}
    for name, m in (("torch", model_with(TorchStepOps())), ("triton", model)):
        runner = StepRunner(m, 16)
        state = runner.new_state(96)
        runner.prefill(torch.arange(5, 25, device=DEVICE), state)
        glu_calls.clear()
        out[name], _ = runner.step(ids, state.length, state)
    assert glu_calls.count(True) == len(model.layers)
    ref, got = out["torch"].float(), out["triton"].float()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    prompt = list(range(3, 24))
    plain = greedy_reference(StepRunner(model, 16), prompt, 6)
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=8, target_layer_ids=(0, 1), num_target_layers=2,
                            block_size=8, dtype=torch.bfloat16)
    engine = Engine.from_model(model, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    with engine.session(prompt, 6, arm, eos_ids=()) as session:
        assert session.run() == plain


def test_the_kernels_setting():
    cpu = torch.device("cpu")
    assert select_step_ops(cpu, None, {})[0].name == "torch"
    assert select_step_ops(cpu, None, {"MEMRA_KERNELS": "0"})[0].name == "torch"
    with pytest.raises(SettingError, match="need a CUDA device"):
        select_step_ops(cpu, True, {})
    with pytest.raises(SettingError, match="expected 0 or 1"):
        select_step_ops(cpu, None, {"MEMRA_KERNELS": "yes"})
    with pytest.raises(SettingError, match="expected 0 or 1") as err:
        select_step_ops(cpu, None, {"MEMRA_PDL": "on"})
    assert err.value.setting == "pdl"
    assert select_step_ops(cpu, None, {"MEMRA_PDL": "0"})[0].name == "torch"


def test_the_kernels_receipt_names_where_the_matmuls_run():
    """On CUDA the receipt says which weight matmuls the dense kernel takes (its measured table)
    and that the rest stay on cuBLAS. Built on the CPU: the Triton ops construct without a GPU."""
    from memra_kernels import dense_linear

    ops, note = select_step_ops(torch.device("cuda"), None, {})
    assert ops.name == "triton"
    assert f"dense kernel for the {len(dense_linear.TUNED)} weight shapes" in note
    assert f"up to {dense_linear.MAX_ROWS} rows" in note and "cuBLAS for the others" in note


@pytest.mark.parametrize("t,start,nh,nkv", [(5, 0, 4, 2), (7, 30, 8, 2), (1, 9, 4, 4), (16, 100, 4, 1)])
def test_prefill_attention_is_the_masked_reference(t, start, nh, nkv):
    """The fused prefill attention (a lower-right causal bias, K/V repeated per head) computes
    the reference's folded, masked attention: query i sees keys up to start + i. A chunk after
    cached rows (start > 0) fails with the upper-left rule, so this pins the alignment."""
    g = torch.Generator().manual_seed(t + start)
    n, hd = start + t, 32
    q = torch.randn(t, nh, hd, generator=g).to(DEVICE)
    k, v = (torch.randn(nkv, n, hd, generator=g).to(DEVICE) for _ in range(2))
    keys, rows = torch.arange(n, device=DEVICE), torch.arange(start, n, device=DEVICE)
    mask = (keys[None] <= rows[:, None]).repeat(nh // nkv, 1) if t > 1 else None
    assert TorchStepOps.prefill_mask and not TritonStepOps.prefill_mask
    ref = TorchStepOps.prefill_attention(q, k, v, mask)
    got = TritonStepOps.prefill_attention(q, k, v, None)
    assert got.shape == (t, nh * hd)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_argmax_through_both_ops():
    """The seam's argmax: the same int64 row indices from the torch op and the kernel, ties
    (first index), NaN (the first NaN) and a row of -inf (0) included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (16, 4097), generator=g).float()
    x[1, [70, 9]] = float("nan")
    x[2] = float("-inf")
    x = x.to(DEVICE)
    ref = TorchStepOps.argmax(x)
    got = TritonStepOps().argmax(x)
    assert got.dtype == ref.dtype == torch.long
    assert got.tolist() == ref.tolist()
    assert ref[1].item() == 9 and ref[2].item() == 0
    assert TritonStepOps().argmax(x[:1]).tolist() == ref[:1].tolist()


def test_the_markov_chain_op_builds_its_table_once_for_a_small_vocabulary(monkeypatch):
    """The Triton op runs a small vocabulary's chain over a bias table, built on first use and
    reused (keyed by the weights); a vocabulary whose table would be too big keeps the per-slot
    kernel. Both pick the torch op's tokens."""
    from memra_kernels import markov

    g = torch.Generator().manual_seed(0)
    V, r = 300, 16
    logits = (torch.randn(6, V, generator=g) * 4).to(DEVICE)
    w1 = (torch.randn(V, r, generator=g) / 4).to(DEVICE)
    w2 = torch.randn(V, r, generator=g).to(DEVICE)
    anchor = torch.tensor([7], device=DEVICE)
    ref = TorchStepOps().markov_chain(logits, anchor, w1, w2, torch.float32)
    ops = TritonStepOps()
    assert ops.markov_chain(logits, anchor, w1, w2, torch.float32).tolist() == ref.tolist()
    assert len(ops._markov_tables) == 1
    table = next(iter(ops._markov_tables.values()))[2]
    assert ops.markov_chain(logits, anchor, w1, w2, torch.float32).tolist() == ref.tolist()
    assert next(iter(ops._markov_tables.values()))[2] is table  # reused, not rebuilt
    monkeypatch.setattr(markov, "TABLE_MAX_BYTES", V * V * 4 - 1)
    small = TritonStepOps()
    assert small.markov_chain(logits, anchor, w1, w2, torch.float32).tolist() == ref.tolist()
    assert not small._markov_tables


def test_the_chain_with_its_scores_matches_the_torch_op(monkeypatch):
    """`markov_chain_confidence`: the torch op's candidates and raws (to float32 rounding), over a
    bias table (one launch) and, where none fits, the chain's launches and the head's; with and
    without the head's markov features."""
    from memra_kernels import markov

    g = torch.Generator().manual_seed(2)
    V, r, H, n = 300, 16, 24, 6
    logits = (torch.randn(n, V, generator=g) * 4).to(DEVICE)
    w1, w2 = (torch.randn(V, r, generator=g) / 4).to(DEVICE), torch.randn(V, r, generator=g).to(DEVICE)
    anchor = torch.tensor([7], device=DEVICE)
    hidden = torch.randn(n, H, generator=g).to(DEVICE)
    cw, cb = torch.randn(H + r, generator=g).to(DEVICE), torch.randn(1, generator=g).to(DEVICE)
    cases = ((cw, w1), (cw[:H].contiguous(), None))
    for max_bytes in (markov.TABLE_MAX_BYTES, V * V * 4 - 1):
        monkeypatch.setattr(markov, "TABLE_MAX_BYTES", max_bytes)
        for w, conf_w1 in cases:
            args = (logits, anchor, w1, w2, torch.float32, hidden, w, cb, conf_w1)
            (cand, raws), (ref_cand, ref_raws) = (TritonStepOps().markov_chain_confidence(*args),
                                                  TorchStepOps().markov_chain_confidence(*args))
            assert cand.tolist() == ref_cand.tolist() and cand[0].item() == 7
            assert torch.allclose(raws, ref_raws, rtol=1e-5, atol=1e-5)


def test_the_gather_ops_match_the_torch_ops():
    """The seam's embedding lookup (bit for bit) and confidence head (to float32 rounding)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g).to(DEVICE)
    ids = torch.tensor([3, 39, 0, 3], device=DEVICE)
    assert torch.equal(TritonStepOps().embed(ids, w), TorchStepOps.embed(ids, w))
    hidden, w1 = torch.randn(4, 24, generator=g).to(DEVICE), torch.randn(40, 8, generator=g).to(DEVICE)
    cw, cb = torch.randn(32, generator=g).to(DEVICE), torch.randn(1, generator=g).to(DEVICE)
    for args in ((hidden, cw, cb, ids, w1), (hidden, cw[:24].contiguous(), cb)):
        got, ref = TritonStepOps().confidence_raw(*args), TorchStepOps.confidence_raw(*args)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_the_round_pack_op_matches_the_torch_op():
    cand = torch.tensor([5, 4095, 7, 7], device=DEVICE)
    sel = torch.tensor([1, 2, 3, 4], device=DEVICE)
    raws = torch.tensor([0.5, -3.25, 1e-3], device=DEVICE)
    for args in ((cand, sel, raws), (cand, sel)):
        assert torch.equal(TritonStepOps().pack_round(*args), TorchStepOps.pack_round(*args))


@pytest.mark.exhaustive  # pipelined rounds run quick over the torch ops (tests/engine/test_step_width.py), settle's kernel in test_settle.py
@pytest.mark.parametrize("fused_head", [False, pytest.param(True, marks=pytest.mark.exhaustive)])
def test_pipelined_rounds_with_the_kernels(target_dir, tmp_path, monkeypatch, fused_head):
    """Plain and speculative rounds queued one ahead of the host, settled on the device by the
    settle kernel (through the interpreter; graph capture replaced by an eager stand-in as in
    tests/engine/test_step_width.py): the plain stream. (That they are the rounds read one by one
    is tests/engine/test_step_width.py's, with the torch ops; the kernel equals its twin in
    test_settle.py.) `fused_head`: in bf16 with the lm_head's shape in the dense kernel's table,
    every round's verify and plain step pick by the lm_head's argmax epilogue (lm_head_argmax),
    the reference by the argmax of the widened logits: still the plain stream."""
    from memra_cli.engine.runtime import cuda_graphs
    from memra_cli.engine.spec.policy import PolicySettings
    from memra_kernels import dense_linear as dl

    dtype = torch.bfloat16 if fused_head else torch.float32
    fused_calls = []
    if fused_head:
        shapes = Qwen3Target.from_dir(target_dir, dtype, DEVICE)
        monkeypatch.setitem(dl.TUNED, tuple(shapes.lm_head_weight.shape),
                            dl.KernelConfig(block_n=32, block_k=32, split_k=1, num_stages=2))
        monkeypatch.setitem(dl.TUNED, tuple(shapes.layers[0].wqkv.shape),  # and the fused q/k/v epilogue
                            dl.KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2))
        real = dl.dense_linear
        monkeypatch.setattr(dl, "dense_linear", lambda x, w, **kw: fused_calls.append(
            kw.get("argmax_out") is not None) or real(x, w, **kw))

    def capture(fn, device, pool=None):
        out = fn()

        class Replay:
            def replay(self):
                fresh = fn()
                for mine, new in zip(out if isinstance(out, tuple) else (out,),
                                     fresh if isinstance(fresh, tuple) else (fresh,)):
                    if isinstance(mine, torch.Tensor):
                        mine.copy_(new)

        return Replay(), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    prompt = list(range(3, 24))
    model = Qwen3Target.from_dir(target_dir, dtype, DEVICE)
    model.step_ops = TritonStepOps()
    plain = greedy_reference(StepRunner(model, 16), prompt, 5)
    assert not any(fused_calls)  # the reference picks from the widened logits
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=8, confidence="markov", target_layer_ids=(0, 1),
                            num_target_layers=2, block_size=8, dtype=dtype)
    runner = StepRunner(model, 16)
    runner.cuda_graphs = True  # refused off CUDA at construction; the stand-in captures
    model.ensure_positions(runner.max_rows())
    engine = Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                    round_graphs=True)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark", settings=PolicySettings(vt="confidence-slot")))
    assert engine.pipelined
    with engine.session(prompt, 5, arm, eos_ids=()) as s:  # (read one by one: tests/engine, torch ops)
        assert s.graphed_rounds and s.pipelined
        assert s.run() == plain and sum(s.stats.accept_hist.values()) == s.stats.rounds
    with engine.session(prompt, 5, eos_ids=()) as s:
        assert s.pipelined and s.run() == plain
    assert any(fused_calls) == fused_head


def test_the_fused_head_and_embedding_ops_and_their_unfused_forms(monkeypatch):
    """`lm_head_argmax` and `embed_rms_norm` through the torch ops, the kernels (the dense shape in
    the table, so the argmax epilogue runs) and the kernels' `unfused()`: the same picks and rows
    everywhere, the kernels' logits and norms equal bit for bit fused or not."""
    from memra_kernels import dense_linear as dl

    g = torch.Generator().manual_seed(2)
    h = torch.randn(16, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setitem(dl.TUNED, (96, 64), dl.KernelConfig(block_n=32, block_k=32, split_k=1, num_stages=2))
    calls = []
    real = dl.dense_linear
    monkeypatch.setattr(dl, "dense_linear", lambda x, w, **kw: calls.append(kw.get("argmax_out") is not None)
                        or real(x, w, **kw))
    fused, unfused = TritonStepOps(), TritonStepOps().unfused()
    logits, picks = fused.lm_head_argmax(h, w)
    assert calls == [True]
    u_logits, u_picks = unfused.lm_head_argmax(h, w)
    assert calls[1:] == [False] and torch.equal(logits, u_logits) and torch.equal(picks, u_picks)
    t_logits, _ = TorchStepOps.lm_head_argmax(h, w)
    assert torch.equal(picks, TorchStepOps.argmax(logits)) and t_logits.shape == logits.shape
    table, norm_w = torch.randn(40, 64, generator=g).to(DEVICE), torch.rand(64, generator=g).to(DEVICE) + 0.5
    ids = torch.tensor([3, 39, 0, 3], device=DEVICE)
    (n1, r1), (n2, r2) = fused.embed_rms_norm(ids, table, norm_w, 1e-6), unfused.embed_rms_norm(ids, table, norm_w, 1e-6)
    assert torch.equal(n1, n2) and torch.equal(r1, r2)
    tn, tr = TorchStepOps.embed_rms_norm(ids, table, norm_w, 1e-6)
    assert torch.equal(r1, tr) and torch.allclose(n1, tn, rtol=1e-5, atol=0)  # float32: the sum of squares' order


def _fold_every_weight(model, lm_head, monkeypatch, down_split: int, head_block_n: int) -> list:
    """Put the tiny target's five weight shapes in the dense kernel's table (small tiles, so the
    interpreter and a small GPU run them), so the step folds its norms; returns the list a spy on
    `dense_linear_add_norm` appends to at each fold."""
    from memra_kernels import dense_linear as dl

    layer = model.layers[0]
    for w, cfg in ((layer.wqkv, dl.KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2)),
                   (layer.w_gate_up, dl.KernelConfig(block_n=32, block_k=32, split_k=1, num_stages=2)),
                   (layer.wo, dl.KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2)),
                   (layer.w_down, dl.KernelConfig(block_n=32, block_k=64, split_k=down_split, num_stages=2)),
                   (lm_head, dl.KernelConfig(block_n=head_block_n, block_k=32, split_k=1, num_stages=2))):
        monkeypatch.setitem(dl.TUNED, tuple(w.shape), cfg)
    folds = []
    real = dl.dense_linear_add_norm
    monkeypatch.setattr(dl, "dense_linear_add_norm", lambda *a, **kw: folds.append(1) or real(*a, **kw))
    return folds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_launch_fusions_on_the_gpu(target_dir, monkeypatch):
    """Compiled, with programmatic dependent launch, eager and replayed as a CUDA graph, the bf16
    step with every launch fusion (q/k/v + rope, embedding + norm, lm_head + argmax, the residual
    add + norm folded into o / down and the next matmul; the tiny target's shapes put in the dense
    kernel's table): the graph replays the eager step's logits,
    picks and K/V bit for bit, the picks are the logits' argmax, a row's picks are the same alone,
    and the logits are the unfused ops' within bf16 rounding (the q/k norm's sum of squares may run
    in another order: kernels/rope.py `qkv_rope_epilogue`)."""
    from memra_cli.engine.runtime import cuda_graphs

    model = Qwen3Target.from_dir(target_dir, torch.bfloat16, "cuda")
    folds = _fold_every_weight(model, model.lm_head_weight, monkeypatch, down_split=2, head_block_n=32)
    ids = torch.randint(0, 512, (16,), device="cuda")
    pos = torch.arange(30, 46, device="cuda")
    out = {}
    for name, ops in (("fused", TritonStepOps()), ("unfused", TritonStepOps().unfused())):
        model.step_ops = ops
        state = model.new_state(64)
        folds.clear()
        picks, logits, _ = model.static_step_picks(ids, pos, state)
        assert len(folds) == (2 * len(model.layers) if name == "fused" else 0)
        kv = state.kv.clone()
        graph, (g_picks, g_logits, _) = cuda_graphs.capture(lambda: model.static_step_picks(ids, pos, state, None),
                                                            torch.device("cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_picks, picks) and torch.equal(g_logits, logits) and torch.equal(state.kv, kv)
        assert torch.equal(picks, logits.argmax(dim=-1))
        alone = model.static_step_picks(ids[:1].expand(16).contiguous(), pos, model.new_state(64))[0]
        assert alone[0].item() == picks[0].item()
        out[name] = logits.float()
    ref = out["unfused"]
    assert ((out["fused"] - ref).norm() / ref.norm()).item() < 2e-2  # bf16: a few ulps where a statistic's ulp flips


@pytest.mark.exhaustive  # end-to-end through the interpreter; the fold's own tests (test_dense_norm.py) are quick
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_folded_norms_in_a_model_step(target_dir, llama_dir, tmp_path, monkeypatch, family):
    """With every weight shape of the tiny bf16 target in the dense kernel's table, each layer's o
    and down projections add the residual in their epilogue and the gate/up, next q/k/v and
    lm_head matmuls apply the norms on load (two `dense_linear_add_norm` launches a layer): the
    logits are within bf16 tolerance of `unfused()`'s (whose norm kernel sums the squares in
    another order) and of the torch ops', and speculative == plain greedy through them."""
    path = target_dir if family == "qwen3" else llama_dir

    def model_with(ops):
        model = load_target(path, torch.bfloat16, DEVICE)
        model.step_ops = ops
        return model

    model = model_with(TritonStepOps())
    folds = _fold_every_weight(model, model._lm_head, monkeypatch, down_split=1, head_block_n=64)
    ids = torch.randint(0, 512, (16,), device=DEVICE)
    out = {}
    for name, m in (("torch", model_with(TorchStepOps())), ("unfused", model_with(TritonStepOps().unfused())),
                    ("triton", model)):
        runner = StepRunner(m, 16)
        state = runner.new_state(96)
        runner.prefill(torch.arange(5, 25, device=DEVICE), state)
        folds.clear()
        out[name], _ = runner.step(ids, state.length, state)
    assert len(folds) == 2 * len(model.layers)
    got = out["triton"].float()
    for ref in (out["unfused"].float(), out["torch"].float()):
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    prompt = list(range(3, 24))
    plain = greedy_reference(StepRunner(model, 16), prompt, 6)
    draft = make_tiny_draft(tmp_path / "d", "deepspec", markov_rank=8, target_layer_ids=(0, 1), num_target_layers=2,
                            block_size=8, dtype=torch.bfloat16)
    engine = Engine.from_model(model, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode="dspark"))
    with engine.session(prompt, 6, arm, eos_ids=()) as session:
        assert session.run() == plain


@pytest.mark.parametrize("fold", [False, True], ids=["cublas", "folded"])
def test_the_taps_are_written_in_place_with_the_concatenations_bits(target_dir, monkeypatch, fold):
    """A step that taps (-1, 0, 1) writes each tapped residual straight into its column slice of
    the taps (the embedding's rows, each layer's down projection with its residual add: folded or
    not), where the step used to concatenate them after: the same taps and logits, bit for bit, as
    the concatenating step (`_tap_slots` off), through the kernels; the torch ops' too."""
    def step(ops, slots: bool):
        model = load_target(target_dir, torch.bfloat16, DEVICE)
        model.step_ops = ops
        if fold:
            _fold_every_weight(model, model._lm_head, monkeypatch, down_split=1, head_block_n=64)
        if slots:  # (a dense target: every tapped residual has its slice)
            assert set(model._tap_slots((-1, 0, 1), 16)[1]) == {-1, 0, 1}
        else:
            monkeypatch.setattr(model, "_tap_slots", lambda taps, rows: (None, {}))
        state = model.new_state(64)
        model.ensure_positions(state.max_len)
        ids = torch.arange(7, 23, device=DEVICE)
        logits, taps = model.static_step(ids, torch.arange(20, 36, device=DEVICE), state, taps=(-1, 0, 1))
        return logits, taps

    for ops in (TritonStepOps, TorchStepOps):
        got_logits, got_taps = step(ops(), True)
        want_logits, want_taps = step(ops(), False)
        assert got_taps.shape == (16, 3 * 64) and torch.equal(got_taps, want_taps)
        assert torch.equal(got_logits, want_logits)
