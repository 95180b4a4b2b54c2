"""The few-row MoE kernels (memra_kernels.moe) against their torch twin (moe_ref), with either gate
activation (silu: SwiGLU; gelu_tanh: Gemma 4's experts), their row-count invariance bit for bit,
and planted bugs the same checks must catch: a wrong expert index, the wrong activation, top-k
ties broken toward the higher index, a combine that sums in row order.

Shapes are tiny (8 experts, hidden 64, intermediate 48: a masked I tile) so the interpreter
runs a call in well under a second.
"""

from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from memra_kernels import moe, moe_ref, moe_route_ref
from memra_kernels._pdl import pdl_wait
from memra_kernels.moe_ref import moe_swiglu_ref

# GELU-tanh's exp overflows (to the saturated 0 it should give) in the interpreter's numpy
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
E, H, I = 8, 64, 48
SMALL = moe.MoeConfig(block_i=16, block_n=16, block_k=16, num_stages=2)  # several tiles and K steps a program

# Kernel and twin round the same values in the same order (moe_ref's docstring); they differ in
# float32 summation order only. Per element, with u = 2^-24 and magnitudes taken over |values|
# (`magnitude`): each h-long gate / up dot of either is within h*u of exact, so they differ by
# <= 2h*u*G; the activation's slope (|silu'| <= 1.1, |gelu_tanh'| <= 1.13) and |act(g)| <= |g|
# carry that to act as <= (2*1.13h + 2h)*u*G*U, with a few u for exp and the two roundings; the
# I-long down dot adds 2I*u; the combine's k products and k adds 2k*u. Total
# (4.26h + 2I + 2k + 8)*u of `magnitude`, against O(1) of the output for a wrong expert, weight
# or activation (the magnitude is ~sqrt(h*I) times the output's size).
F32_UNITS = 4.26 * H + 2 * I + 2 * 8 + 8
# bf16: the same float32 differences can flip a rounding to bf16 the other way, one bf16 ulp
# (<= 2^-7 relative) at gate, up, silu, act, down, each product and add of the combine: at most
# ~(6 + k) * 2^-8 of the output's norm in all (flips are rare: most elements are the same bits).
BF16_REL = (6 + 3) * 2.0**-8


def inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0, shape=(E, H, I)):
    """x [m, h], routing weights [m, k] (normalised softmax values), ids [m, k] (distinct in a
    row, in descending weight like top-k), and the expert weights, in `dtype`; `shape` (E, h, I)."""
    n_exp, h, inter = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    w_gate_up = torch.randn(n_exp, 2 * inter, h, generator=g) * h ** -0.5
    w_down = torch.randn(n_exp, h, inter, generator=g) * inter ** -0.5
    probs = torch.softmax(torch.randn(m, n_exp, generator=g) * 2, dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    weights = weights / weights.sum(-1, keepdim=True)
    return tuple(t.to(DEVICE, dtype) for t in (x, weights)) + (ids.to(DEVICE),) + \
        tuple(t.to(DEVICE, dtype) for t in (w_gate_up, w_down))


def magnitude(x, weights, ids, w_gate_up, w_down) -> torch.Tensor:
    """Σ_j |w_j| · |down_e| @ (|x| @ |gate_e|.T ⊙ |x| @ |up_e|.T), float64 `[m, H]`: the scale of
    every summation the op does, the unit its float32 error bound is counted in."""
    x, weights = x.double().abs(), weights.double().abs()
    gu, down = w_gate_up.double().abs(), w_down.double().abs()
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for j, e in enumerate(ids[r].tolist()):
            g, u = (gu[e] @ x[r]).chunk(2)
            out[r] += weights[r, j] * (down[e] @ (g * u))
    return out


def twin_violations(op, m: int, k: int, dtype: torch.dtype, config=None, seed: int = 0,
                    activation: str = "silu") -> int:
    """Elements (f32) of `op` outside the derived bound of the twin (with `activation`), or 1 if
    bf16's relative error is over its bound; 0 means the op matches."""
    x, w, ids, gu, down = inputs(m, k, dtype, seed)
    kw = {} if config is None else {"config": config}
    out = op(x, w, ids, gu, down, activation, **kw)
    ref = moe_swiglu_ref(x, w, ids, gu, down, activation)
    assert out.dtype == dtype and out.shape == (m, H)
    if dtype == torch.float32:
        bound = F32_UNITS * 2.0**-24 * magnitude(x, w, ids, gu, down)
        return int(((out.double() - ref.double()).abs() > bound.to(out.device)).sum()) + int(out.isnan().sum())
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return int(not rel <= BF16_REL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 32, 33], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [2, 3], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_kernel_matches_the_twin(dtype, m, k, config, activation):
    """Every row count up to past a row tile (33: two tiles), k a power of two or not (padded
    slots), the default tiles (one K step, a masked I tile) and small ones (several of each),
    each gate activation."""
    assert twin_violations(moe.moe_swiglu, m, k, dtype, config, activation=activation) == 0


def test_planted_wrong_expert_index_is_caught():
    """The f32 bound sees an expert's output taken from its neighbour, and a row's weights
    applied to its other slot's expert (a slot mix-up in the combine)."""

    def neighbour(x, w, ids, gu, down, act):
        return moe.moe_swiglu(x, w, (ids + 1) % E, gu, down, act)

    def swapped_slots(x, w, ids, gu, down, act):
        return moe.moe_swiglu(x, w.flip(-1), ids, gu, down, act)

    assert twin_violations(neighbour, 16, 2, torch.float32) > 0
    assert twin_violations(swapped_slots, 16, 2, torch.float32) > 0
    assert twin_violations(neighbour, 16, 2, torch.bfloat16) > 0


EXPERT_GRID = moe.MoeConfig(programs_per_sm=0)  # a program per (expert, tile): moe.CONFIG's grid
WORK_ITEMS = moe.MoeConfig(programs_per_sm=1)  # the other grid: a program per multiprocessor looping over items


@pytest.mark.parametrize("m", [1, pytest.param(16, marks=pytest.mark.exhaustive)], ids=lambda m: f"M{m}")
def test_the_program_count_changes_no_bit(monkeypatch, m):
    """The matmuls' work items (routed expert, tile) give the same bits whichever program runs
    them: one program, a few, more programs than items, and a program per (expert, tile) of
    every expert; a one-row step (a plain decode's) and sixteen rows."""
    x, w, ids, gu, down = inputs(m, 3, torch.bfloat16, seed=11)
    want = moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID)
    for sms in (1, 3, 64):
        monkeypatch.setattr(moe, "INTERPRETED_SMS", sms)
        assert torch.equal(moe.moe_swiglu(x, w, ids, gu, down, config=WORK_ITEMS), want), sms


@pytest.mark.parametrize("m", [1, 16, pytest.param(33, marks=pytest.mark.exhaustive)], ids=lambda m: f"M{m}")
def test_the_routed_list_changes_no_bit(monkeypatch, m):
    """With the call's ranked expert list (`routed`, the router kernel's; here its twin's) the
    matmuls run a program per (tile, rank), the routed experts' first, or loop over the list's
    items: the same bits as the grid over every expert, at a row (a plain decode's; the grid then
    has m * k = 3 ranks, not E), sixteen and
    33 (two row tiles: an expert of the list that one tile's rows did not pick runs nothing
    there), with a padding row, and through the combine's add + norm; TAKE_ROUTED off ignores
    the list."""
    x, w, ids, gu, down = inputs(m, 3, torch.bfloat16, seed=13)
    if m > 1:
        ids[-1], w[-1] = E, 0  # a padding row: in no list
    routed = moe_route_ref.routed_experts_ref(ids, E).to(DEVICE)
    want = moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID)
    assert torch.equal(moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID, routed=routed), want)
    for sms in (1, 3, 64):
        monkeypatch.setattr(moe, "INTERPRETED_SMS", sms)
        assert torch.equal(moe.moe_swiglu(x, w, ids, gu, down, config=WORK_ITEMS, routed=routed), want), sms
    res, nw = add_norm_inputs(m, torch.bfloat16)
    fused = moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res, nw, 1e-6, routed=routed)
    unlisted = moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res, nw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(fused, unlisted))
    monkeypatch.setattr(moe, "TAKE_ROUTED", False)
    short = torch.cat([routed[1:], routed.new_full((1,), E)])
    assert torch.equal(moe.moe_swiglu(x, w, ids, gu, down, routed=short), want)


@pytest.fixture
def unwritten_nan(monkeypatch):
    """Float buffers the ops allocate start as NaN, not as whatever memory the allocator hands
    back (often the same call's lines from a moment before): a plant that leaves an expert's
    lines unwritten then shows, every run."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


def test_a_grid_sized_by_the_bound_gives_the_same_bits(unwritten_nan):
    """`max_routed` (the router's host bound times k: a plain decode step's one row reads at most
    k experts) sizes the grid's ranks: a step of 16 rows with one live gives the bits of the grid
    over every expert, at the bound and above it; a bound below the list's length is caught (a
    routed expert's programs never launched); refused without a list."""
    x, w, ids, gu, down = inputs(16, 3, torch.bfloat16, seed=16)
    ids[1:], w[1:] = E, 0  # one live row
    routed = moe_route_ref.routed_experts_ref(ids, E).to(DEVICE)
    want = moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID)
    for cap in (3, 5, E):
        assert torch.equal(moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID, routed=routed, max_routed=cap),
                           want), cap
    short = moe.moe_swiglu(x, w, ids, gu, down, config=EXPERT_GRID, routed=routed, max_routed=2)
    assert not torch.equal(short[0], want[0])
    with pytest.raises(ValueError, match="max_routed"):
        moe.moe_swiglu(x, w, ids, gu, down, max_routed=3)


@pytest.mark.parametrize("config", [EXPERT_GRID, WORK_ITEMS], ids=["grid", "items"])
def test_a_planted_short_routed_list_is_caught(config, unwritten_nan):
    """The f32 bound sees a routed list one expert short (its rows get nothing from it), and a
    list naming an expert no row picked in place of one that was (wrong expert, no output)."""
    x, w, ids, gu, down = inputs(3, 2, torch.float32, seed=14)  # at most 6 of the 8 experts
    routed = moe_route_ref.routed_experts_ref(ids, E).to(DEVICE)
    assert int((routed < E).sum()) < E, "the plant needs an expert no row picked"
    ref = moe_swiglu_ref(x, w, ids, gu, down)
    bound = F32_UNITS * 2.0**-24 * magnitude(x, w, ids, gu, down).to(ref.device)
    short = torch.cat([routed[1:], routed.new_full((1,), E)])
    unpicked = int(next(e for e in range(E) if e not in routed.tolist()))
    swapped = routed.clone()
    swapped[0] = unpicked
    for bad in (short, swapped):
        out = moe.moe_swiglu(x, w, ids, gu, down, config=config, routed=bad)
        assert not ((out.double() - ref.double()).abs() <= bound).all()  # a NaN is outside it too


_routed_experts = moe._routed_experts  # the real one, for the plant below to call once patched in


@triton.jit
def _one_expert_short(ids_ptr, m0, M, E, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Planted: the routed experts counted one short (the last one's items never run)."""
    hit, n, rank = _routed_experts(ids_ptr, m0, M, E, K_TOP, BLOCK_M, BLOCK_E)
    return hit, n - 1, rank


@triton.jit
def _rank_as_expert(hit, rank, u, BLOCK_E: tl.constexpr):
    """Planted: an item's expert is its rank, not the rank's routed expert."""
    return u


@pytest.mark.parametrize("plant", [_one_expert_short, _rank_as_expert], ids=["count", "rank"])
def test_planted_work_item_bugs_are_caught(monkeypatch, plant, unwritten_nan):
    """The f32 bound sees the items miss a routed expert, or run experts no row picked."""
    name = "_routed_experts" if plant is _one_expert_short else "_nth_expert"
    monkeypatch.setattr(moe, name, plant)
    assert twin_violations(moe.moe_swiglu, 1, 2, torch.float32, config=WORK_ITEMS) > 0


def test_planted_wrong_activation_is_caught():
    """The GELU-tanh twin sees the kernels run with SiLU (a Gemma expert on the Qwen epilogue) in
    float32's bound: the bound tells the two activations apart. (A swapped switch, the other way
    too, fails test_kernel_matches_the_twin, which runs each activation.)"""

    def silu_instead(x, w, ids, gu, down, act):
        return moe.moe_swiglu(x, w, ids, gu, down, "silu")

    assert twin_violations(silu_instead, 8, 2, torch.float32, activation="gelu_tanh") > 0


# ----------------------------------------------------------------------------- invariance


def sharing_variants(x, w, ids, r: int, n_exp: int = E):
    """Steps in which row r keeps its input, weights and experts while every other row (a) routes
    to exactly row r's experts, in another slot order, or (b) to none of them."""
    m, k = ids.shape
    mine = ids[r]
    others = torch.tensor([e for e in range(n_exp) if e not in mine.tolist()], device=ids.device)
    share, apart = ids.clone(), ids.clone()
    for q in range(m):
        if q != r:
            share[q] = mine.roll(q % k)
            apart[q] = others.roll(q)[:k]
    return [(x, w, share), (x, w, apart)]


def invariance_violations(op, dtype: torch.dtype, rows=(0, 7, 31), k: int = 3, shape=(E, H, I)) -> list[str]:
    """How `op` breaks row invariance: row r of a 32-row step must be the same bits computed
    alone (M = 1), in the first r+1 rows, with every other row sharing its experts or none of
    them, and with other rows' inputs changed."""
    x, w, ids, gu, down = inputs(32, k, dtype, seed=3, shape=shape)
    full = op(x, w, ids, gu, down)
    bad = []
    for r in rows:
        if not torch.equal(op(x[r:r + 1], w[r:r + 1], ids[r:r + 1], gu, down)[0], full[r]):
            bad.append(f"row {r} alone")
        if not torch.equal(op(x[:r + 1], w[:r + 1], ids[:r + 1], gu, down)[r], full[r]):
            bad.append(f"row {r} in a {r + 1}-row step")
        for name, (xs, ws, idv) in zip(("sharing", "apart"), sharing_variants(x, w, ids, r, shape[0])):
            if not torch.equal(op(xs, ws, idv, gu, down)[r], full[r]):
                bad.append(f"row {r} with the others {name}")
    noisy = x.clone()
    noisy[1:] = (torch.randn(31, shape[1], generator=torch.Generator().manual_seed(9)) * 4).to(DEVICE, dtype)
    if not torch.equal(op(noisy, w, ids, gu, down)[0], full[0]):
        bad.append("row 0 with other inputs")
    return bad


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16],
                         ids=str)  # quick: bf16, the dtype exactness is judged in
def test_a_row_is_the_same_bits_whatever_shares_its_step(dtype):
    assert invariance_violations(moe.moe_swiglu, dtype) == []


@pytest.mark.exhaustive  # quick: SiLU's above; the activation is elementwise in the epilogue, no row mixing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gelu_row_is_the_same_bits_whatever_shares_its_step(dtype):
    assert invariance_violations(lambda *a: moe.moe_swiglu(*a, "gelu_tanh"), dtype) == []


def test_slot_order_does_not_change_a_row():
    """A row's experts are added in ascending expert index whatever slot the router put them in
    (the twin's order): permuting the slots, weights with their ids, gives the same bits."""
    x, w, ids, gu, down = inputs(8, 3, torch.bfloat16, seed=4)
    out = moe.moe_swiglu(x, w, ids, gu, down)
    perm = torch.tensor([2, 0, 1], device=ids.device)
    assert torch.equal(moe.moe_swiglu(x, w[:, perm], ids[:, perm], gu, down), out)


def test_int32_ids_give_the_int64_bits():
    x, w, ids, gu, down = inputs(6, 3, torch.bfloat16, seed=10)
    assert torch.equal(moe.moe_swiglu(x, w, ids.int(), gu, down), moe.moe_swiglu(x, w, ids, gu, down))


def padded_step(dtype, live: int = 5, m: int = 16, k: int = 3):
    """A step of `m` rows whose rows from `live` on are padding (as `moe_route_ref` routes them:
    ids E, weights 0); the live rows route among experts 0..E-2 and expert E-1's weights are NaN,
    so an op that ran the padding rows on a real expert would leave NaN in their output."""
    x, w, ids, gu, down = inputs(m, k, dtype, seed=12, shape=(E - 1, H, I))
    nan = float("nan")
    gu, down = torch.cat([gu, torch.full_like(gu[:1], nan)]), torch.cat([down, torch.full_like(down[:1], nan)])
    pad = torch.arange(m, device=ids.device)[:, None] >= live
    return x, w.masked_fill(pad, 0), ids.masked_fill(pad, E), gu, down


@pytest.mark.parametrize("op", [moe.moe_swiglu, moe_swiglu_ref], ids=["kernels", "twin"])
def test_padding_rows_read_no_expert_and_a_live_row_keeps_its_bits(op):
    """Padding rows (every id E) come out zero, reading no expert; each live row is the same bits
    as in a step of the live rows alone. Planted: an op that runs the padding rows on real
    experts (E-1 among them, distinct in a row as the kernels require) is caught."""
    x, w, ids, gu, down = padded_step(torch.bfloat16)
    out = op(x, w, ids, gu, down)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    assert torch.equal(out[:5], op(x[:5], w[:5], ids[:5], gu, down))
    real = torch.tensor([E - 1, 0, 1], device=ids.device).expand_as(ids)
    unmasked = op(x, w, torch.where(ids == E, real, ids), gu, down)
    assert not torch.equal(unmasked[5:], torch.zeros_like(unmasked[5:]))


def add_norm_inputs(m: int, dtype: torch.dtype):
    """A residual stream `[m, H]` and a norm weight `[H]` for the fused add + norm."""
    g = torch.Generator().manual_seed(21)
    return (torch.randn(m, H, generator=g).to(DEVICE, dtype),
            (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16], ids=str)
def test_the_add_and_norm_in_the_combine_give_the_unfused_ops_bits(dtype):
    """`moe_swiglu_add_rms_norm` (the residual add and next norm in the combine's launch) against
    `moe_swiglu` then `norm.add_rms_norm`: the same bits (in the interpreter both norms sum the
    same squares in the same order), padding rows included (their new residual is the residual,
    normed); the twin within bf16's rounding bound. Planted: the neighbouring row's residual."""
    from memra_kernels import norm

    x, w, ids, gu, down = padded_step(dtype)
    res, nw = add_norm_inputs(x.shape[0], dtype)
    normed, new_res = moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res, nw, 1e-6)
    want_normed, want_res = norm.add_rms_norm(moe.moe_swiglu(x, w, ids, gu, down), res, nw, 1e-6)
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    assert torch.equal(new_res[5:], res[5:])
    ref_normed, _ = moe_ref.moe_swiglu_add_rms_norm_ref(x, w, ids, gu, down, res, nw, 1e-6)
    assert ((normed.float() - ref_normed.float()).norm() / ref_normed.float().norm()).item() <= BF16_REL
    planted, _ = moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res.roll(1, 0), nw, 1e-6)
    assert not torch.equal(planted, want_normed)


@pytest.mark.exhaustive  # the matmuls are moe_swiglu's (invariant above); the combine's norm is one program a row
def test_a_row_through_the_add_and_norm_is_the_same_bits_whatever_shares_its_step():
    """The fused op's normed output of a row, its residual a function of its own input, is the
    same bits alone, among other rows, sharing experts or not."""
    nw = add_norm_inputs(1, torch.bfloat16)[1]

    def fused(x, w, ids, gu, down):
        return moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, (x * 0.5 + 1).contiguous(), nw, 1e-6)[0]

    assert invariance_violations(fused, torch.bfloat16) == []


def shared_inputs(m: int, dtype: torch.dtype):
    """The Qwen3.5 MoE layer end's other operands: the shared expert's output `[m, H]`, its gate
    logits `[m, 1]` (spread over the sigmoid's slope), a residual `[m, H]` and the float32 `1 + w`."""
    g = torch.Generator().manual_seed(23)
    shared = torch.randn(m, H, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(m, 1, generator=g) * 3).to(DEVICE, dtype)
    res = torch.randn(m, H, generator=g).to(DEVICE, dtype)
    return shared, gate, res, (1 + torch.randn(H, generator=g) * 0.1).to(DEVICE)


def shared_rel(dtype: torch.dtype) -> float:
    """Relative L2 bound between two computations of the shared layer end: bf16 `BF16_REL` (each
    rounding, the sigmoid's now too, flipped at most once); float32 the routed part's F32_UNITS of
    its magnitude (~sqrt(H*I) times the output's size: the bound's preamble) plus a few u for the
    sigmoid's exp (numpy's or libdevice's, not torch's) and the norm's sum."""
    return BF16_REL if dtype == torch.bfloat16 else (F32_UNITS * (H * I) ** 0.5 + H + 16) * 2.0**-24


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16], ids=str)
def test_the_shared_expert_add_and_zero_centred_norm_in_the_combine(dtype):
    """`moe_swiglu_shared_add_rms_norm_1p` (Qwen3.5 MoE's layer end in the combine's launch)
    against its twin (the unfused ops: `moe_swiglu_ref`, the torch gate and add, `add_rms_norm_1p_ref`)
    within the bound, padding rows included (no routed expert; their shared expert and residual
    stay). Planted: the neighbouring row's gate, the norm's weight without its 1, caught."""
    x, w, ids, gu, down = padded_step(dtype)
    shared, gate, res, w1p = shared_inputs(x.shape[0], dtype)
    normed, new_res = moe.moe_swiglu_shared_add_rms_norm_1p(x, w, ids, gu, down, shared, gate, res, w1p, 1e-6)
    ref_normed, ref_res = moe_ref.moe_swiglu_shared_add_rms_norm_1p_ref(x, w, ids, gu, down, shared, gate, res,
                                                                       w1p, 1e-6)
    tol = shared_rel(dtype)
    assert rel_l2(normed, ref_normed) <= tol and rel_l2(new_res, ref_res) <= tol
    assert rel_l2(new_res[5:], (res + torch.sigmoid(gate) * shared)[5:]) <= tol  # padding: no routed term
    for planted in ((shared, gate.roll(1, 0), res, w1p), (shared, gate, res, w1p - 1)):
        bad, _ = moe.moe_swiglu_shared_add_rms_norm_1p(x, w, ids, gu, down, *planted, 1e-6)
        assert rel_l2(bad, ref_normed) > 10 * tol


@pytest.mark.exhaustive  # the matmuls are moe_swiglu's (invariant above); the combine is one program a row
def test_a_row_through_the_shared_layer_end_is_the_same_bits_whatever_shares_its_step():
    """The shared layer end's normed output of a row, its other operands functions of its own
    input, is the same bits alone, among other rows, sharing experts or not."""
    w1p = shared_inputs(1, torch.bfloat16)[3]

    def fused(x, w, ids, gu, down):
        own = (x * 0.5 + 1).contiguous()
        return moe.moe_swiglu_shared_add_rms_norm_1p(x, w, ids, gu, down, own, x[:, :1].contiguous(), x, w1p, 1e-6)[0]

    assert invariance_violations(fused, torch.bfloat16) == []


def gemma_inputs(m: int, dtype: torch.dtype):
    """Gemma 4's layer-end operands: the dense MLP's output and the residual `[m, H]`, the three
    block norms (post 1, post 2, post-feed-forward) and the next norm `[H]` (distinct, near 1),
    the layer scalar `[1]`."""
    g = torch.Generator().manual_seed(29)
    dense, res = (torch.randn(m, H, generator=g).to(DEVICE, dtype) for _ in range(2))
    norms = tuple((torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype) for _ in range(3))
    return dense, res, norms, (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype), \
        torch.tensor([0.75], dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16], ids=str)
def test_gemmas_layer_end_in_the_combine_matches_its_twin(dtype):
    """`moe_gemma_add_norm` (Gemma 4's MoE layer end in the combine's launch: its post norm, the
    dense MLP's, their sum's, the residual add, the scalar, the next norm) against its twin
    (today's torch ops) within the bound of `shared_rel` (the same roundings; the norms' sums and
    1/sqrt in another order), padding rows included (their dense MLP and residual stay).
    Planted: the two post norms swapped, the neighbouring row's dense output, caught."""
    x, w, ids, gu, down = padded_step(dtype)
    dense, res, norms, w_next, scalar = gemma_inputs(x.shape[0], dtype)
    new_res, normed = moe.moe_gemma_add_norm(x, w, ids, gu, down, dense, res, norms, w_next, 1e-6, scalar)
    ref_res, ref_normed = moe_ref.moe_gemma_add_norm_ref(x, w, ids, gu, down, dense, res, norms, w_next, 1e-6, scalar)
    tol = shared_rel(dtype)
    assert rel_l2(new_res, ref_res) <= tol and rel_l2(normed, ref_normed) <= tol
    swapped = (norms[1], norms[0], norms[2])
    for planted in ((dense, res, swapped), (dense.roll(1, 0), res, norms)):
        _, bad = moe.moe_gemma_add_norm(x, w, ids, gu, down, *planted, w_next, 1e-6, scalar)
        assert rel_l2(bad, ref_normed) > 3 * tol  # well outside the bound


@pytest.mark.exhaustive  # the matmuls are moe_swiglu's (invariant above); the combine is one program a row
def test_a_row_through_gemmas_layer_end_is_the_same_bits_whatever_shares_its_step():
    """Gemma's layer end: a row's normed output, its dense output and residual functions of its
    own input, is the same bits alone, among other rows, sharing experts or not."""
    _, _, norms, w_next, scalar = gemma_inputs(1, torch.bfloat16)

    def fused(x, w, ids, gu, down):
        return moe.moe_gemma_add_norm(x, w, ids, gu, down, (x * 0.5 + 1).contiguous(), x, norms, w_next, 1e-6,
                                      scalar)[1]

    assert invariance_violations(fused, torch.bfloat16) == []


def test_the_add_and_norm_refuse_tensors_they_do_not_take():
    x, w, ids, gu, down = inputs(4, 2, torch.float32)
    res, nw = add_norm_inputs(4, torch.float32)
    with pytest.raises(ValueError, match=r"residual \(3, 64\) torch.float32 and norm weight \(64,\) torch.float32 "
                                         r"do not fit x \(4, 64\)"):
        moe.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res[:3], nw, 1e-6)
    assert not moe.norm_eligible(x, res, nw.to(torch.bfloat16))


@triton.jit
def _row_order_combine_kernel(y_ptr, ids_ptr, wts_ptr, out_ptr, H, E, stride_om, res_ptr, norm_w_ptr, res_out_ptr,
                              eps, K_TOP: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                              NORM: tl.constexpr = False, PDL: tl.constexpr = False):
    """A planted combine: one float32 running sum over the step's rows in row order (a segmented
    prefix sum), each row's result the difference of the sums after and before it. Exact in real
    arithmetic; in floats a row's rounding depends on the rows before it."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    before = tl.zeros((BLOCK,), tl.float32)
    after = tl.zeros((BLOCK,), tl.float32) + 1.0  # an offset, as a prefix over earlier rows would carry
    for r in range(0, row + 1):
        before = after
        for j in range(K_TOP):
            w = tl.load(wts_ptr + r * K_TOP + j).to(tl.float32)
            y = tl.load(y_ptr + (r * K_TOP + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
            after = after + w * y
    tl.store(out_ptr + row * stride_om + offs, (after - before).to(out_ptr.dtype.element_ty), mask=ok)


@pytest.mark.exhaustive  # an interpreter run of the whole kernel chain (quick-tier time); the twin-level plant is quick
def test_planted_row_order_combine_is_caught(monkeypatch):
    monkeypatch.setattr(moe, "_moe_combine_kernel", _row_order_combine_kernel)
    assert invariance_violations(moe.moe_swiglu, torch.float32, rows=(7, 31))


# ----------------------------------------------------------------------------- routing ties


def naive_rows(x, router, gu, down, k):
    """One row at a time in float64, top-k by (-p, index): ties to the lower index."""
    out = []
    for row in x.double():
        p = torch.softmax(router.double() @ row, -1)
        top = sorted(range(E), key=lambda e: (-p[e].item(), e))[:k]
        acc = torch.zeros_like(row)
        for e in top:
            g, u = (gu[e].double() @ row).chunk(2)
            acc += (down[e].double() @ (torch.nn.functional.silu(g) * u)) * (p[e] / sum(p[j] for j in top))
        out.append(acc)
    return torch.stack(out)


def test_routing_ties_go_to_the_lower_index_and_a_planted_reversal_is_caught():
    """Router rows 2 and 5 are equal, so their probabilities tie exactly in every row; with
    k = 3 the tie decides a slot for rows whose top two are elsewhere. Routing (layers/moe.route)
    then the kernel must give the naive definition; routing whose ties go to the higher index
    (a planted reversal of the sort) must not."""
    from memra_cli.engine.layers.moe import route, topk_lowest_index

    x, _, _, gu, down = inputs(16, 3, torch.float32, seed=5)
    router = (torch.randn(E, H, generator=torch.Generator().manual_seed(6)) * 0.3).to(DEVICE)
    router[5] = router[2]
    w, ids = route(x, router, 3, True)
    assert ((ids == 2).any(-1) & ~(ids == 5).any(-1)).any(), "no row's slot was decided by the tie"
    naive = naive_rows(x.cpu(), router.cpu(), gu.cpu(), down.cpu(), 3)
    ok = moe.moe_swiglu(x, w, ids, gu, down).double().cpu()
    bound = F32_UNITS * 2.0**-24 * magnitude(x, w, ids, gu, down).cpu() + 1e-6 * naive.abs().max()  # + softmax ulps
    assert ((ok - naive).abs() <= bound).all()

    def higher_index_first(p, k):
        v, i = topk_lowest_index(p.flip(-1), k)
        return v, p.shape[-1] - 1 - i

    probs = torch.softmax(torch.nn.functional.linear(x, router), -1, dtype=torch.float32)
    wr, idr = higher_index_first(probs, 3)
    wr = (wr / wr.sum(-1, keepdim=True)).to(x.dtype)
    planted = moe.moe_swiglu(x, wr, idr, gu, down).double().cpu()
    assert not ((planted - naive).abs() <= bound).all()


# ----------------------------------------------------------------------------- the seam


def test_step_ops_take_the_kernels_and_the_torch_ops_the_twin(monkeypatch):
    """TritonStepOps.moe_swiglu runs the kernels for a step and for a prefill chunk past one row
    tile, the twin only for weights the kernels do not take (rows not contiguous);
    TorchStepOps.moe_swiglu is the twin."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    calls = []
    real = moe.moe_swiglu
    monkeypatch.setattr(moe, "moe_swiglu", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    fused = []
    real_fused = moe.moe_swiglu_add_rms_norm
    monkeypatch.setattr(moe, "moe_swiglu_add_rms_norm", lambda *a, **kw: fused.append(a[0].shape[0]) or real_fused(*a, **kw))
    ops = TritonStepOps()
    x, w, ids, gu, down = inputs(moe.BLOCK_M + 8, 2, torch.float32, seed=7)
    ops.moe_swiglu(x[:4], w[:4], ids[:4], gu, down)
    ops.moe_swiglu(x, w, ids, gu, down)
    assert calls == [4, moe.BLOCK_M + 8]
    strided = gu.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, columns contiguous
    assert torch.equal(ops.moe_swiglu(x, w, ids, strided, down), moe_swiglu_ref(x, w, ids, strided, down))
    assert calls == [4, moe.BLOCK_M + 8]
    assert TorchStepOps.moe_swiglu is moe_swiglu_ref
    # the add + norm: in the combine's launch, or (a residual it does not take) the experts, then the norm
    res, nw = add_norm_inputs(4, torch.float32)
    ops.moe_swiglu_add_rms_norm(x[:4], w[:4], ids[:4], gu, down, res, nw, 1e-6)
    assert fused == [4] and calls == [4, moe.BLOCK_M + 8]
    rows_apart = torch.cat([res, res], dim=1)[:, :H]  # the residual's rows strided: the fused launch takes none
    ops.moe_swiglu_add_rms_norm(x[:4], w[:4], ids[:4], gu, down, rows_apart, nw, 1e-6)
    assert fused == [4] and calls == [4, moe.BLOCK_M + 8, 4]
    assert TorchStepOps.moe_swiglu_add_rms_norm is moe_ref.moe_swiglu_add_rms_norm_ref


def test_the_router_hands_its_ranked_experts_to_the_expert_launch_once(monkeypatch):
    """TritonStepOps.router_route's launch ranks the live rows' experts, and the expert launch
    handed those very ids takes the list (the routed experts' programs first), once: ids from
    elsewhere, or a second call, run the grid over every expert. The same bits either way, and
    TAKE_ROUTED off (the A/B knob) the same bits again."""
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    seen = []
    real = moe._expert_lines
    monkeypatch.setattr(moe, "_expert_lines", lambda *a: seen.append(None if a[7] is None else a[7].tolist())
                        or real(*a))
    ops = TritonStepOps()
    x, _, _, gu, down = inputs(16, 3, torch.bfloat16, seed=15)
    router = (torch.randn(E, H, generator=torch.Generator().manual_seed(4)) * 0.3).to(DEVICE, torch.bfloat16)
    live = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    w, ids = ops.router_route(x, router, 3, True, live)
    res, nw = add_norm_inputs(16, torch.bfloat16)
    listed = ops.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res, nw, 1e-6)
    assert seen == [moe_route_ref.routed_experts_ref(ids, E).tolist()]
    again = ops.moe_swiglu_add_rms_norm(x, w, ids, gu, down, res, nw, 1e-6)  # handed over once
    assert seen[1] is None and all(torch.equal(a, b) for a, b in zip(listed, again))
    w2, ids2 = ops.router_route(x, router, 3, True, live)
    ops.moe_swiglu(x, w2, ids2.clone(), gu, down)  # ids the router did not return: no list
    assert seen[2] is None
    monkeypatch.setattr(moe, "TAKE_ROUTED", False)
    w3, ids3 = ops.router_route(x, router, 3, True, live)
    off = ops.moe_swiglu_add_rms_norm(x, w3, ids3, gu, down, res, nw, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(listed, off))


def test_the_twin_while_capturing_runs_every_expert_for_the_same_bits(monkeypatch):
    """While a CUDA graph is captured the twin may read nothing on the host: it runs every expert
    instead of the routed ones (`unique`), and gives the same bits. Here the capture is stood in
    for: `moe_ref.capturing` says so, and NoHostReads refuses any host read."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "engine" / "host_reads.py"
    spec = importlib.util.spec_from_file_location("host_reads", path)
    host_reads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_reads)
    x, w, ids, gu, down = inputs(16, 3, torch.bfloat16, seed=8)
    eager = moe_swiglu_ref(x, w, ids, gu, down)
    with pytest.raises(AssertionError, match="reads a device value on the host"), host_reads.NoHostReads():
        moe_swiglu_ref(x, w, ids, gu, down)  # eagerly it reads the routed ids
    monkeypatch.setattr(moe_ref, "capturing", lambda x: True)
    with host_reads.NoHostReads():
        captured = moe_swiglu_ref(x, w, ids, gu, down)
    assert torch.equal(captured, eager)


def test_refusals():
    x, w, ids, gu, down = inputs(4, 2, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        moe.moe_swiglu(x, w[:3], ids, gu, down)
    with pytest.raises(ValueError, match="are not"):
        moe.moe_swiglu(x, w, ids, gu, down[:, :, :8])
    with pytest.raises(ValueError, match="expert weights are"):
        moe.moe_swiglu(x, w, ids, gu.to(torch.bfloat16), down)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe.moe_swiglu(x, w, ids.float(), gu, down)
    with pytest.raises(ValueError, match="block_k"):
        moe.moe_swiglu(x, w, ids, gu, down, config=moe.MoeConfig(block_k=24))
    for op in (moe.moe_swiglu, moe_swiglu_ref):
        with pytest.raises(ValueError, match="activation 'gelu' is not one of silu, gelu_tanh"):
            op(x, w, ids, gu, down, "gelu")


# ----------------------------------------------------------------------------- on the GPU

A3B = (128, 2048, 768)  # Qwen3-30B-A3B's experts, hidden, expert intermediate (top-8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_the_gpu_at_the_a3b_shape_rows_are_invariant_and_match_the_twin():
    """The real matrix units (the interpreter multiplies row by row): a row's bits do not depend
    on its place in the row tile or on the rows beside it, and bf16 kernels match the twin."""
    assert invariance_violations(moe.moe_swiglu, torch.bfloat16, rows=(0, 13, 31), k=8, shape=A3B) == []
    x, w, ids, gu, down = inputs(16, 8, torch.bfloat16, seed=12, shape=A3B)
    out, ref = moe.moe_swiglu(x, w, ids, gu, down), moe_swiglu_ref(x, w, ids, gu, down)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() <= (6 + 8) * 2.0**-8


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replay_follows_the_routing():
    """Captured once (the kernels, and the twin, which then runs every expert), replayed over new
    inputs and routing written in place: each equals its eager call, bit for bit."""
    x, w, ids, gu, down = inputs(16, 8, torch.bfloat16, seed=13, shape=A3B)
    for op in (moe.moe_swiglu, moe_swiglu_ref):
        op(x, w, ids, gu, down)  # compile / warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, w, ids, gu, down)
        for seed in (14, 15):
            x2, w2, ids2, _, _ = inputs(16, 8, torch.bfloat16, seed=seed, shape=A3B)
            x.copy_(x2)
            w.copy_(w2)
            ids.copy_(ids2)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, op(x, w, ids, gu, down)), (op.__name__, seed)
