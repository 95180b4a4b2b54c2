"""The drafter forward: the full path against the cached path, an independent float64 twin, heads.

- `forward_full` (fresh, from raw taps) and `ingest` (uneven chunks) + `forward_round` agree in
  float32 to rel L2 < 1e-5 on `hidden_out` and every `layer_out`, over rope / window / causal /
  head layout / block size / tap / storage-dtype variants, and again after a second ingest (the
  transient block K/V of the first round must not leak into the next one).
- An independent float64 re-implementation written from DESIGN.md (raw safetensors + config.json,
  a per-query attention loop with the sliding-window and causal-in-block rules) matches the
  drafter; a sliding layer whose window is smaller than the context really masks.
- `markov_chain` is the greedy left-to-right chain `argmax(logits[k] + w2 @ w1[prev])`, prev
  starting at the anchor; `confidence_raw` is `w . [hidden ; w1[prev]] + b` (or `w . hidden + b`).
- A `gpu`-marked variant repeats full-vs-cached on CUDA in float32 (< 1e-5) and bf16 (< 2e-2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from memra_cli.engine.layers.torch_step_ops import TorchStepOps, markov_chain_host
from memra_cli.engine.models.drafter import DraftCapacityError, Drafter
from memra_cli.tiny.draft import make_tiny_draft

from fp32_bounds import reorder_bound

HIDDEN = 64


SLIDING2 = ("sliding_attention", "full_attention")
# name -> (make_tiny_draft kwargs, ctx rows, first position). Every variant is checked full vs cached.
VARIANTS: dict[str, tuple[dict, int, int]] = {
    "default-gqa-b8": ({}, 23, 0),
    "yarn": ({"yarn": True, "seed": 1}, 29, 50),  # positions cross original_max (64)
    "sliding-w5": ({"layer_types": SLIDING2, "sliding_window": 5, "seed": 2}, 21, 0),
    "sliding-w3-lt-block": ({"layer_types": SLIDING2, "sliding_window": 3, "seed": 3}, 17, 7),
    "sliding-declared-noncausal": (
        {"layer_types": SLIDING2, "sliding_window": 6, "is_causal": False, "seed": 4}, 19, 0),
    "full-declared-causal": ({"is_causal": True, "seed": 5}, 15, 3),
    "full-declared-noncausal": ({"is_causal": False, "seed": 6}, 15, 0),
    "mha-b4": ({"kv_heads": 4, "block_size": 4, "seed": 7}, 13, 0),
    "mqa-b16": ({"kv_heads": 1, "block_size": 16, "seed": 8}, 31, 0),
    "b16-sliding-3layers": (
        {"block_size": 16, "layers": 3, "layer_types": ("full_attention", "sliding_attention", "sliding_attention"),
         "sliding_window": 11, "seed": 9}, 40, 0),
    "tap-minus-1": ({"target_layer_ids": (-1, 1, 3), "seed": 10}, 22, 0),
    "bf16-weights": ({"dtype": torch.bfloat16, "seed": 11}, 20, 0),
    "deepspec-b4": ({"fmt": "deepspec", "block_size": 4, "markov_rank": 8, "confidence": "markov", "seed": 12}, 18, 0),
}


def make(root: Path, name: str, kw: dict) -> Path:
    kw = dict(kw)
    fmt = kw.pop("fmt", "zlab")
    return make_tiny_draft(root / name, fmt, **kw)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: make(root, name, kw) for name, (kw, _, _) in VARIANTS.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def inputs(drafter: Drafter, n_ctx: int, first_pos: int, seed: int, device="cpu"):
    """Random raw taps `[n_ctx, n_taps*hidden]`, noise `[b, hidden]`, positions `[n_ctx + b]`."""
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.cfg
    taps = torch.randn(n_ctx, cfg.n_taps * cfg.hidden_size, generator=g) * 2.0
    noise = torch.randn(cfg.block_size, cfg.hidden_size, generator=g)
    positions = torch.arange(first_pos, first_pos + n_ctx + cfg.block_size)
    return taps.to(device), noise.to(device), positions.to(device)


def chunks(n: int) -> list[tuple[int, int]]:
    """Uneven ingest windows covering [0, n): 1, 4, 2, 7, 3, then the rest."""
    out, lo = [], 0
    for size in (1, 4, 2, 7, 3):
        if lo >= n:
            break
        out.append((lo, min(n, lo + size)))
        lo = out[-1][1]
    if lo < n:
        out.append((lo, n))
    return out


def cached(drafter: Drafter, taps, noise, positions, extra_cap: int = 0):
    """Ingest the ctx rows in uneven chunks, then one round with every layer kept."""
    n_ctx = taps.shape[0]
    kv = drafter.new_cache(n_ctx + extra_cap)
    for lo, hi in chunks(n_ctx):
        drafter.ingest(kv, taps[lo:hi], positions[lo:hi])
    assert kv.length == n_ctx
    return kv, drafter.forward_round(kv, noise, positions[n_ctx:], keep_layers=True)


def assert_agree(full, got, tol: float, what: str) -> list[float]:
    errs = [rel_err(got.hidden_out, full.hidden_out)]
    errs += [rel_err(got.layer_out[i], full.layer_out[i]) for i in range(full.layer_out.shape[0])]
    assert got.layer_out.shape == full.layer_out.shape
    assert max(errs) < tol, f"{what}: rel L2 (hidden_out, layer_out...) = {errs}"
    return errs


# --------------------------------------------------------------------------- full vs cached


@pytest.mark.parametrize("name", list(VARIANTS))
def test_full_and_cached_paths_agree(drafts, name):
    _, n_ctx, first = VARIANTS[name]
    drafter = Drafter.load(drafts[name], torch.float32)
    taps, noise, positions = inputs(drafter, n_ctx, first, seed=len(name))
    full = drafter.forward_full(taps, noise, positions)
    assert full.hidden_out.dtype == torch.float32 and torch.isfinite(full.hidden_out).all()
    kv, got = cached(drafter, taps, noise, positions, extra_cap=5)
    assert kv.length == n_ctx, "a round must not commit its block K/V"
    assert_agree(full, got, 1e-5, name)
    # ctx features returned by ingest are the full path's
    kv2 = drafter.new_cache(n_ctx)
    feats = torch.cat([drafter.ingest(kv2, taps[lo:hi], positions[lo:hi]) for lo, hi in chunks(n_ctx)])
    # chunks of other row counts: fc (over n_taps × hidden) and its norm (over hidden) may sum
    # in another order (fp32_bounds.py)
    cfg = drafter.cfg
    assert rel_err(feats, full.ctx_features) < reorder_bound(cfg.n_taps * cfg.hidden_size, cfg.hidden_size)

    # The next round: 3 more committed rows land where the transient block K/V sat; the block
    # moves 3 positions on. It must equal a fresh full forward over the longer context.
    g = torch.Generator().manual_seed(99)
    more = torch.randn(3, taps.shape[1], generator=g)
    taps2 = torch.cat([taps, more])
    noise2 = torch.randn_like(noise)
    positions2 = torch.arange(first, first + n_ctx + 3 + drafter.cfg.block_size)
    drafter.ingest(kv, more, positions2[n_ctx:n_ctx + 3])
    got2 = drafter.forward_round(kv, noise2, positions2[n_ctx + 3:], keep_layers=True)
    assert_agree(drafter.forward_full(taps2, noise2, positions2), got2, 1e-5, name + " (round 2)")
    # keep_layers=False gives the same output, without the stack
    plain = drafter.forward_round(kv, noise2, positions2[n_ctx + 3:])
    assert plain.layer_out is None and torch.equal(plain.hidden_out, got2.hidden_out)


def test_bf16_weights_load_as_float32_exactly(drafts):
    """bf16 storage widened to float32 loses nothing: every weight equals the stored bf16."""
    path = drafts["bf16-weights"]
    stored = load_file(str(path / "model.safetensors"))
    drafter = Drafter.load(path, torch.float32)
    assert stored["fc.weight"].dtype == torch.bfloat16
    assert drafter.fc.dtype == torch.float32 and torch.equal(drafter.fc, stored["fc.weight"].float())
    w = drafter.layers[1].wq
    assert w.dtype == torch.float32 and torch.equal(w, stored["layers.1.self_attn.q_proj.weight"].float())


def test_sliding_window_really_masks(drafts):
    """Window 5 < 21 ctx rows: removing the window (same weights) must change every output,
    and the same holds for the causal-in-block rule on its own."""
    drafter = Drafter.load(drafts["sliding-w5"], torch.float32)
    assert drafter.layouts[0].attention == "sliding" and drafter.layouts[0].window == 5
    assert drafter.layouts[0].causal_in_block and not drafter.layouts[1].causal_in_block
    taps, noise, positions = inputs(drafter, 21, 0, seed=3)
    windowed = drafter.forward_full(taps, noise, positions)
    sliding = drafter.layouts
    drafter.layouts = tuple(dataclasses.replace(lay, window=None) for lay in sliding)
    unwindowed = drafter.forward_full(taps, noise, positions)
    _, unwindowed_cached = cached(drafter, taps, noise, positions)
    drafter.layouts = tuple(dataclasses.replace(lay, causal_in_block=False) for lay in sliding)
    noncausal = drafter.forward_full(taps, noise, positions)
    drafter.layouts = sliding
    assert rel_err(unwindowed_cached.hidden_out, unwindowed.hidden_out) < 1e-5
    for other, what in ((unwindowed, "window removed"), (noncausal, "causal-in-block removed")):
        diff = rel_err(windowed.layer_out[0], other.layer_out[0])
        assert diff > 1e-3, f"{what}: layer 0 barely moved ({diff:.2e}): the mask is not biting"
        # every block row sees a different key set once the window goes (ctx >> window)
        row_diff = (windowed.layer_out[0] - other.layer_out[0]).norm(dim=-1)
        if what == "window removed":
            assert (row_diff > 1e-4).all(), row_diff


def test_draft_cache_refuses_overflow(drafts):
    drafter = Drafter.load(drafts["default-gqa-b8"], torch.float32)
    kv = drafter.new_cache(4)
    taps = torch.randn(5, drafter.cfg.n_taps * HIDDEN)
    drafter.ingest(kv, taps[:3], torch.arange(3))
    with pytest.raises(DraftCapacityError, match="3 \\+ 2 rows > capacity 4"):
        drafter.ingest(kv, taps[3:], torch.arange(3, 5))
    assert kv.length == 3


# --------------------------------------------------------------------------- independent twin


def reference_forward(path: Path, taps, noise, positions):
    """The drafter from DESIGN.md alone, in float64, from the raw files: returns
    (hidden_out `[b, hidden]`, layer_out `[n_layer, b, hidden]`). Default rope only."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "default"
    t = {k: v.double() for k, v in load_file(str(path / "model.safetensors")).items()}
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    declared = cfg.get("is_causal")
    n_ctx, b = taps.shape[0], noise.shape[0]
    pos = positions.double()

    def rms(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x, p):  # x [n, heads, hd] at positions p [n]: NeoX rotate-half
        inv = rope["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = p[:, None] * inv[None, :]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    ctx = rms(taps.double() @ t["fc.weight"].T, t["hidden_norm.weight"])
    x, outs = noise.double(), []
    for li in range(cfg["num_hidden_layers"]):
        p = f"layers.{li}."
        sliding = cfg["layer_types"][li] == "sliding_attention"
        window = cfg["sliding_window"] if sliding else None
        causal = sliding if declared is None else declared
        xn = rms(x, t[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, xn])  # ctx rows are NOT input-layernormed

        def heads(inp, name, n, norm=None):
            y = (inp @ t[p + f"self_attn.{name}.weight"].T).view(inp.shape[0], n, hd)
            return rms(y, t[p + f"self_attn.{norm}.weight"]) if norm else y

        q = rotate(heads(xn, "q_proj", nh, "q_norm"), pos[n_ctx:])
        k = rotate(heads(kv_in, "k_proj", nkv, "k_norm"), pos)
        v = heads(kv_in, "v_proj", nkv)
        attn = torch.zeros(b, nh, hd, dtype=torch.float64)
        for i in range(b):  # one query at a time: which keys may it see?
            qp = pos[n_ctx + i]
            allowed = []
            for j in range(n_ctx + b):
                if window is not None and qp - pos[j] >= window:
                    continue  # further back than the window
                if causal and j >= n_ctx and pos[j] > qp:
                    continue  # a later block row, hidden on a causal-in-block layer
                allowed.append(j)
            idx = torch.tensor(allowed)
            for h in range(nh):
                kh = h // (nh // nkv)
                scores = (k[idx, kh] @ q[i, h]) / math.sqrt(hd)
                attn[i, h] = torch.softmax(scores, 0) @ v[idx, kh]
        x = x + attn.reshape(b, nh * hd) @ t[p + "self_attn.o_proj.weight"].T
        xn = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = xn @ t[p + "mlp.gate_proj.weight"].T, xn @ t[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
        outs.append(x)
    return rms(x, t["norm.weight"]), torch.stack(outs)


INDEPENDENT = {
    "full-noncausal-gqa": {"layers": 2},
    "full-declared-causal-mha": {"is_causal": True, "kv_heads": 4, "block_size": 4},
    "sliding-w9-causal": {"layer_types": SLIDING2, "sliding_window": 9},
    "sliding-w3-causal-lt-block": {"layer_types": ("sliding_attention",) * 2, "sliding_window": 3, "block_size": 16},
    "sliding-w10-noncausal-mqa": {"layer_types": SLIDING2, "sliding_window": 10, "is_causal": False, "kv_heads": 1},
}


@pytest.mark.parametrize("name", list(INDEPENDENT))
def test_attention_semantics_against_an_independent_float64_twin(tmp_path, name):
    """Window: a query at position p sees keys at p' with p - p' < window. Causal in block: a
    block query does not see later block rows. Otherwise everything ([ctx ; block]) is seen."""
    path = make_tiny_draft(tmp_path / name, "zlab", seed=list(INDEPENDENT).index(name), std=0.15, **INDEPENDENT[name])
    drafter = Drafter.load(path, torch.float32)
    n_ctx = 24
    taps, noise, positions = inputs(drafter, n_ctx, 5, seed=1)
    ref_out, ref_layers = reference_forward(path, taps, noise, positions)
    full = drafter.forward_full(taps, noise, positions)
    assert rel_err(full.layer_out[0], ref_layers[0]) < 1e-5, "layer 0 (one layer's attention)"
    assert rel_err(full.layer_out, ref_layers) < 1e-5
    assert rel_err(full.hidden_out, ref_out) < 1e-5
    _, got = cached(drafter, taps, noise, positions)
    assert rel_err(got.hidden_out, ref_out) < 1e-5


# --------------------------------------------------------------------------- heads


@pytest.fixture(scope="module")
def heads_drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    with_markov = make_tiny_draft(root / "m", "deepspec", markov_rank=8, confidence="markov", block_size=8, seed=3)
    plain = make_tiny_draft(root / "p", "nested", markov_rank=8, confidence="plain", block_size=8, seed=4)
    return Drafter.load(with_markov, torch.float32), Drafter.load(plain, torch.float32)


def reference_chain(drafter: Drafter, logits: torch.Tensor, anchor: int, got: list[int]) -> list[int]:
    """The plain python loop, float64. Where the best two scores are within 1e-4 either choice
    is accepted and the loop follows the engine (float32 rounding may break a near-tie)."""
    w1, w2 = drafter.markov_w1.double(), drafter.markov_w2.double()
    prev, out = anchor, []
    for k in range(logits.shape[0]):
        scores = logits[k].double() + w2 @ w1[prev]
        top2 = torch.topk(scores, 2)
        best = int(top2.indices[0])
        if got[k] != best and abs(float(scores[got[k]] - top2.values[0])) < 1e-4:
            best = got[k]
        out.append(best)
        prev = best
    return out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 16), anchor=st.integers(0, 511), seed=st.integers(0, 2**16),
       temp=st.sampled_from([0.1, 1.0, 4.0]))
def test_markov_chain_is_the_greedy_left_to_right_loop(heads_drafter, n, anchor, seed, temp):
    """`temp` scales the logits against the markov bias so both dominate in some examples."""
    drafter = heads_drafter[0]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 512, generator=g) * temp
    got = drafter.markov_chain(logits, torch.tensor(anchor)).tolist()
    assert len(got) == n
    assert got == reference_chain(drafter, logits, anchor, got)
    # a [1]-shaped anchor (what the round passes) is the same chain
    assert drafter.markov_chain(logits, torch.tensor([anchor])).tolist() == got


def test_markov_chain_bias_changes_the_chain(heads_drafter):
    """Sanity that the test above is not vacuous: with weak logits the bias decides."""
    drafter = heads_drafter[0]
    logits = torch.randn(12, 512, generator=torch.Generator().manual_seed(0)) * 0.1
    got = drafter.markov_chain(logits, torch.tensor(7)).tolist()
    assert got != torch.argmax(logits, -1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_markov_chain_over_its_bias_table_is_the_per_slot_chain(heads_drafter, dtype):
    """The torch chain reads its biases from a table built row by row through the per-slot
    GEMV (layers/step_ops.py): each row holds that GEMV's bits, so the chain picks what the
    per-slot chain picks, on logits where the bias decides as well as where the logits do (the
    model-dtype logits of a bf16 drafter too)."""
    drafter = heads_drafter[0]
    w1, w2 = drafter.markov_w1.to(dtype), drafter.markov_w2.to(dtype)
    tabled, per_slot = TorchStepOps(), TorchStepOps()
    per_slot.MARKOV_TABLE_MAX_BYTES = 0  # no table fits: every slot runs its GEMV
    assert per_slot._markov_table(w1, w2, dtype) is None
    table = tabled._markov_table(w1, w2, dtype)
    assert table.shape == (w1.shape[0], w2.shape[0]) and table.dtype == torch.float32
    for p in (0, 7, w1.shape[0] - 1):
        assert torch.equal(table[p : p + 1], TorchStepOps.markov_bias(w1, w2, torch.tensor([p]), dtype))
    assert tabled._markov_table(w1, w2, dtype) is table  # built once
    for seed, temp in ((0, 0.1), (1, 1.0), (2, 4.0)):
        logits = (torch.randn(16, w2.shape[0], generator=torch.Generator().manual_seed(seed)) * temp).to(dtype)
        anchor = torch.tensor([seed * 11])
        want = per_slot.markov_chain(logits, anchor, w1, w2, dtype)
        assert torch.equal(tabled.markov_chain(logits, anchor, w1, w2, dtype), want)
        assert torch.equal(tabled.markov_chain(logits, anchor, w1, w2, dtype, host_loop=True), want)


def _torch_table_chain(logits: torch.Tensor, anchor: int, table: torch.Tensor) -> list[int]:
    """The torch loop over a bias table, one slot at a time (what the CPU chain replaced)."""
    prev, out = torch.tensor([anchor]), []
    for k in range(logits.shape[0]):
        prev = torch.argmax(logits[k : k + 1] + table[prev], dim=-1)
        out.append(int(prev))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_markov_chain_host_is_the_torch_loop(dtype):
    """The CPU chain runs in numpy: the same picks as torch's loop, including where they are
    hard to get right: ties (the first index wins), a NaN (it is the maximum), rows of -inf, a
    bias that overturns the logits' pick in every slot, and narrower logits (widened exactly)."""
    g = torch.Generator().manual_seed(5)
    V = 64
    table = torch.randn(V, V, generator=g) * 3
    cases = [torch.randn(12, V, generator=g) * s for s in (0.01, 1.0, 10.0)]
    ties = torch.zeros(6, V)
    ties[:, 5] = ties[:, 9] = 100.0  # two maxima a row, far above any bias ...
    table_ties = table.clone()
    table_ties[:, 9] = table_ties[:, 5]  # ... and still tied after it: the first (5) wins
    nan = torch.randn(5, V, generator=g)
    nan[2, 40] = float("nan")
    neg_inf = torch.full((3, V), float("-inf"))
    for logits, tab in [(c, table) for c in cases] + [(ties, table_ties), (nan, table), (neg_inf, table)]:
        logits = logits.to(dtype)
        for anchor in (0, 17, V - 1):
            got = markov_chain_host(logits, torch.tensor(anchor), tab)
            assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
            assert got.tolist() == _torch_table_chain(logits, anchor, tab), (dtype, anchor)
    # not vacuous: with weak logits the bias decides every pick
    weak = cases[0]
    assert markov_chain_host(weak, torch.tensor(3), table).tolist() != torch.argmax(weak, -1).tolist()
    assert markov_chain_host(ties, torch.tensor(0), table_ties).tolist() == [5] * 6


def test_cpu_markov_chain_loops_in_numpy_only_when_eager_and_over_a_table(heads_drafter, monkeypatch):
    """TorchStepOps takes the numpy loop only for an eager caller (`host_loop`: a graph body
    reads nothing on the host) on CPU tensors with a table; the torch loop otherwise (a body
    that may be captured; a vocabulary too large for the table). Every way, the same chain."""
    import memra_cli.engine.layers.torch_step_ops as torch_step_ops

    drafter = heads_drafter[0]
    w1, w2 = drafter.markov_w1, drafter.markov_w2
    logits = torch.randn(9, w2.shape[0], generator=torch.Generator().manual_seed(1)) * 0.3
    calls = []
    monkeypatch.setattr(torch_step_ops, "markov_chain_host", lambda *a: calls.append(1) or markov_chain_host(*a))
    tabled, per_slot = TorchStepOps(), TorchStepOps()
    per_slot.MARKOV_TABLE_MAX_BYTES = 0
    anchor = torch.tensor([4])
    want = per_slot.markov_chain(logits, anchor, w1, w2, torch.float32, host_loop=True)
    assert calls == []
    assert torch.equal(tabled.markov_chain(logits, anchor, w1, w2, torch.float32), want)
    assert calls == []
    assert torch.equal(tabled.markov_chain(logits, anchor, w1, w2, torch.float32, host_loop=True), want)
    assert calls == [1]


@pytest.mark.parametrize("which", ["with-markov", "plain"])
def test_confidence_raw_is_the_linear_head(heads_drafter, which):
    drafter = heads_drafter[0] if which == "with-markov" else heads_drafter[1]
    assert drafter.has_confidence and drafter.has_markov
    assert drafter.census.confidence.with_markov == (which == "with-markov")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(8, HIDDEN, generator=g)
    logits = torch.randn(8, 512, generator=g)
    anchor = 42
    chain = drafter.markov_chain(logits, torch.tensor(anchor))
    prev = torch.cat([torch.tensor([anchor]), chain[:-1]])  # [anchor, chain[:-1]]
    got = drafter.confidence_raw(hidden, prev)
    w, b = drafter.conf_w.double()[0], drafter.conf_b.double()[0]
    feats = hidden.double()
    if which == "with-markov":
        feats = torch.cat([feats, drafter.markov_w1.double()[prev]], dim=-1)
    want = feats @ w + b
    assert got.shape == (8,) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * (1 + want.abs().max())
    if which == "with-markov":  # the prev ids matter: a shifted chain scores differently
        assert not torch.allclose(drafter.confidence_raw(hidden, chain), got)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["default-gqa-b8", "yarn", "sliding-w5", "mqa-b16", "tap-minus-1"])
def test_cuda_full_and_cached_paths_agree(drafts, name, dtype):
    _, n_ctx, first = VARIANTS[name]
    drafter = Drafter.load(drafts[name], dtype, "cuda")
    taps, noise, positions = inputs(drafter, n_ctx, first, seed=len(name), device="cuda")
    full = drafter.forward_full(taps, noise, positions)
    _, got = cached(drafter, taps, noise, positions)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    errs = assert_agree(full, got, tol, f"{name} {dtype}")
    print(f"\n[{name} {dtype}] full vs cached rel L2 (hidden_out, layer_out...): {[f'{e:.2e}' for e in errs]}")
    # and the CUDA float32 drafter agrees with the CPU one
    if dtype == torch.float32:
        cpu = Drafter.load(drafts[name], torch.float32)
        ref = cpu.forward_full(taps.cpu(), noise.cpu(), positions.cpu())
        assert rel_err(full.hidden_out.cpu(), ref.hidden_out) < 1e-5
