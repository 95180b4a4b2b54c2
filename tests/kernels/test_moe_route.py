"""The fused routing kernel (memra_kernels.moe_route) against its torch twin (moe_route_ref): the
same picks, weights within the float32 bound of their sums' order, the padding rows and the
expert count; a row's bits whatever the call's row count; planted breakage the same comparison
must catch (ties toward the higher index, the renormalisation off).

Tiny routers (8 experts, top-2 or 3) so the interpreter runs a call in well under a second.
"""

from __future__ import annotations

import pytest
import torch

from memra_kernels import moe_route as mr
from memra_kernels.moe_route_ref import moe_route_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E = 8
U = 2.0**-24


def logits_of(t: int, dtype: torch.dtype, seed: int = 0, n_exp: int = E) -> torch.Tensor:
    """Random router logits `[t, n_exp]` spread wide enough that no two of a row's probabilities
    are within the bound below of each other unless equal (the picks are then the same in any
    summation order)."""
    return (torch.randn(t, n_exp, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE, dtype)


def live_of(n: int | None) -> torch.Tensor | None:
    return None if n is None else torch.tensor([n], dtype=torch.int32, device=DEVICE)


def mismatches(op, logits, k: int, normalize: bool, live=None, scale=None) -> list[str]:
    """How `op` differs from the twin: picks, counts, or a weight outside the bound. Float32: the
    softmax's E-term sum and the renormalisation's k-term sum may add in another order (<= E*u
    and k*u relative), each exp, divide and the scale's product one rounding: (2E + k + 12)*u of
    the weight. Other dtypes: the same float32 difference may flip the final rounding, one ulp
    (2^-7 relative for bf16)."""
    c_op, c_ref = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    w, ids = op(logits, k, normalize, live, c_op, scale)
    w_ref, ids_ref = moe_route_ref(logits, k, normalize, live, c_ref, scale)
    bad = []
    if not torch.equal(ids, ids_ref):
        bad.append("ids")
    if not torch.equal(c_op, c_ref):
        bad.append(f"counts {c_op.tolist()} != {c_ref.tolist()}")
    rel = (2 * logits.shape[1] + k + 12) * U if logits.dtype == torch.float32 else 2.0**-7
    if ((w.double() - w_ref.double()).abs() > rel * w_ref.double().abs()).any():
        bad.append("weights")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,k,normalize,live,scaled", [
    (1, 2, True, None, False), (5, 3, False, None, True), (16, 2, True, 1, False), (16, 3, True, 9, True),
    (70, 2, True, 33, False),  # past COUNT_ROWS: a program per row tile, the twin's counter
], ids=lambda v: str(v))
def test_kernel_matches_the_twin(dtype, t, k, normalize, live, scaled):
    scale = (torch.rand(E, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE, dtype) if scaled else None
    assert mismatches(mr.moe_route, logits_of(t, dtype), k, normalize, live_of(live), scale) == []


def test_padding_rows_route_to_no_expert_and_only_live_rows_count():
    """Rows from `live` on: ids E, weights 0; the count is the call and the live rows' union,
    counted here by hand."""
    logits = logits_of(16, torch.float32, seed=2)
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    w, ids = mr.moe_route(logits, 3, True, live_of(4), counts)
    assert (ids[4:] == E).all() and (w[4:] == 0).all() and (ids[:4] < E).all()
    assert counts.tolist() == [1, len(set(ids[:4].flatten().tolist()))]


def test_a_row_is_the_same_bits_whatever_the_row_count():
    """Row r alone, in a 16-row call, and in a 70-row call (several tiles): the same picks and
    weight bits (the fixed-width rule: a plain step and a verify step route alike)."""
    assert_rows_alike(logits_of(70, torch.bfloat16, seed=3), 3, (0, 7, 15, 40))


def assert_rows_alike(logits: torch.Tensor, k: int, rows) -> None:
    """The kernel's picks and weight bits of the first 16 rows of `logits [70, E]` routed alone
    and in the 70-row call, and of each of `rows` alone and in it."""
    full_w, full_ids = mr.moe_route(logits, k, True)
    part_w, part_ids = mr.moe_route(logits[:16], k, True)
    assert torch.equal(part_w, full_w[:16]) and torch.equal(part_ids, full_ids[:16])
    for r in rows:
        w, ids = mr.moe_route(logits[r:r + 1], k, True)
        assert torch.equal(w[0], full_w[r]) and torch.equal(ids[0], full_ids[r]), r


def tied_logits() -> torch.Tensor:
    """Rows whose probabilities tie exactly (equal logits), so the tie decides a slot."""
    rows = [[0.0, 2.0, 2.0, -1.0, 2.0, 0.5, 0.0, 0.0],  # k=2 picks 1 and 2 (not 4)
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all tied: 0 and 1
            [0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 0.0]]  # 3 and 6
    return torch.tensor(rows, device=DEVICE)


def test_ties_go_to_the_lower_index_and_planted_breakage_is_caught():
    """Kernel and twin pick the lower index on a tie; the comparison catches a twin whose ties go
    to the higher index, and a kernel run with the renormalisation off."""
    logits = tied_logits()
    _, ids = mr.moe_route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [3, 6]]
    assert mismatches(mr.moe_route, logits, 2, True) == []

    def higher_index_first(lg, k, normalize, live=None, counts=None, scale=None):
        w, ids = moe_route_ref(lg.flip(-1), k, normalize, live, counts, scale)
        return w, E - 1 - ids

    assert "ids" in mismatches(higher_index_first, logits, 2, True)

    def renorm_off(lg, k, normalize, live=None, counts=None, scale=None):
        return mr.moe_route(lg, k, False, live, counts, scale)

    assert "weights" in mismatches(renorm_off, logits_of(16, torch.float32), 2, True)


# ----------------------------------------------------------------------------- the router's matmul too

HIDDEN = 48


def router_inputs(t: int, dtype: torch.dtype, seed: int = 0):
    """x `[t, HIDDEN]` and a router `[E, HIDDEN]` whose logits spread as `logits_of`'s do."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, HIDDEN, generator=g).to(DEVICE, dtype),
            (torch.randn(E, HIDDEN, generator=g) * 0.3).to(DEVICE, dtype))


def router_mismatches(op, x, router, k: int, normalize: bool = True, live=None, scale=None,
                      pre_norm=None) -> list[str]:
    """`mismatches` for `router_route` against its twin (`F.linear` then the routing twin). The
    logits now differ too: each of the two float32 dots is within HIDDEN*u of exact, relative to
    Σ|x_i·w_i| (`L`, the row's largest over experts), so a logit moves by δ <= 2*HIDDEN*u*L and a
    softmax (or renormalised) weight, 1/Σ_j exp(l_j - l_e), by <= 2δ relative, beside the
    routing's own (2E + k + 12)*u, E the router's experts. bf16 logits round once more: a
    rounding the other way moves a logit by one ulp, 2^-8*|l|, so the weights by <= 2^-7*max|l|
    beside one bf16 ulp (2^-7).
    `pre_norm` (Gemma 4's router norm): the kernel's sum of squares adds in another order and its
    1/sqrt is not torch's pow(-0.5), so each normed input is within (HIDDEN + 8)*u of the twin's
    (float32: the sum's HIDDEN*u, halved by the root, and the three roundings), or up to three bf16
    ulps (each of its three roundings may go the other way): a logit moves by that times L."""
    c_op, c_ref = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    w, ids = op(x, router, k, normalize, live, c_op, scale, pre_norm)
    w_ref, ids_ref = mr.router_route_ref(x, router, k, normalize, live, c_ref, scale, pre_norm)
    bad = [] if torch.equal(ids, ids_ref) else ["ids"]
    if not torch.equal(c_op, c_ref):
        bad.append(f"counts {c_op.tolist()} != {c_ref.tolist()}")
    if pre_norm is not None:
        x = mr.router_pre_norm_ref(x, *pre_norm)
    logits = x.double() @ router.double().T
    big = (x.double().abs() @ router.double().abs().T).max().item()
    if x.dtype == torch.float32:
        rel = (2 * router.shape[0] + k + 12) * U + 4 * HIDDEN * U * big + (2 * (HIDDEN + 8) * U * big if pre_norm else 0)
    else:
        rel = 2.0**-7 * (1 + logits.abs().max().item() + (3 * big if pre_norm else 0))
    if ((w.double() - w_ref.double()).abs() > rel * w_ref.double().abs()).any():
        bad.append("weights")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,live,scaled", [(1, None, False), (16, 9, True), (40, 33, False)], ids=str)
def test_the_router_kernel_matches_its_twin(dtype, t, live, scaled):
    """One launch for the router's matmul and the routing (a step's 16 rows, a row, 40 rows in
    three tiles): the twin's picks and count, the weights within the bound; a second call the
    same (the arrival counter is put back)."""
    x, router = router_inputs(t, dtype, seed=t)
    scale = (torch.rand(E, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE, dtype) if scaled else None
    assert router_mismatches(mr.router_route, x, router, 3, True, live_of(live), scale) == []
    first = mr.router_route(x, router, 3, True, live_of(live))
    again = mr.router_route(x, router, 3, True, live_of(live))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def gemma_pre_norm(dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, float, float]:
    """Gemma 4's router norm arguments: a learned scale `[HIDDEN]` near 1, hidden^-0.5, eps."""
    scale = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(seed)) + 0.5
    return scale.to(DEVICE, dtype), HIDDEN ** -0.5, 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_router_kernel_norms_gemmas_input_in_its_launch(dtype):
    """Gemma 4's router norm in the router's launch (a step's 16 rows, 9 live, Gemma's scale): the
    twin's picks and count, the weights within the bound; a row's bits the same alone and among 16;
    planted breakage caught: the norm's weight a column off (the picks) and the factor doubled (the
    weights: a softmax of doubled logits)."""
    x, router = router_inputs(16, dtype, seed=11)
    x = x * 7  # the residual stream's scale: the norm must bring it back
    scale = (torch.rand(E, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE, dtype)
    pre = gemma_pre_norm(dtype)
    assert router_mismatches(mr.router_route, x, router, 2, True, live_of(9), scale, pre) == []
    full = mr.router_route(x, router, 2, True, None, None, scale, pre)
    one = mr.router_route(x[5:6], router, 2, True, None, None, scale, pre)
    assert torch.equal(one[0][0], full[0][5]) and torch.equal(one[1][0], full[1][5])
    rolled = lambda x_, r_, k, n, lv, c, s, p: mr.router_route(x_, r_, k, n, lv, c, s, (p[0].roll(1), *p[1:]))
    assert "ids" in router_mismatches(rolled, x, router, 2, True, None, None, pre)
    doubled = lambda x_, r_, k, n, lv, c, s, p: mr.router_route(x_, r_, k, n, lv, c, s, (p[0], 2 * p[1], p[2]))
    assert "weights" in router_mismatches(doubled, x, router, 2, True, None, None, pre)


def test_the_router_kernel_keeps_a_row_its_bits_its_ties_and_catches_a_planted_router():
    """A row's picks and weight bits alone, among 16 and among 40 rows; equal router rows tie
    exactly and go to the lower index; the neighbouring expert's router row (a planted off-by-one)
    is caught by the twin comparison."""
    x, router = router_inputs(40, torch.bfloat16, seed=5)
    full = mr.router_route(x, router, 3, True)
    part = mr.router_route(x[:16], router, 3, True)
    assert torch.equal(part[0], full[0][:16]) and torch.equal(part[1], full[1][:16])
    for r in (0, 15, 39):
        w, ids = mr.router_route(x[r:r + 1], router, 3, True)
        assert torch.equal(w[0], full[0][r]) and torch.equal(ids[0], full[1][r]), r
    tied = router.clone()
    tied[6] = tied[2]
    _, ids = mr.router_route(x, tied, E, True)  # every expert ranked: 2 always before its twin 6
    order = ids.tolist()
    assert all(row.index(2) < row.index(6) for row in order)
    assert "ids" in router_mismatches(lambda x_, r_, *a: mr.router_route(x_, r_.roll(1, 0), *a),
                                      *router_inputs(16, torch.float32), 3)


@pytest.mark.parametrize("pre", [False, True], ids=["plain", "pre_norm"])
def test_the_router_kernels_row_tiles_unrolled_or_looped_give_the_same_bits(monkeypatch, pre):
    """STATIC_ROW_TILES changes how the launch walks its row tiles (an unrolled run skipped past the
    live rows, or a loop over them), never a row's arithmetic: both give the same weights, ids and
    count bits, at a row, a step's 16 rows with 9 live, and 40 rows (three tiles) with 33 and 9
    live, and both match the twin."""
    for t, n_live in ((1, None), (16, 9), (40, 33), (40, 9)):
        x, router = router_inputs(t, torch.bfloat16, seed=t + 7)
        norm = gemma_pre_norm(torch.bfloat16) if pre else None
        got = []
        for static in (True, False):
            monkeypatch.setattr(mr, "STATIC_ROW_TILES", static)
            counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
            got.append((*mr.router_route(x, router, 3, True, live_of(n_live), counts, None, norm), counts))
            assert router_mismatches(mr.router_route, x, router, 3, True, live_of(n_live), None, norm) == [], \
                (t, n_live, static)
        assert all(torch.equal(a, b) for a, b in zip(*got)), (t, n_live)


@pytest.mark.parametrize("fused", [True, False], ids=["router_route", "moe_route"])
def test_padding_rows_contents_change_nothing(fused):
    """A step's padding rows (from `live` on) are never read: NaN and infinities there leave the
    live rows' picks and weight bits and the count as they are with clean rows, and the padding
    rows still route to no expert. 16 rows, 5 live, and 40 rows (three tiles), 18 live: the
    tiles past the last live row too."""
    for t, n_live in ((16, 5), (40, 18)):
        x, router = router_inputs(t, torch.bfloat16, seed=t + 1)
        dirty = x.clone()
        dirty[n_live:] = float("nan")
        dirty[n_live + 1 :: 3] = float("inf")
        if fused:
            run = lambda rows, counts: mr.router_route(rows, router, 3, True, live_of(n_live), counts)
        else:
            run = lambda rows, counts: mr.moe_route(rows @ router.T, 3, True, live_of(n_live), counts)
        c_clean, c_dirty = (torch.zeros(2, dtype=torch.int64, device=DEVICE) for _ in range(2))
        w, ids = run(x, c_clean)
        w_d, ids_d = run(dirty, c_dirty)
        assert torch.equal(w_d[:n_live], w[:n_live]) and torch.equal(ids_d[:n_live], ids[:n_live]), t
        assert (ids_d[n_live:] == E).all() and (w_d[n_live:] == 0).all(), t
        assert torch.equal(c_dirty, c_clean), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_router_kernel_sums_its_hidden_chunks_in_order(monkeypatch, dtype):
    """Chunks of 32 hidden columns (48: a full chunk and a half-masked one, two programs an expert
    tile, the second chunk's partial summed after the first's): the twin's picks and count, the
    weights within the bound, with live rows and with Gemma's pre-norm; a row's bits alone and
    among 16; a 40-expert router (three expert tiles, six programs, the last one routing) against
    the twin as the 8-expert one. Dropping the second chunk would move every logit: the picks would part."""
    monkeypatch.setattr(mr, "ROUTER_CHUNK", 32)
    x, router = router_inputs(16, dtype, seed=21)
    assert router_mismatches(mr.router_route, x, router, 3, True, live_of(9)) == []
    assert router_mismatches(mr.router_route, x * 7, router, 2, True, None, None, gemma_pre_norm(dtype)) == []
    full = mr.router_route(x, router, 3, True)
    one = mr.router_route(x[4:5], router, 3, True)
    assert torch.equal(one[0][0], full[0][4]) and torch.equal(one[1][0], full[1][4])
    half = mr.router_route(x[:, :32].contiguous(), router[:, :32].contiguous(), 3, True)
    assert not torch.equal(half[1], full[1])  # the second chunk moves the picks: the twin check sees it dropped
    wide = (torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.3).to(DEVICE, dtype)
    assert router_mismatches(mr.router_route, x, wide, 4, True, live_of(9)) == []


def test_the_router_kernel_refuses_what_it_does_not_take():
    x, router = router_inputs(mr.COUNT_ROWS + 1, torch.float32)
    assert not mr.router_eligible(x, router) and mr.router_eligible(x[:16], router)
    assert not mr.router_eligible(x[:16], router.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"expected \[t <= 64, hidden\] and \[E <= 1024, hidden\]"):
        mr.router_route(x, router, 2, True)
    with pytest.raises(ValueError, match=r"top-k 9 must lie in \[1, 8\]"):
        mr.router_route(x[:4], router, 9, True)


def test_step_ops_take_the_kernel_and_the_torch_ops_the_twin(monkeypatch):
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    calls = []
    real = mr.moe_route
    monkeypatch.setattr(mr, "moe_route", lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))
    TritonStepOps().moe_route(logits_of(3, torch.float32), 2, True)
    assert calls == [(3, E)]
    assert TorchStepOps.moe_route is moe_route_ref
    # the router and its picks: one launch for a step's rows, the matmul then the routing past them
    fused, real_fused = [], mr.router_route
    monkeypatch.setattr(mr, "router_route", lambda *a, **kw: fused.append(a[0].shape[0]) or real_fused(*a, **kw))
    x, router = router_inputs(mr.COUNT_ROWS + 1, torch.float32)
    ops = TritonStepOps()
    ops.router_route(x[:16], router, 2, True)
    ops.router_route(x, router, 2, True)
    assert fused == [16] and calls == [(3, E), (mr.COUNT_ROWS + 1, E)]
    w, ids = TorchStepOps().router_route(x[:5], router, 2, True)
    w_ref, ids_ref = mr.router_route_ref(x[:5], router, 2, True)
    assert torch.equal(w, w_ref) and torch.equal(ids, ids_ref)  # below the oneDNN row count: F.linear's bits


def test_refusals():
    logits = logits_of(2, torch.float32)
    with pytest.raises(ValueError, match=r"top-k 9 must lie in \[1, 8\]"):
        mr.moe_route(logits, 9, True)
    with pytest.raises(ValueError, match="live rows must be an int32 \\[1\\] tensor"):
        mr.moe_route(logits, 2, True, torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match=r"top-k 9 must lie in \[1, 8\]"):
        moe_route_ref(logits, 9, True)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("n_exp", [128, 256])  # Qwen3-30B-A3B's router, Qwen3.5-35B-A3B's
def test_on_the_gpu_at_the_a3b_shapes_rows_are_invariant_match_the_twin_and_replay(n_exp):
    """The compiled kernel (its real reduction layout): the twin's picks and count, a row's bits
    alone, among 16 and among 70 rows, and a CUDA graph's replay over new logits equal to eager."""
    logits = logits_of(70, torch.bfloat16, seed=4, n_exp=n_exp)
    assert mismatches(mr.moe_route, logits[:16], 8, True, live_of(9)) == []
    assert_rows_alike(logits, 8, (0, 5, 15, 40))
    step, live, counts = logits[:16].clone(), live_of(3), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    mr.moe_route(step, 8, True, live, counts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mr.moe_route(step, 8, True, live, counts)
    step.copy_(logits[16:32])
    counts.zero_()
    graph.replay()
    eager_counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    eager = mr.moe_route(logits[16:32], 8, True, live, eager_counts)
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]) and torch.equal(counts, eager_counts)


def test_the_routing_warps_follow_the_expert_count_alone():
    """16 rows x E logits a tile: 4 warps up to 128 experts, then one more warp per 16 logits a
    thread (256 experts on 4 warps spilled: docs/moe.md, "Measured: the Qwen3.5-35B-A3B step"), at
    most a block's 32."""
    from memra_kernels.moe_route import route_warps

    assert [route_warps(e) for e in (8, 64, 128, 256, 512, 1024)] == [4, 4, 4, 8, 16, 32]


def test_moe_step_router_forms_time_each_form_alone_and_as_a_padded_step_and_put_the_knobs_back(monkeypatch):
    """benchmarks/moe_step.py's `router_forms` sets moe_route's row-tile and stage knobs for each
    form's captures (here a stand-in that runs the calls once, through the interpreter), times
    `x`'s rows alone and as a 16-row step with them live, and restores the knobs; the padded
    step's live rows route as the rows alone do."""
    import types

    from benchmarks import moe_step

    seen = []

    def fake_graphed_ms(fn, iters):
        seen.append((mr.STATIC_ROW_TILES, mr.ROUTER_STAGES, fn()))
        return 0.002, None

    monkeypatch.setattr(moe_step, "graphed_ms", fake_graphed_ms)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    routers = [torch.randn(8, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2)]
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    kept = mr.STATIC_ROW_TILES, mr.ROUTER_STAGES
    got = moe_step.router_forms(x, routers, types.SimpleNamespace(top_k=2, norm_topk_prob=True), counts, 1)
    assert (mr.STATIC_ROW_TILES, mr.ROUTER_STAGES) == kept
    assert got == {form: {"rows": 1.0, "width": 1.0} for form in moe_step.ROUTER_FORMS}
    assert [(s, st) for s, st, _ in seen[::2]] == list(moe_step.ROUTER_FORMS.values())
    for (_, _, alone), (_, _, padded) in zip(seen[::2], seen[1::2]):
        for (w, ids), (w16, ids16) in zip(alone, padded):
            assert w16.shape == (16, 2) and torch.equal(w16[:3], w) and torch.equal(ids16[:3], ids)
            assert (ids16[3:] == 8).all()


@pytest.mark.parametrize("static", [True, False], ids=["unrolled", "looped"])
def test_the_router_kernel_writes_the_live_rows_experts_ranked(monkeypatch, static):
    """`routed`: the union of the live rows' experts in ascending index, then E in every slot
    left (`routed_experts_ref` of the ids), at a row, a step's 16 rows with 1 and 9 live, all 16,
    40 rows with 33 live, and a router of 40 experts (three expert tiles of the router, the
    top-k's 16-column slack); garbage in the buffer before the call changes nothing. Planted and
    caught: one slot of the twin's list dropped."""
    monkeypatch.setattr(mr, "STATIC_ROW_TILES", static)
    for t, n_live, n_exp, k in ((1, None, E, 3), (16, 1, E, 3), (16, 9, E, 2), (16, None, E, 3), (40, 33, E, 3),
                                (16, 9, 40, 4)):
        g = torch.Generator().manual_seed(t + n_exp)
        x = torch.randn(t, HIDDEN, generator=g).to(DEVICE, torch.bfloat16)
        router = (torch.randn(n_exp, HIDDEN, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
        routed = torch.full((n_exp,), -7, dtype=torch.int32, device=DEVICE)
        w, ids = mr.router_route(x, router, k, True, live_of(n_live), routed=routed)
        want = mr.routed_experts_ref(ids, n_exp)
        assert torch.equal(routed, want), (t, n_live, n_exp, routed.tolist(), want.tolist())
        live_ids = ids[:t if n_live is None else n_live]
        assert int((routed < n_exp).sum()) == int(torch.unique(live_ids).numel())
        plain = mr.router_route(x, router, k, True, live_of(n_live))  # the same picks without the list
        assert torch.equal(plain[0], w) and torch.equal(plain[1], ids)
        dropped = torch.cat([want[1:], want.new_full((1,), n_exp)])
        assert not torch.equal(routed, dropped)


def test_the_routed_twin_ranks_the_distinct_experts_then_pads_with_e():
    """`routed_experts_ref` by hand: duplicates once, ascending, a padding row's E ignored."""
    ids = torch.tensor([[5, 1], [1, 7], [8, 8]])
    assert mr.routed_experts_ref(ids, 8).tolist() == [1, 5, 7, 8, 8, 8, 8, 8]
    assert mr.routed_experts_ref(torch.full((2, 3), 4), 4).tolist() == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="routed must be a contiguous int32"):
        x, router = router_inputs(2, torch.float32)
        mr.router_route(x, router, 2, True, routed=torch.zeros(E, dtype=torch.int64, device=DEVICE))


def test_a_host_bound_makes_the_rows_past_it_padding_and_keeps_the_rest_their_bits():
    """`bound` (a plain decode step reads one row): the rows from it on route to no expert
    whatever `live` says, the rows before it keep their bits, the list and the count hold their
    experts only; the same with `live` below the bound. Refused: a bound below 1."""
    x, router = router_inputs(16, torch.bfloat16, seed=21)
    full_w, full_ids = mr.router_route(x, router, 3, True, live_of(9))
    for b, n_live in ((1, 9), (4, 9), (4, None), (12, 9)):
        routed = torch.empty(E, dtype=torch.int32, device=DEVICE)
        counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        w, ids = mr.router_route(x, router, 3, True, live_of(n_live), counts, routed=routed, bound=b)
        real = min(b, 16 if n_live is None else n_live)
        assert torch.equal(ids[:real], full_ids[:real]) and torch.equal(w[:real], full_w[:real]), b
        assert (ids[real:] == E).all() and (w[real:] == 0).all(), b
        assert torch.equal(routed, mr.routed_experts_ref(ids, E)) and int((routed < E).sum()) <= 3 * real
        assert counts.tolist() == [1, int(torch.unique(ids[:real]).numel())]
    with pytest.raises(ValueError, match="bound must be a positive int"):
        mr.router_route(x, router, 3, True, bound=0)
