"""Few-row dense linear (memra_kernels.dense_linear): the kernel against its reference on awkward
shapes and every tile path, row-count invariance bit for bit, and the step ops' routing.

Under the interpreter (no GPU) the kernel runs small shapes in float32 and bfloat16 (operands
widened, see the kernel's WIDEN); on CUDA the real bf16 path runs too.
"""

from __future__ import annotations

import pytest
import torch

from memra_kernels import dense_linear as dl
from memra_kernels.dense_linear import KernelConfig

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# float32: kernel and reference sum the same products in different orders; each output is within
# K * 2^-24 of the exact sum relative to sum_k |x_k w_k| (K <= 320 here).
F32_TOL = 2 * 320 * 2.0**-24
# bf16: both accumulate in float32 and round the output once (2^-9 relative); a wrong tile, split
# or row gives O(1) errors.
BF16_REL_TOL = 1e-2

SHAPES = [(33, 96), (64, 256), (80, 320)]  # odd out (masked tiles), in not a multiple of block_k
MS = (1, 3, 16, 17, 32)
CONFIGS = {
    "heuristic": None,
    "split3": KernelConfig(block_n=32, block_k=64, split_k=3),  # uneven splits, one may be empty
    "n16_k32": KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2),
    "one_split": KernelConfig(block_n=64, block_k=128, split_k=1),
}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(DEVICE, dtype)
    w = (torch.randn((n, k), generator=gen) * 0.05).to(DEVICE, dtype)
    return x, w


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=str)
def test_f32_matches_reference(shape, cfg):
    n, k = shape
    x, w = _inputs(max(MS), n, k, torch.float32)
    bound = (x.abs() @ w.abs().T) * F32_TOL
    for m in MS:
        out = torch.full((m, n), float("nan"), device=DEVICE)
        y = dl.dense_linear(x[:m], w, config=CONFIGS[cfg], out=out)
        ref = dl.dense_linear_ref(x[:m], w)
        assert not torch.isnan(y).any(), f"unwritten outputs at M={m}"
        assert ((y - ref).abs() <= bound[:m]).all(), f"M={m}: max err {(y - ref).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", ["heuristic", "split3"], ids=str)
def test_half_matches_reference(dtype, cfg):
    n, k = 80, 320
    x, w = _inputs(17, n, k, dtype, seed=1)
    y = dl.dense_linear(x, w, config=CONFIGS[cfg])
    assert y.dtype == dtype
    assert _rel(y, dl.dense_linear_ref(x, w)) < BF16_REL_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", ["heuristic", "split3", "n16_k32"], ids=str)
def test_row_invariant(dtype, cfg):
    """A row's output is the same bits alone, in a 16-row call, in a 17- or 32-row call, and
    whatever the other rows hold: what the fixed-width exactness rule needs."""
    n, k = 64, 256
    x, w = _inputs(32, n, k, dtype, seed=2)
    full = dl.dense_linear(x, w, config=CONFIGS[cfg])
    for m in (1, 3, 16, 17):
        part = dl.dense_linear(x[:m], w, config=CONFIGS[cfg])
        assert torch.equal(part, full[:m]), f"rows of an M={m} call differ from the M=32 call"
    other = x.clone()
    other[1:] = torch.randn_like(other[1:].float()).to(dtype) * 100
    assert torch.equal(dl.dense_linear(other, w, config=CONFIGS[cfg])[0], full[0])


def test_leading_dims_and_repeat_calls():
    """[..., in] inputs keep their leading shape; calls repeat bit for bit (the split-K counters
    are back at zero after every call)."""
    x, w = _inputs(12, 33, 96, torch.float32, seed=3)
    x3 = x.view(3, 4, 96)
    y1 = dl.dense_linear(x3, w, config=CONFIGS["split3"])
    assert y1.shape == (3, 4, 33)
    for _ in range(3):
        assert torch.equal(dl.dense_linear(x3, w, config=CONFIGS["split3"]), y1)
    assert torch.equal(y1.view(12, 33), dl.dense_linear(x, w, config=CONFIGS["split3"]))


def test_refusals():
    x, w = _inputs(2, 33, 96, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        dl.dense_linear(x[:, :64], w)
    with pytest.raises(ValueError, match="weight is"):
        dl.dense_linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        dl.dense_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="power of two"):
        dl.dense_linear(x, w, config=KernelConfig(block_n=48))


def test_config_is_a_function_of_shape_only():
    """Tiles never depend on M: the same object for any row count, TUNED before the heuristic;
    float32 takes fewer stages (or shorter k tiles) so its tiles fit the bf16 shared memory."""
    for (n, k), cfg in dl.TUNED.items():
        wide = dl.config_for(n, k, 4)
        assert 4 * wide.num_stages * (wide.block_n + dl.BLOCK_M) * wide.block_k \
            <= 2 * cfg.num_stages * (cfg.block_n + dl.BLOCK_M) * cfg.block_k
        assert (wide.block_n, wide.split_k) == (cfg.block_n, cfg.split_k)
    assert dl.config_for(4096, 4096) == dl.config_for(4096, 4096)
    key = (96, 64)
    dl.TUNED[key] = KernelConfig(block_n=16, block_k=32, split_k=2)
    try:
        assert dl.config_for(*key) == dl.TUNED[key]
    finally:
        del dl.TUNED[key]
    assert dl.config_for(*key) == dl._heuristic(*key)


def test_step_ops_route_tuned_shapes_only(monkeypatch):
    """TritonStepOps.linear takes the kernel for a TUNED shape at <= MAX_ROWS rows without a bias,
    and F.linear for everything else; TorchStepOps.linear is F.linear (or the module's call)."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    ops = TritonStepOps()
    calls = []
    real = dl.dense_linear
    monkeypatch.setattr(dl, "dense_linear", lambda x, w, **kw: calls.append(tuple(x.shape)) or real(x, w, **kw))
    x, w = _inputs(40, 33, 96, torch.bfloat16, seed=4)
    bias = torch.randn(33, device=DEVICE).to(torch.bfloat16)
    ref = torch.nn.functional.linear(x, w)
    assert torch.equal(ops.linear(x[:16], w), ref[:16]) and not calls  # shape not tuned: F.linear
    monkeypatch.setitem(dl.TUNED, (33, 96), KernelConfig(block_n=32, block_k=64, split_k=2))
    y = ops.linear(x[:16], w)
    assert calls == [(16, 96)]
    assert _rel(y, ref[:16]) < BF16_REL_TOL
    ops.linear(x, w)  # 40 rows > MAX_ROWS: cuBLAS
    ops.linear(x[:4], w, bias)  # a bias: F.linear
    ops.linear(x[:4].float(), w.float())  # float32 weights: cuBLAS (TUNED is measured in bf16)
    assert calls == [(16, 96)]
    assert torch.equal(TorchStepOps.linear(x, w, bias), torch.nn.functional.linear(x, w, bias))


def test_load_tuned_replaces_the_table(tmp_path):
    """A sweep's --tuned file becomes TUNED (benchmarks time a candidate table with it); a bad
    tile in it is refused before anything changes."""
    saved = dict(dl.TUNED)
    path = tmp_path / "tuned.json"
    try:
        path.write_text('{"96x64": {"block_n": 16, "block_k": 32, "split_k": 2, "num_warps": 4, "num_stages": 2}}')
        table = dl.load_tuned(path)
        assert dl.TUNED == table == {(96, 64): KernelConfig(block_n=16, block_k=32, split_k=2, num_stages=2)}
        path.write_text('{"96x64": {"block_n": 48, "block_k": 32, "split_k": 2, "num_warps": 4, "num_stages": 2}}')
        with pytest.raises(ValueError, match="power of two"):
            dl.load_tuned(path)
        assert dl.TUNED == table
    finally:
        dl.TUNED.clear()
        dl.TUNED.update(saved)


# --------------------------------------------------------------------------------------------
# GLU: the SwiGLU middle in the matmul's launch
# --------------------------------------------------------------------------------------------

GLU_SHAPES = [(66, 96), (128, 256), (160, 320)]  # 2 I rows: I = 33 (a partial tile), 64, 80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GLU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=str)
def test_glu_equals_the_two_launches(dtype, shape, cfg):
    """glu=True gives exactly silu_mul(dense_linear(x, w)) (the same tiles, products rounded to
    the dtype before the activation), and the reference within tolerance, for every tile path:
    plain, uneven split-K, 16-wide tiles (8 gate + 8 up rows a program), a partial last tile."""
    from memra_kernels import activation

    n, k = shape
    x, w = _inputs(17, n, k, dtype, seed=5)
    w = w * 10  # gate values of a few units: silu far from linear
    for m in (1, 3, 17):
        out = torch.full((m, n // 2), float("nan"), device=DEVICE, dtype=dtype)
        y = dl.dense_linear(x[:m], w, config=CONFIGS[cfg], glu=True, out=out)
        two = activation.silu_mul(dl.dense_linear(x[:m], w, config=CONFIGS[cfg]))
        assert y.shape == (m, n // 2) and not torch.isnan(y.float()).any(), f"unwritten outputs at M={m}"
        assert torch.equal(y, two), f"M={m}: glu differs from the two launches by {(y.float() - two.float()).abs().max()}"
        assert _rel(y, dl.dense_linear_ref(x[:m], w, glu=True)) < (1e-5 if dtype == torch.float32 else BF16_REL_TOL)


def test_glu_rows_invariant_and_pairs_gate_with_up():
    """A row's GLU output is the same bits alone and among 17; swapping the gate and up halves of
    the weight changes the result (each output pairs its own gate row with its own up row)."""
    x, w = _inputs(17, 128, 256, torch.float32, seed=6)
    full = dl.dense_linear(x, w, config=CONFIGS["split3"], glu=True)
    for m in (1, 3, 16):
        assert torch.equal(dl.dense_linear(x[:m], w, config=CONFIGS["split3"], glu=True), full[:m])
    swapped = torch.cat([w[64:], w[:64]])
    ref = dl.dense_linear_ref(x, swapped, glu=True)
    assert _rel(dl.dense_linear(x, swapped, config=CONFIGS["split3"], glu=True), ref) < 1e-5
    assert _rel(full, ref) > 0.1


def test_glu_refuses_an_odd_weight():
    x, w = _inputs(2, 33, 96, torch.float32)
    with pytest.raises(ValueError, match="even row count"):
        dl.dense_linear(x, w, glu=True)
    with pytest.raises(ValueError, match="out must be"):
        dl.dense_linear(x, w[:32], glu=True, out=torch.empty(2, 32, device=DEVICE))


def test_step_ops_swiglu_fuses_where_linear_takes_the_kernel(monkeypatch):
    """TritonStepOps.swiglu is one glu launch exactly where `linear` would take the kernel, and
    silu_mul(linear(...)) elsewhere; both give the torch path's SwiGLU within bf16 tolerance and
    the fused launch the unfused launches' bits."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    ops = TritonStepOps()
    calls = []
    real = dl.dense_linear
    monkeypatch.setattr(dl, "dense_linear", lambda x, w, **kw: calls.append(kw.get("glu", False)) or real(x, w, **kw))
    x, w = _inputs(40, 66, 96, torch.bfloat16, seed=7)
    w = w * 10
    ref = TorchStepOps.swiglu(x, w)
    assert torch.equal(ops.swiglu(x[:16], w), ops.silu_mul(torch.nn.functional.linear(x[:16], w))) and not calls
    monkeypatch.setitem(dl.TUNED, (66, 96), KernelConfig(block_n=32, block_k=64, split_k=2))
    y = ops.swiglu(x[:16], w)
    assert calls == [True]
    assert torch.equal(y, ops.silu_mul(ops.linear(x[:16], w)))  # the unfused kernel path's bits
    assert _rel(y, ref[:16]) < BF16_REL_TOL
    calls.clear()
    ops.swiglu(x, w)  # 40 rows > MAX_ROWS: cuBLAS, then silu_mul
    assert calls == []


# --------------------------------------------------------------------------- argmax epilogue


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_argmax_epilogue_is_the_argmax_of_the_output(dtype):
    """The picks are `row_argmax` of the launch's own output (the same rounded values, an exact
    integer maximum), the output is unchanged, and a tie across two tiles gives the first column
    (a planted tie: a 'last wins' or per-tile fold would pick the later one)."""
    from memra_kernels.argmax import row_argmax_ref

    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 64, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(200, 64, generator=g).to(dtype).to(DEVICE)
    w[150] = w[37]  # rows 37 and 150 (different 32-wide tiles) give equal outputs
    x[2] = w[37].float().sign().to(dtype)  # ... which row 2 makes its largest
    cfg = KernelConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2)
    picks = torch.full((5,), -7, dtype=torch.long, device=DEVICE)
    y = dl.dense_linear(x, w, config=cfg, argmax_out=picks)
    assert torch.equal(y, dl.dense_linear(x, w, config=cfg))
    assert torch.equal(picks, row_argmax_ref(y))
    assert picks[2].item() == 37
    again = torch.empty_like(picks)  # the key slots and counters were reset by the last program
    dl.dense_linear(x.flip(0), w, config=cfg, argmax_out=again)
    assert torch.equal(again, picks.flip(0))
    one = torch.empty(1, dtype=torch.long, device=DEVICE)  # a row's pick alone == among five
    dl.dense_linear(x[3:4], w, config=cfg, argmax_out=one)
    assert one.item() == picks[3].item()


def test_argmax_epilogue_refusals():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(64, 64, device=DEVICE)
    split = KernelConfig(block_n=32, block_k=16, split_k=2, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="split"):
        dl.dense_linear(x, w, config=split, argmax_out=torch.empty(4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="int64"):
        dl.dense_linear(x, w, argmax_out=torch.empty(3, dtype=torch.long, device=DEVICE))


@pytest.mark.exhaustive  # the embedded models' full shapes in the interpreter (quick-tier time)
@pytest.mark.parametrize("shape", [(512, 256), (256, 256), (1536, 256), (256, 768), (4096, 256)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_embedded_models_tiles_are_right_and_row_invariant(shape):
    """TUNED's tiles for the embedded models' shapes (benchmarks/gpu/embedded_dense.py's
    `EMBEDDED_SHAPES`, which its `--table cublas` run takes out): bf16 within rounding of the
    reference, a row's bits the same in a 1-row and a 16-row call, and each shape's own epilogue
    allowed (the q/k/v tiles inside a 64-wide head, the lm_head unsplit for its argmax, gate/up
    split into its halves)."""
    from benchmarks.gpu.embedded_dense import EMBEDDED_SHAPES, without_embedded

    table = dict(dl.TUNED)
    assert without_embedded(table) == list(EMBEDDED_SHAPES) and not set(EMBEDDED_SHAPES) & set(table)
    cfg = dl.TUNED[shape]
    n, k = shape
    x, w = _inputs(16, n, k, torch.bfloat16, seed=5)
    y = dl.dense_linear(x, w, config=cfg)
    assert _rel(y, dl.dense_linear_ref(x, w)) < BF16_REL_TOL
    assert torch.equal(dl.dense_linear(x[:1], w, config=cfg), y[:1])
    if n == 512:  # q/k/v: the rope epilogue's tiles lie inside heads
        assert 64 % cfg.block_n == 0
    if n == 4096:  # lm_head: the argmax epilogue needs an unsplit K
        assert cfg.split_k == 1
    if n == 1536:  # gate/up: SwiGLU in the epilogue pairs gate with up
        g = dl.dense_linear(x, w, config=cfg, glu=True)
        assert _rel(g, dl.dense_linear_ref(x, w, glu=True)) < BF16_REL_TOL
