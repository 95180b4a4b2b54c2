"""The residual add + RMSNorm folded into the dense kernel (memra_kernels.dense_linear): the
producer's epilogue (`dense_linear_add_norm`: the new residual stream and its per-tile sums of
squares), the consumer's norm on load (`dense_linear` of a `PendingNorm`), the fixed-order
statistic shared with `norm.rms_norm_partials` and the torch twin, row invariance, planted breaks,
and the step ops' routing.

Every comparison here is bit for bit except against the ordinary (HF-order) norm: the statistic is
summed in one order by every piece (kernels/_sumsq.py), and each element is rounded where the
norm kernel rounds it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from memra_kernels import dense_linear as dl  # noqa: E402
from memra_kernels import norm  # noqa: E402
from memra_kernels.dense_linear import KernelConfig, PendingNorm  # noqa: E402
from memra_kernels.norm_ref import add_rms_norm_ref, add_rms_norm_tree_ref, rms_norm_tree_ref, tree_sumsq_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# producers: one split with 16-wide tiles (a partial last tile of 80 columns), uneven split-K with 32
PRODUCERS = {"n16": KernelConfig(block_n=16, block_k=32, split_k=1, num_stages=2),
             "n32_split3": KernelConfig(block_n=32, block_k=32, split_k=3, num_stages=2)}
# consumers: split-K with k tiles that do not divide 80 (a masked last k tile), one split
CONSUMERS = {"k32_split2": KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2),
             "k64": KernelConfig(block_n=32, block_k=64, split_k=1, num_stages=2)}
T, A_IN, D, N2 = 16, 64, 80, 32


def _inputs(dtype: torch.dtype, seed: int = 0):
    """a [T, A_IN] (the attention's rows), wo [D, A_IN], residual [T, D], norm weight [D], w2 [N2, D]."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(T, A_IN, generator=g)
    wo = torch.randn(D, A_IN, generator=g) * 0.2
    res = torch.randn(T, D, generator=g) * 2
    nw = 1 + 0.3 * torch.randn(D, generator=g)
    w2 = torch.randn(N2, D, generator=g) * 0.2
    return [v.to(DEVICE, dtype) for v in (a, wo, res, nw, w2)]


def _on_gpu_tol(dtype):
    """On the GPU the twin's `1 / sqrt` may round otherwise (the kernels' division is the
    compiler's, the same in every kernel): compare with the twin within a bf16 / f32 ulp there."""
    return dict(rtol=2**-7 if dtype == torch.bfloat16 else 2**-22, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_norm_from_partials_is_the_twin_bit_for_bit(dtype):
    """`rms_norm_partials` of the producer's rows and partials against the twin of the whole
    fold (equal under the interpreter), and within the ordinary norm's tolerance of the HF-order
    twin (only the sum of squares' order differs: tests/kernels/test_norm.py's RTOL)."""
    a, wo, res, nw, _ = _inputs(dtype, seed=1)
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=PRODUCERS["n16"])
    got = norm.rms_norm_partials(p.rows, p.sumsq, nw, EPS)
    want, want_res = add_rms_norm_tree_ref(dl.dense_linear(a, wo, config=PRODUCERS["n16"]), res, nw, EPS)
    assert torch.equal(p.rows, want_res)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **_on_gpu_tol(dtype))
    torch.testing.assert_close(got, norm.rms_norm(p.rows, nw, EPS), rtol=1e-5 if dtype == torch.float32 else 2**-6,
                               atol=0)


@pytest.mark.parametrize("cfg", list(PRODUCERS), ids=str)
def test_the_residual_epilogue_writes_the_sum_and_each_tiles_squares(cfg):
    """The rows are `residual + dense_linear(a, wo)` rounded as the two launches round; column j
    of sumsq is the tree sum of tile j's squares; the tree over the columns is the row's."""
    a, wo, res, nw, _ = _inputs(torch.bfloat16)
    config = PRODUCERS[cfg]
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=config)
    assert torch.equal(p.rows, dl.dense_linear(a, wo, config=config) + res)
    bn = config.block_n
    assert p.sumsq.shape == (T, -(-D // bn))
    for j in range(p.sumsq.shape[1]):
        assert torch.equal(p.sumsq[:, j], tree_sumsq_ref(p.rows[:, j * bn:(j + 1) * bn]))
    assert torch.equal(_tree(p.sumsq), tree_sumsq_ref(p.rows))


def _tree(parts: torch.Tensor) -> torch.Tensor:
    """The consumer's sum of the partials: the same adjacent-pair tree over the padded columns."""
    v = torch.nn.functional.pad(parts, (0, (1 << max(parts.shape[1] - 1, 0).bit_length()) - parts.shape[1]))
    while v.shape[1] > 1:
        v = v[:, 0::2] + v[:, 1::2]
    return v[:, 0]


@pytest.mark.parametrize("cfg", list(PRODUCERS), ids=str)
def test_the_norm_only_epilogue_writes_the_product_and_each_tiles_squares(cfg):
    """`dense_linear_norm` (no residual): the rows are `dense_linear(a, wo)` bit for bit, column j
    of sumsq the tree sum of tile j's squares, and a consumer folding it computes
    `dense_linear(rms_norm_tree_ref(rows))` bit for bit (CPU). Planted: the squares of another
    tile's columns are seen."""
    a, wo, _, nw, w2 = _inputs(torch.bfloat16, seed=5)
    config = PRODUCERS[cfg]
    p = dl.dense_linear_norm(a, wo, nw, EPS, config=config)
    assert torch.equal(p.rows, dl.dense_linear(a, wo, config=config))
    bn = config.block_n
    assert p.sumsq.shape == (T, -(-D // bn))
    for j in range(p.sumsq.shape[1]):
        assert torch.equal(p.sumsq[:, j], tree_sumsq_ref(p.rows[:, j * bn:(j + 1) * bn]))
    assert not torch.equal(p.sumsq[:, 0], tree_sumsq_ref(p.rows[:, bn:2 * bn]))
    got = dl.dense_linear(p, w2, config=CONSUMERS["k64"])
    assert torch.equal(got, dl.dense_linear(norm.rms_norm_partials(p.rows, p.sumsq, nw, EPS), w2,
                                            config=CONSUMERS["k64"]))
    if DEVICE == "cpu":
        assert torch.equal(got, dl.dense_linear(rms_norm_tree_ref(p.rows, nw, EPS), w2, config=CONSUMERS["k64"]))
    with pytest.raises(ValueError, match="norm_w"):
        dl.dense_linear_norm(a, wo, nw[:-1], EPS)


@pytest.mark.parametrize("cfg", list(PRODUCERS), ids=str)
def test_the_new_residual_may_land_in_a_column_slice(cfg):
    """`out=` a column slice of a wider buffer (a step's taps): the rows and sums of squares of the
    contiguous call, bit for bit, split-K's last program included; the other columns untouched."""
    a, wo, res, nw, _ = _inputs(torch.bfloat16, seed=6)
    config = PRODUCERS[cfg]
    buf = torch.full((T, 2 * D + 16), 3.0, dtype=torch.bfloat16, device=DEVICE)
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=config, out=buf[:, 16:16 + D])
    want = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=config)
    assert p.rows.data_ptr() == buf[:, 16:].data_ptr()
    assert torch.equal(p.rows, want.rows) and torch.equal(p.sumsq, want.sumsq)
    assert (buf[:, :16] == 3.0).all() and (buf[:, 16 + D:] == 3.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("consumer", list(CONSUMERS), ids=str)
def test_the_folded_norm_is_the_norm_then_the_matmul(dtype, consumer):
    """`dense_linear` of a PendingNorm == `dense_linear(rms_norm_partials(...))`, bit for bit, for
    every producer tile width (the statistic does not depend on it); and close to the torch ops."""
    a, wo, res, nw, w2 = _inputs(dtype, seed=2)
    config = CONSUMERS[consumer]
    want = None
    for producer in PRODUCERS.values():
        p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=producer)
        got = dl.dense_linear(p, w2, config=config)
        assert torch.equal(got, dl.dense_linear(norm.rms_norm_partials(p.rows, p.sumsq, nw, EPS), w2, config=config))
        if DEVICE == "cpu":
            assert torch.equal(got, dl.dense_linear(rms_norm_tree_ref(p.rows, nw, EPS), w2, config=config))
        assert want is None or torch.equal(got, want)
        want = got
    ref = dl.dense_linear_ref(add_rms_norm_ref(dl.dense_linear_ref(a, wo), res, nw, EPS)[0], w2)
    rel = ((want.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.exhaustive  # three more epilogues through the interpreter (~5 s); the plain consumer's test is quick
def test_glu_argmax_and_qkv_rope_consumers_fold_it_too(monkeypatch):
    """The SwiGLU epilogue, the argmax epilogue and the q/k/v projection's rope epilogue take a
    PendingNorm with the bits of their unfolded inputs."""
    from memra_kernels import rope

    a, wo, res, nw, _ = _inputs(torch.bfloat16, seed=3)
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=PRODUCERS["n16"])
    h = norm.rms_norm_partials(p.rows, p.sumsq, nw, EPS)
    g = torch.Generator().manual_seed(4)
    cfg = CONSUMERS["k32_split2"]
    w_gu = (torch.randn(64, D, generator=g) * 2).to(DEVICE, torch.bfloat16)
    assert torch.equal(dl.dense_linear(p, w_gu, config=cfg, glu=True), dl.dense_linear(h, w_gu, config=cfg, glu=True))
    head = KernelConfig(block_n=32, block_k=32, split_k=1, num_stages=2)
    picks, picks_h = (torch.empty(T, dtype=torch.long, device=DEVICE) for _ in range(2))
    assert torch.equal(dl.dense_linear(p, w_gu, config=head, argmax_out=picks),
                       dl.dense_linear(h, w_gu, config=head, argmax_out=picks_h))
    assert torch.equal(picks, picks_h)
    nh, nkv, hd, s = 2, 1, 16, 40
    w_qkv = (torch.randn((nh + 2 * nkv) * hd, D, generator=g) * 0.2).to(DEVICE, torch.bfloat16)
    cos, sin = (torch.randn(s, hd, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    qn, kn = (1 + 0.1 * torch.randn(hd, generator=g)).to(DEVICE, torch.bfloat16), torch.ones(hd, dtype=torch.bfloat16,
                                                                                               device=DEVICE)
    pos = torch.arange(3, 3 + T, device=DEVICE)
    monkeypatch.setitem(dl.TUNED, tuple(w_qkv.shape), KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2))
    outs = []
    for x in (p, h):
        kc, vc = (torch.zeros(nkv, s, hd, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        outs.append((dl.dense_qkv_rope_kv_write(x, w_qkv, qn, kn, cos, sin, pos, kc, vc, nh, nkv, EPS), kc, vc))
    assert all(torch.equal(u, v) for u, v in zip(*outs))
    want_q = rope.qk_norm_rope_kv_write(dl.dense_linear(h, w_qkv), qn, kn, cos, sin, pos,
                                        torch.zeros(nkv, s, hd, dtype=torch.bfloat16, device=DEVICE),
                                        torch.zeros(nkv, s, hd, dtype=torch.bfloat16, device=DEVICE), nh, nkv, EPS)
    torch.testing.assert_close(outs[0][0], want_q, rtol=2**-6, atol=0)  # the epilogue's q/k norm order (rope.py)


@pytest.mark.parametrize("rows", [16, pytest.param(33, marks=pytest.mark.exhaustive)])
def test_rows_are_invariant(rows):
    """A row's folded result is the same bits alone, among 3 and among 16 (or 33: three m tiles) rows."""
    a, wo, res, nw, w2 = _inputs(torch.bfloat16, seed=5)
    a, res = a.repeat(3, 1)[:rows] * 1.5, res.repeat(3, 1)[:rows].flip(0)
    full = dl.dense_linear(dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=PRODUCERS["n32_split3"]), w2,
                           config=CONSUMERS["k32_split2"])
    for lo, hi in ((4, 5), (0, 3), (rows - 2, rows)):
        p = dl.dense_linear_add_norm(a[lo:hi], wo, res[lo:hi], nw, EPS, config=PRODUCERS["n32_split3"])
        assert torch.equal(dl.dense_linear(p, w2, config=CONSUMERS["k32_split2"]), full[lo:hi])


def test_planted_breaks_are_seen():
    """The bit-for-bit checks above can fail: a norm weight off by one element, the residual added
    twice, a sum of squares over the wrong tiles (one tile left out, one counted twice) each give
    another result than the folded launch's."""
    a, wo, res, nw, w2 = _inputs(torch.bfloat16, seed=6)
    cfg = CONSUMERS["k64"]
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=PRODUCERS["n16"])
    good = dl.dense_linear(p, w2, config=cfg)
    off_by_one = torch.cat([nw[1:], nw[:1]])
    doubled = p.rows + res
    dropped, twice = p.sumsq.clone(), p.sumsq.clone()
    dropped[:, 2] = 0
    twice[:, 1] = twice[:, 0]
    for broken in (PendingNorm(p.rows, p.sumsq, off_by_one, EPS), PendingNorm(doubled, p.sumsq, nw, EPS),
                   PendingNorm(p.rows, dropped, nw, EPS), PendingNorm(p.rows, twice, nw, EPS)):
        assert not torch.equal(dl.dense_linear(broken, w2, config=cfg), good)
    assert not torch.equal(dl.dense_linear(rms_norm_tree_ref(doubled, nw, EPS), w2, config=cfg), good)


def test_refusals():
    a, wo, res, nw, w2 = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="norm_w"):
        dl.dense_linear_add_norm(a, wo, res, nw.float(), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        dl.dense_linear_add_norm(a, wo, res[:, :40], nw, EPS)
    with pytest.raises(ValueError, match="sumsq_out"):
        dl.dense_linear(a, wo, residual=res)
    with pytest.raises(ValueError, match="plain weight"):
        dl.dense_linear(a, torch.cat([wo, wo]), residual=res, glu=True)
    p = dl.dense_linear_add_norm(a, wo, res, nw, EPS, config=PRODUCERS["n16"])
    with pytest.raises(ValueError, match="pending norm"):
        dl.dense_linear(PendingNorm(p.rows, p.sumsq[:3], nw, EPS), w2)


def test_step_ops_fold_the_norm_exactly_where_both_matmuls_take_the_kernel(monkeypatch):
    """`linear_add_rms_norm` leaves its norm pending only where the projection and the consumer
    are both the dense kernel's; a consumer that cannot fold it norms it first (`normed`) with the
    folded bits; `unfused()` runs the two launches (the same residual; the norm kernel's own sum
    order, so the normed rows within its tolerance)."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    a, wo, res, nw, w2 = _inputs(torch.bfloat16, seed=7)
    ops = TritonStepOps()
    h, x = ops.linear_add_rms_norm(a[:16], wo, None, res[:16], nw, EPS, w2)
    assert not isinstance(h, PendingNorm)  # neither shape is in TUNED
    assert torch.equal(h, ops.add_rms_norm(ops.linear(a[:16], wo), res[:16], nw, EPS)[0])
    monkeypatch.setitem(dl.TUNED, tuple(wo.shape), PRODUCERS["n32_split3"])
    h, x = ops.linear_add_rms_norm(a[:16], wo, None, res[:16], nw, EPS, w2)
    assert not isinstance(h, PendingNorm)  # the consumer's shape is not
    monkeypatch.setitem(dl.TUNED, tuple(w2.shape), CONSUMERS["k32_split2"])
    h, x = ops.linear_add_rms_norm(a[:16], wo, None, res[:16], nw, EPS, w2)
    assert isinstance(h, PendingNorm) and x is h.rows
    h2, x2 = ops.unfused().linear_add_rms_norm(a[:16], wo, None, res[:16], nw, EPS, w2)
    assert torch.equal(x, x2) and not isinstance(h2, PendingNorm)
    torch.testing.assert_close(ops.normed(h), h2, rtol=2**-6, atol=0)
    assert torch.equal(ops.linear(h, w2), ops.linear(ops.normed(h), w2))
    assert torch.equal(ops.linear(h, w2[:40]), TorchStepOps.linear(ops.normed(h), w2[:40]))  # not TUNED: F.linear
    torch.testing.assert_close(x, TorchStepOps.linear_add_rms_norm(a[:16], wo, None, res[:16], nw, EPS, w2)[1],
                               rtol=2**-7, atol=0)
