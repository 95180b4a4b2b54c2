"""Gated DeltaNet step kernels (conv update, delta-rule recurrence) vs their torch twins, and the
grouping invariance that keeps fixed-width steps exact: a token's output and state are the same
bits whether it runs alone or in a 16-row step, through the kernel and through the twin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels.deltanet import (  # noqa: E402
    causal_conv_silu, causal_conv_silu_ref, gated_delta_replay_dev, gated_delta_replay_dev_ref, gated_delta_restore,
    gated_delta_restore_ref, gated_delta_rule, gated_delta_rule_layers, gated_delta_rule_layers_ref,
    gated_delta_rule_ref, ring_window, ring_window_ref, stash_restore, stash_restore_ref,
)

# Tolerances against the twin. Conv: one K-tap float32 sum (FMA contraction and Triton's exp in
# SiLU differ from torch by a float32 ulp or so), then rounded: f32 1e-5, bf16 a rare one-ulp flip
# of the rounded value (2^-7 relative). Recurrence: float32 throughout, but the per-row rsqrt /
# exp / sums differ from torch's by ulps and the state carries them from row to row; over 17 rows
# they stay below 1e-5 relative (measured ~1e-6 under the interpreter).
CONV_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
REC_RTOL, REC_ATOL = 1e-5, 1e-6
ROWS = (1, 3, 16, 17)
# (key heads, value heads, dk, dv): Qwen3.5 repeats key heads to value heads (4B: 16 -> 32, 128 x 128)
HEADS = [(2, 4, 64, 64), (1, 2, 128, 128), (2, 2, 64, 128)]


def _rand(*shape, seed, scale=1.0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _inputs(t, hk, hv, dk, dv, dtype, device, seed=0):
    """Conv output rows, g (log decay, negative) and beta in (0, 1), a non-trivial state."""
    qkv = _rand(t, 2 * hk * dk + hv * dv, seed=seed, dtype=dtype, device=device)
    g = -torch.nn.functional.softplus(_rand(t, hv, seed=seed + 1)).to(device) * 0.5
    beta = torch.sigmoid(_rand(t, hv, seed=seed + 2)).to(device)
    state = _rand(hv, dk, dv, seed=seed + 3, scale=0.3, device=device)
    return qkv, g, beta, state


# --------------------------------------------------------------------------- conv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("c", [64, 640 + 37])
def test_conv_matches_ref(t, c, dtype, device):
    window = _rand(3, c, seed=1, dtype=dtype, device=device)
    x = _rand(t, c, seed=2, dtype=dtype, device=device)
    w = _rand(c, 4, seed=3, scale=0.5, device=device)
    got, want = causal_conv_silu(window, x, w), causal_conv_silu_ref(window, x, w)
    assert got.shape == (t, c) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=CONV_RTOL[dtype], atol=1e-6)
    if dtype != torch.float32:
        assert (got != want).float().mean().item() <= 0.02


@pytest.mark.parametrize("fn", [causal_conv_silu, causal_conv_silu_ref], ids=["kernel", "twin"])
def test_conv_rows_do_not_depend_on_the_grouping(fn, device):
    c = 200
    window = _rand(3, c, seed=4, dtype=torch.bfloat16, device=device)
    x = _rand(16, c, seed=5, dtype=torch.bfloat16, device=device)
    w = _rand(c, 4, seed=6, device=device)
    whole = fn(window, x, w)
    xs = torch.cat([window, x])
    for r in range(16):  # one row at a time, each given the window of the three inputs before it
        assert torch.equal(fn(xs[r:r + 3], x[r:r + 1], w)[0], whole[r]), r


# --------------------------------------------------------------------------- recurrence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("hk,hv,dk,dv", HEADS)
def test_recurrence_matches_ref(t, hk, hv, dk, dv, dtype, device):
    qkv, g, beta, state = _inputs(t, hk, hv, dk, dv, dtype, device)
    idx = torch.arange(t, device=device).flip(0) + 2  # stash rows written out of order, not from 0
    outs, finals, stashes = [], [], []
    for fn in (gated_delta_rule, gated_delta_rule_ref):
        final = torch.empty_like(state)
        stash = torch.full((t + 2, hv, dk, dv), float("nan"), device=device)
        outs.append(fn(qkv, g, beta, state, hk, final=final, stash=stash, stash_idx=idx))
        finals.append(final)
        stashes.append(stash)
    for got, want in zip((outs[0], finals[0], stashes[0][2:]), (outs[1], finals[1], stashes[1][2:])):
        torch.testing.assert_close(got, want, rtol=REC_RTOL, atol=REC_ATOL)
    assert torch.isnan(stashes[0][:2]).all()  # rows outside stash_idx untouched
    assert torch.equal(stashes[0][2], finals[0])  # the last row (idx 2) is the final state


@pytest.mark.parametrize("fn", [gated_delta_rule, gated_delta_rule_ref], ids=["kernel", "twin"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.exhaustive), torch.bfloat16],
                         ids=str)  # quick: bf16, whose rounding would show a changed order first
def test_recurrence_does_not_depend_on_the_grouping(fn, dtype, device):
    """16 rows in one call == one row at a time (each from the previous call's final state) ==
    groups 5 + 7 + 1 + 3: outputs, final states and stash rows, bit for bit."""
    hk, hv, dk, dv = 2, 4, 64, 64
    qkv, g, beta, state = _inputs(16, hk, hv, dk, dv, dtype, device, seed=7)
    idx = torch.arange(16, device=device)
    stash = torch.empty(16, hv, dk, dv, device=device)
    final = torch.empty_like(state)
    whole = fn(qkv, g, beta, state, hk, final=final, stash=stash, stash_idx=idx)
    for groups in ([1] * 16, [5, 7, 1, 3]):
        s, lo = state.clone(), 0
        for n in groups:
            nxt = torch.empty_like(s)
            out = fn(qkv[lo:lo + n], g[lo:lo + n], beta[lo:lo + n], s, hk, final=nxt)
            assert torch.equal(out, whole[lo:lo + n]), (groups, lo)
            s, lo = nxt, lo + n
            assert torch.equal(s, stash[lo - 1]), (groups, lo)
        assert torch.equal(s, final)


@pytest.mark.parametrize("fn", [gated_delta_rule, gated_delta_rule_ref, "engine"], ids=["kernel", "twin", "engine"])
@pytest.mark.parametrize("live", [1, 4, 6, 40])
def test_padding_rows_after_the_live_ones_do_not_run(fn, live, device):
    """A fixed step's padding: with `live`, a 6-row call gives its first min(6, live) rows'
    outputs and stash rows, and the state after the last of them as `final`, bit for bit those
    of a call on the live rows alone; the padding rows' outputs are zeros and their stash rows
    untouched. `engine` is the torch step ops' form (layers/deltanet.py): it reads `live` on the
    device only (graph-capturable), so it runs every row and its padding rows stash the last
    live row's state (never a padding row's)."""
    engine = fn == "engine"
    if engine:
        from memra_cli.engine.layers.deltanet import gated_delta_step as fn
    t, hk, hv, dk, dv = 6, 1, 2, 32, 32  # small: two kernel calls under the interpreter
    qkv, g, beta, state = _inputs(t, hk, hv, dk, dv, torch.bfloat16, device, seed=11)
    n, idx = min(t, live), torch.arange(t, device=device)
    want_final, want_stash = torch.empty_like(state), torch.zeros(t, hv, dk, dv, device=device)
    want = fn(qkv[:n], g[:n], beta[:n], state, hk, final=want_final, stash=want_stash, stash_idx=idx[:n])
    final, stash = torch.empty_like(state), torch.zeros(t, hv, dk, dv, device=device)
    out = fn(qkv, g, beta, state, hk, final=final, stash=stash, stash_idx=idx,
             live=torch.tensor([live], dtype=torch.int32, device=device))
    assert torch.equal(out[:n], want) and torch.equal(final, want_final) and torch.equal(stash[:n], want_stash[:n])
    assert not out[n:].any()
    assert all(torch.equal(row, want_final if engine else want_stash[n + i]) for i, row in enumerate(stash[n:]))


# quick: 17 rows take every chunk edge 16 does, and one more
@pytest.mark.parametrize("t", [1, 2, 3, pytest.param(16, marks=pytest.mark.exhaustive), 17])
def test_loading_two_rows_ahead_changes_no_bit(t, device, monkeypatch):
    """PREFETCH 2 (row r+2's inputs loaded while row r updates) against 1: the same per-row ops
    on the same values, so the outputs, final state, stash and the batched replay are the same
    bits; only when the loads are issued moves."""
    import memra_kernels.deltanet as dn

    qkv, g, beta, state = _inputs(t, 2, 4, 64, 64, torch.bfloat16, device, seed=t)
    idx = torch.arange(t, device=device)
    ring_args = _ring(2, 8, 2, 4, 64, 64, torch.bfloat16, device, seed=t + 50)
    got = []
    for ahead in (1, 2):
        monkeypatch.setattr(dn, "PREFETCH", ahead)
        final, stash = torch.empty_like(state), torch.empty(t, *state.shape, device=device)
        out = gated_delta_rule(qkv, g, beta, state, 2, final=final, stash=stash, stash_idx=idx)
        replayed = torch.empty_like(ring_args[3])
        gated_delta_rule_layers(*ring_args, 2, 6, min(t, 8), replayed)
        got.append((out, final, stash, replayed))
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_final_may_be_the_state_itself(device):
    qkv, g, beta, state = _inputs(3, 2, 4, 64, 64, torch.float32, device, seed=9)
    want = torch.empty_like(state)
    out = gated_delta_rule(qkv, g, beta, state, 2, final=want)
    inplace = state.clone()
    assert torch.equal(gated_delta_rule(qkv, g, beta, inplace, 2, final=inplace), out)
    assert torch.equal(inplace, want)


def test_bad_shapes_are_refused(device):
    qkv, g, beta, state = _inputs(3, 2, 4, 64, 64, torch.float32, device)
    with pytest.raises(ValueError, match="does not fit 3 key heads"):
        gated_delta_rule(qkv, g, beta, state, 3)
    with pytest.raises(ValueError, match="g must be float32"):
        gated_delta_rule(qkv, g.double(), beta, state, 2)
    with pytest.raises(ValueError, match="stash and stash_idx"):
        gated_delta_rule(qkv, g, beta, state, 2, stash=torch.empty(3, 4, 64, 64, device=device))


# --------------------------------------------------------------------------- batched replay


def _ring(layers, ring, hk, hv, dk, dv, dtype, device, seed):
    """Per-layer rings of recorded rows and per-layer start states, stacked `[L, ...]`."""
    parts = [_inputs(ring, hk, hv, dk, dv, dtype, device, seed=seed + 10 * i) for i in range(layers)]
    return [torch.stack([p[j] for p in parts]) for j in range(4)]


@pytest.mark.parametrize("fn", [gated_delta_rule_layers, gated_delta_rule_layers_ref], ids=["kernel", "twin"])
@pytest.mark.parametrize("row0,rows", [(0, 1), (5, 7), (6, 4), (3, 0)])  # (6, 4) wraps the ring of 8
def test_batched_replay_is_the_per_layer_recurrence(fn, row0, rows, device):
    """Every layer replayed in one call over ring rows row0.. (wrapping) == each layer's own
    `gated_delta_rule` (kernel, resp. twin) over the same rows in order, bit for bit: the replay a
    rollback runs gives the states the step computed."""
    single = gated_delta_rule if fn is gated_delta_rule_layers else gated_delta_rule_ref
    qkv, g, beta, state = _ring(3, 8, 2, 4, 64, 64, torch.bfloat16, device, seed=3)
    final = torch.full_like(state, float("nan"))
    fn(qkv, g, beta, state, 2, row0, rows, final)
    idx = torch.tensor([(row0 + r) % 8 for r in range(rows)], dtype=torch.long, device=device)
    for i in range(3):
        want = torch.empty_like(state[i])
        single(qkv[i][idx], g[i][idx], beta[i][idx], state[i], 2, final=want)
        assert torch.equal(final[i], want), i


def test_batched_replay_matches_its_twin_and_may_run_in_place(device):
    qkv, g, beta, state = _ring(2, 8, 1, 2, 128, 128, torch.float32, device, seed=5)
    got, want = torch.empty_like(state), torch.empty_like(state)
    gated_delta_rule_layers(qkv, g, beta, state, 1, 6, 5, got)
    gated_delta_rule_layers_ref(qkv, g, beta, state, 1, 6, 5, want)
    torch.testing.assert_close(got, want, rtol=REC_RTOL, atol=REC_ATOL)
    inplace = state.clone()
    gated_delta_rule_layers(qkv, g, beta, inplace, 1, 6, 5, inplace)
    assert torch.equal(inplace, got)


# quick: (6, 4) reads a multi-row window off the device as (2, 8) does (exhaustive)
@pytest.mark.parametrize("row0,rows", [(0, 1), (6, 4), (3, 0), pytest.param(2, 8, marks=pytest.mark.exhaustive)])
def test_device_rows_replay_is_the_host_rows_replay(row0, rows, device):
    """The graphed rollback's replay reads (row0, rows) on the device: the same compiled per-row
    code as the host-argument launch, so the same bits; its twin reads them on the host."""
    qkv, g, beta, state = _ring(3, 8, 2, 4, 64, 64, torch.bfloat16, device, seed=7)
    params = torch.tensor([row0, rows], dtype=torch.int32, device=device)
    want, got, twin = (torch.full_like(state, float("nan")) for _ in range(3))
    gated_delta_rule_layers(qkv, g, beta, state, 2, row0, rows, want)
    gated_delta_replay_dev(qkv, g, beta, state, 2, params, got)
    assert torch.equal(got, want)
    gated_delta_replay_dev_ref(qkv, g, beta, state, 2, params, twin)
    torch.testing.assert_close(twin, want, rtol=REC_RTOL, atol=REC_ATOL)
    with pytest.raises(ValueError, match="params must be int32"):
        gated_delta_replay_dev(qkv, g, beta, state, 2, params.long(), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k1,row0,rows", [(3, 0, 1), (3, 6, 4), (3, 5, 0), (3, 2, 2), (1, 7, 3), (3, 1, 8)])
def test_ring_window_is_the_last_rows_of_base_then_ring(k1, row0, rows, dtype, device):
    """The conv windows after `rows` ring rows from `row0` (wrapping a ring of 8; fewer rows than
    the window takes the rest from the base), every layer at once, C off the column block."""
    g = torch.Generator().manual_seed(k1 * 100 + row0 * 10 + rows)
    layers, ring, c = 3, 8, 300
    base = torch.randn(layers, k1, c, generator=g).to(dtype).to(device)
    xs = torch.randn(layers, ring, c, generator=g).to(dtype).to(device)
    params = torch.tensor([row0, rows], dtype=torch.int32, device=device)
    got, twin = torch.full_like(base, float("nan")), torch.full_like(base, float("nan"))
    ring_window(base, xs, params, got)
    ring_window_ref(base, xs, params, twin)
    seq = torch.cat([base, xs[:, [(row0 + r) % ring for r in range(rows)]]], dim=1)
    assert torch.equal(got, seq[:, -k1:]) and torch.equal(twin, got)


def test_rows_minus_one_leaves_the_destination_alone(device):
    """A round that kept every row passes rows -1 (settle's restore): the step already wrote that
    state and window, so the replay and the window restore write nothing (kernels and twins)."""
    qkv, g, beta, state = _ring(2, 8, 2, 4, 64, 64, torch.float32, device, seed=9)
    params = torch.tensor([3, -1], dtype=torch.int32, device=device)
    for replay in (gated_delta_replay_dev, gated_delta_replay_dev_ref):
        final = torch.full_like(state, 7.0)
        replay(qkv, g, beta, state, 2, params, final)
        assert bool((final == 7.0).all()), replay.__name__
    base = torch.randn(2, 3, 40).to(device)
    xs = torch.randn(2, 8, 40).to(device)
    for window in (ring_window, ring_window_ref):
        out = torch.full_like(base, 7.0)
        window(base, xs, params, out)
        assert bool((out == 7.0).all()), window.__name__


def _restore_inputs(device, seed=11):
    """A 2-layer record (ring of 8; 2 value heads repeating 1 key head, 32 x 32: small for the
    interpreter; conv width C off the window's column blocks) and its base."""
    qkv, g, beta, state = _ring(2, 8, 1, 2, 32, 32, torch.bfloat16, device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    window = torch.randn(2, 3, qkv.shape[2], generator=gen).to(torch.bfloat16).to(device)
    xs = torch.randn(2, 8, qkv.shape[2], generator=gen).to(torch.bfloat16).to(device)
    return qkv, g, beta, state, window, xs


def _restore(fn, inputs, row0, rows, live=None, layers=2):
    """(states, windows) a restore `fn` writes over destinations filled with 7 (its first `layers`
    layers given to it: fewer plants a skipped layer)."""
    qkv, g, beta, state, window, xs = inputs
    params = torch.tensor([row0, rows], dtype=torch.int32, device=state.device)
    live = None if live is None else torch.tensor([live], dtype=torch.int32, device=state.device)
    final, out = torch.full_like(state, 7.0), torch.full_like(window, 7.0)
    fn(qkv[:layers], g[:layers], beta[:layers], state[:layers], 1, params, final[:layers], window[:layers],
       xs[:layers], out[:layers], live)
    return final, out


def _two_launches(inputs, row0, rows):
    """What the one-launch restore replaces: the replay and the window restore."""
    qkv, g, beta, state, window, xs = inputs
    params = torch.tensor([row0, rows], dtype=torch.int32, device=state.device)
    final, out = torch.full_like(state, 7.0), torch.full_like(window, 7.0)
    gated_delta_replay_dev(qkv, g, beta, state, 1, params, final)
    ring_window(window, xs, params, out)
    return final, out


@pytest.mark.parametrize("row0,rows,live", [
    (6, 4, 5),  # wraps the ring; live rows more than the kept ones: the replay runs
    pytest.param(6, 4, 4, marks=pytest.mark.exhaustive),  # the whole window of live rows kept: nothing written
    pytest.param(2, -1, None, marks=pytest.mark.exhaustive),  # every row kept
    pytest.param(3, 0, None, marks=pytest.mark.exhaustive),  # the base itself
    pytest.param(1, 8, None, marks=pytest.mark.exhaustive),  # the whole ring, past the window
])
def test_one_launch_restore_is_the_window_and_the_replay(row0, rows, live, device):
    """`gated_delta_restore` (a round's restore in one launch) writes the states and conv windows
    of `gated_delta_replay_dev` + `ring_window` bit for bit, a kept count equal to the live rows
    read as -1 (nothing written); the twin the same windows and states within the recurrence's
    tolerance. Planted: a restore one row too far (the state of a rejected draft kept) and one
    that skips a layer both fail the same comparison."""
    inputs = _restore_inputs(device)
    want = _two_launches(inputs, row0, -1 if rows == live else rows)
    got = _restore(gated_delta_restore, inputs, row0, rows, live)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    twin = _restore(gated_delta_restore_ref, inputs, row0, rows, live)
    assert torch.equal(twin[1], want[1])
    torch.testing.assert_close(twin[0], want[0], rtol=REC_RTOL, atol=REC_ATOL)
    if rows == live or rows < 0:
        assert bool((got[0] == 7.0).all()) and bool((got[1] == 7.0).all())
        return
    for planted in (_restore(gated_delta_restore, inputs, row0, rows + 1),  # one row too many
                    _restore(gated_delta_restore, inputs, row0, rows, live, layers=1)):  # the last layer skipped
        assert not (torch.equal(planted[0], want[0]) and torch.equal(planted[1], want[1]))


@pytest.mark.parametrize("row0,rows", [(6, 4), (2, -1), (0, 1)])
def test_stash_restore_is_the_window_and_the_last_kept_rows_state(row0, rows, device):
    """Stash mode's restore in one launch: every layer's stashed state of the last kept row (rows
    -1: the step's last, `width`) and the conv windows after the kept rows (none written for -1:
    the step wrote them), bit for bit a copy, as its twin. Planted: a restore one row too far (the
    state of a rejected draft) and one that skips a layer fail the same comparison."""
    layers, ring, width, c = 3, 8, 5, 300
    gen = torch.Generator().manual_seed(13)
    stash = torch.randn(layers, ring, 4, 8, 16, generator=gen).to(device)
    window = torch.randn(layers, 3, c, generator=gen).to(torch.bfloat16).to(device)
    xs = torch.randn(layers, ring, c, generator=gen).to(torch.bfloat16).to(device)

    def run(fn, rows, n=layers):
        params = torch.tensor([row0, rows], dtype=torch.int32, device=device)
        final, out = torch.full_like(stash[:, 0], 7.0), torch.full_like(window, 7.0)
        fn(stash[:n], params, width, final[:n], window[:n], xs[:n], out[:n])
        return final, out

    got, twin = run(stash_restore, rows), run(stash_restore_ref, rows)
    kept = width if rows < 0 else rows
    want_state = stash[:, (row0 + kept - 1) % ring]
    if rows < 0:
        want_window = torch.full_like(window, 7.0)
    else:
        want_window = torch.cat([window, xs[:, [(row0 + r) % ring for r in range(rows)]]], dim=1)[:, -3:]
    for final, out in (got, twin):
        assert torch.equal(final, want_state) and torch.equal(out, want_window)
    for planted in (run(stash_restore, kept + 1), run(stash_restore, rows, n=layers - 1)):
        assert not (torch.equal(planted[0], want_state) and torch.equal(planted[1], want_window))


def test_batched_replay_refuses_bad_shapes(device):
    qkv, g, beta, state = _ring(2, 8, 2, 4, 64, 64, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="do not fit a ring of 8"):
        gated_delta_rule_layers(qkv, g, beta, state, 2, 0, 9, state)
    with pytest.raises(ValueError, match="ring fitting state"):
        gated_delta_rule_layers(qkv[:1], g, beta, state, 2, 0, 1, state)
