"""Quantized linear (memra_kernels.quant_linear): packing vs ggml's decoder, the Triton kernel vs
the torch reference, row invariance, and the QuantLinearRef drop-in.

Under the interpreter (no GPU) the kernel runs in float32 on small shapes; bfloat16 runs there
too (operands widened, see the kernel's WIDEN) and on CUDA through the real bf16 path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from memra_cli.engine.quant.blocks import QuantLinearRef, quantize
from memra_kernels import quant_linear as ql
from memra_kernels import quant_pack as qp
from memra_kernels import quant_tuning as qt
from memra_kernels.ggml_blocks_ref import QuantError  # the kernels' own (the engine's subclasses it)
from memra_kernels.quant_tuning import KernelConfig

try:
    import gguf
    from gguf import quants as gguf_quants
except ImportError:  # pragma: no cover - gguf is a runtime dependency; the GPU image may lack it
    gguf = gguf_quants = None

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
QTYPES = ("q8_0", "q4_0")

# float32 x: kernel and reference round the same exact products (dequantized weights are exact
# in f32) and differ only in summation order; each sum of K terms is within K * 2^-24 of the
# exact one relative to sum_k |x_k w_k|, so the two are within 2 * K * 2^-24 (K <= 256 here).
F32_TOL = 2 * 256 * 2.0**-24
# bf16 x: the reference rounds each weight to bf16 once (scale_after_dot keeps it exact) and the
# output is rounded to bf16 (2^-9); relative L2 error of a correct kernel sits near 2^-9, while a
# wrong block, nibble or scale gives O(1).
BF16_REL_TOL = 1e-2

if CUDA:
    SHAPES = [(33, 96), (64, 256), (1024, 4096)]
else:
    SHAPES = [(33, 96), (64, 256)]
MS = (1, 3, 16, 17, 32)

# Configs worth covering on small shapes: the default, split-K (even and uneven tile counts),
# a 16-row tile (M = 17 and 32 take two row tiles), and the scale-after-dot variant.
CONFIGS = {
    "default": None,
    "split3": KernelConfig(block_n=32, block_k=64, split_k=3),  # one split empty on both shapes
    "m16_split2_sa": KernelConfig(block_m=16, block_n=32, block_k=64, split_k=2,
                                  scale_after_dot=True),
    "swap_split2": KernelConfig(block_n=32, block_k=64, split_k=2, swap_ab=True),
    "swap_sa": KernelConfig(block_m=16, block_n=32, block_k=64, scale_after_dot=True,
                            swap_ab=True),
    # dequantize-first through byte permutes (one split empty on 33x96; the other operand order:
    # test_mantissa_path_reads_the_dequantized_weights)
    "swap_mantissa": KernelConfig(block_m=16, block_n=32, block_k=64, split_k=3, swap_ab=True,
                                  mantissa=True),
}


def weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight with per-block magnitudes that vary (so a wrong block's scale shows)."""
    w = torch.randn((n, k), generator=gen)
    return w * torch.rand((n, k // 32, 1), generator=gen).repeat_interleave(32, -1).reshape(n, k)


def packed_weight(qtype: str, n: int, k: int, seed: int = 0) -> qp.Packed:
    gen = torch.Generator().manual_seed(seed)
    return qp.pack(quantize(weight(n, k, gen), qtype), qtype, (n, k)).to(DEVICE)


def check_close(y: torch.Tensor, x: torch.Tensor, packed: qp.Packed) -> None:
    """y against the reference: the f32 bound, or bf16's relative L2 error."""
    assert not torch.isnan(y).any(), "output has NaN (an element never written?)"
    ref = ql.quant_linear_ref(x, packed)
    if x.dtype == torch.float32:
        w = packed.dequantize(torch.float32).to(x.device)
        bound = F32_TOL * (x.abs() @ w.abs().T) + 1e-30
        excess = ((y - ref).abs() / bound).max().item()
        assert excess <= 1.0, f"error {excess:.2f}x the f32 bound"
    else:
        rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel <= BF16_REL_TOL, f"relative error {rel:.2e}"


def gguf_type(qtype: str):
    return {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(gguf is None, reason="gguf not installed")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [1, 3, 33, 64])
@pytest.mark.parametrize("k", [32, 96, 256])
def test_pack_dequantize_equals_ggml(qtype, n, k):
    """Blocks from gguf's encoder: dequantize is gguf's decode bit for bit; to_ggml is the bytes."""
    w = weight(n, k, torch.Generator().manual_seed(n * 1000 + k)).numpy()
    raw = gguf_quants.quantize(w, gguf_type(qtype))
    packed = qp.pack(raw, qtype, (n, k))
    want = gguf_quants.dequantize(raw, gguf_type(qtype)).reshape(n, k)
    got = packed.dequantize(torch.float32).numpy()
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert torch.equal(packed.to_ggml(), torch.from_numpy(np.asarray(raw)).reshape(n, -1))
    assert packed.qweight.is_contiguous() and packed.scales.dtype == torch.float16
    assert packed.scales.shape == (n, k // 32)


@pytest.mark.skipif(gguf is None, reason="gguf not installed")
@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_arbitrary_blocks(qtype):
    """Random bytes (every int8 incl. -128, every nibble, scales of all signs and sizes), given as
    a torch tensor: still gguf's decode exactly."""
    gen = np.random.default_rng(1)
    n, k = 5, 128
    nbytes = {"q8_0": 34, "q4_0": 18}[qtype]
    raw = gen.integers(0, 256, size=(n * k // 32, nbytes), dtype=np.uint8)
    raw[:, :2] = (gen.standard_normal(len(raw)) * 10.0 ** gen.integers(-6, 3, len(raw))).astype(
        np.float16).view(np.uint8).reshape(-1, 2)  # finite f16 scales
    packed = qp.pack(torch.from_numpy(raw), qtype, (n, k))
    want = gguf_quants.dequantize(raw.reshape(n, -1), gguf_type(qtype)).reshape(n, k)
    assert np.array_equal(packed.dequantize().numpy(), want)
    assert torch.equal(packed.to_ggml(), torch.from_numpy(raw).reshape(n, -1))


def test_pack_refuses_bad_input():
    raw = quantize(np.ones((4, 64), np.float32), "q8_0")
    with pytest.raises(QuantError):
        qp.pack_q8_0(raw, (4, 96))  # byte count does not match
    with pytest.raises(QuantError):
        qp.pack_q8_0(raw[:, :-1], (4, 64))
    with pytest.raises(QuantError):
        qp.pack_q8_0(raw, (256,))  # not 2-D
    with pytest.raises(QuantError):
        qp.pack(raw, "q5_0", (4, 64))
    with pytest.raises(QuantError):
        qp.pack_q4_0(np.zeros(18 * 3, np.uint8), (1, 48))  # rows not whole blocks


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_reference_f32(shape, qtype, config):
    n, k = shape
    packed = packed_weight(qtype, n, k)
    gen = torch.Generator().manual_seed(7)
    for m in MS:
        x = torch.randn((m, k), generator=gen).to(DEVICE)
        out = torch.full((m, n), float("nan"), device=DEVICE)  # every element must be written
        y = ql.quant_linear(x, packed, config=CONFIGS[config], out=out)
        assert y is out and y.dtype == torch.float32 and y.shape == (m, n)
        check_close(y, x, packed)


@pytest.mark.parametrize("config", ["default", "m16_split2_sa"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_matches_reference_bf16(qtype, config):
    """bf16 x, out in bf16 (on CUDA: the kernel's real bf16 path; on CPU: widened operands)."""
    n, k = SHAPES[-1]
    packed = packed_weight(qtype, n, k, seed=3)
    gen = torch.Generator().manual_seed(11)
    for m in (1, 16, 17) if not CUDA else MS:
        x = torch.randn((m, k), generator=gen).to(DEVICE, torch.bfloat16)
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        y = ql.quant_linear(x, packed, config=CONFIGS[config], out=out)
        assert y.dtype == torch.bfloat16
        check_close(y, x, packed)


@pytest.mark.parametrize("config", ["default", "split3", "m16_split2_sa", "swap_mantissa"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_invariance(qtype, config):
    """Row i of quant_linear(x[:M]) is bit-identical to quant_linear(x[i:i+1]) for every M."""
    n, k = SHAPES[0] if not CUDA else SHAPES[-1]
    packed = packed_weight(qtype, n, k, seed=5)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn((32, k), generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    cfg = CONFIGS[config]
    alone = {i: ql.quant_linear(x[i:i + 1], packed, config=cfg) for i in (0, 2, 16, 31)}
    for m in (3, 17, 32):
        y = ql.quant_linear(x[:m], packed, config=cfg)
        for i, yi in alone.items():
            if i < m:
                assert torch.equal(y[i:i + 1], yi), f"row {i} differs at M={m}"


def every_byte_weight(qtype: str, n: int = 32, k: int = 128, seed: int = 4) -> qp.Packed:
    """Random ggml blocks holding every byte value (so every int8 and every nibble pair) at
    least once, under finite scales of mixed sign and size."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = {"q8_0": 34, "q4_0": 18}[qtype]
    raw = torch.randint(0, 256, (n * k // 32, nbytes), generator=gen, dtype=torch.uint8)
    payload = raw[:, 2:].reshape(-1)
    payload[:256] = torch.arange(256, dtype=torch.uint8)
    raw[:, 2:] = payload.reshape(raw.shape[0], -1)
    d = torch.randn(raw.shape[0], generator=gen) * 10.0 ** torch.randint(-4, 1, (raw.shape[0],), generator=gen)
    raw[:, :2] = d.to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return qp.pack(raw, qtype, (n, k)).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_mantissa_path_reads_the_dequantized_weights(qtype, dtype):
    """The byte-permute dequantization (`mantissa`) on a weight of every byte value: one-hot rows
    of x read each weight back, equal bit for bit to `Packed.dequantize(x.dtype)` (a product with
    one nonzero term is exact in float32, then rounded to x's dtype like the reference); and on
    random x it gives the default path's bits for the same tiles (the same weights, the same
    dots)."""
    packed = every_byte_weight(qtype)
    n, k = packed.shape
    want = packed.dequantize(dtype).to(DEVICE)
    cfg = KernelConfig(block_n=32, block_k=64, split_k=2, mantissa=True)
    for r in range(0, k, 32):  # one-hot rows for columns r..r+31, 32 rows a call
        eye = torch.eye(k, device=DEVICE, dtype=dtype)[r:r + 32]
        got = ql.quant_linear(eye, packed, config=cfg)
        assert torch.equal(got, want[:, r:r + 32].T), f"weights of columns {r}..{r + 31} differ"
    x = torch.randn((17, k), generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    for swap in (False, True):
        base = KernelConfig(block_n=32, block_k=64, split_k=2, swap_ab=swap)
        mant = KernelConfig(block_n=32, block_k=64, split_k=2, swap_ab=swap, mantissa=True)
        assert torch.equal(ql.quant_linear(x, packed, config=mant), ql.quant_linear(x, packed, config=base))


@triton.jit
def _int8_mantissa_no_flip(q):
    """`_quant_dequant.int8_mantissa` planted wrong: the byte as stored, without the sign flip."""
    u = q.to(tl.uint8, bitcast=True).to(tl.int32)
    return ((u << 8) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_mantissa_plus_one(nib):
    """`_quant_dequant.nibble_mantissa` planted wrong: every nibble read one too high."""
    return (((nib.to(tl.int32) + 1) << 16) | 0x3F800000).to(tl.float32, bitcast=True)


@pytest.mark.skipif(CUDA, reason="plants a broken helper in the interpreted kernel (the GPU runs the PTX)")
@pytest.mark.parametrize("qtype", QTYPES)
def test_mantissa_check_catches_a_planted_offset_error(qtype, monkeypatch):
    """The comparison above is able to fail: with the byte-permute helper planted wrong (q8_0: the
    sign flip left out, so negative weights read 256 too high; q4_0: the nibble off by one), the
    kernel's weights no longer equal the dequantized ones."""
    packed = every_byte_weight(qtype, n=16, k=64)
    eye = torch.eye(64, device=DEVICE)[:32]
    cfg = KernelConfig(block_n=16, block_k=64, mantissa=True)
    assert torch.equal(ql.quant_linear(eye, packed, config=cfg), packed.dequantize()[:, :32].T)
    # planted where the kernel looks them up: the names quant_linear imports
    monkeypatch.setattr(ql, "int8_mantissa", _int8_mantissa_no_flip)
    monkeypatch.setattr(ql, "nibble_mantissa", _nibble_mantissa_plus_one)
    assert not torch.equal(ql.quant_linear(eye, packed, config=cfg), packed.dequantize()[:, :32].T)


def test_kernel_refuses_bad_input():
    packed = packed_weight("q8_0", 16, 64)
    with pytest.raises(ValueError):
        ql.quant_linear(torch.randn(2, 32, device=DEVICE), packed)  # wrong in_features
    with pytest.raises(ValueError):
        ql.quant_linear(torch.randn(2, 64, device=DEVICE).double(), packed)
    with pytest.raises(ValueError):
        ql.quant_linear(torch.randn(2, 64, device=DEVICE), packed,
                        out=torch.empty(2, 8, device=DEVICE))


def test_config_is_per_shape():
    """The tiles come from (qtype, out, in) alone: every M of a shape runs the same launch."""
    for qtype in QTYPES:
        for n, k in [(4096, 4096), (1024, 4096), (33, 96)]:
            cfg = qt.config_for(qtype, n, k)
            assert cfg is qt.config_for(qtype, n, k) and cfg.split_k >= 1
            assert cfg.split_k <= max(1, -(-k // cfg.block_k))


# ---------------------------------------------------------------------------------------------
# Drop-in for QuantLinearRef
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_linear_drop_in(qtype):
    n, k = 24, 96
    w = weight(n, k, torch.Generator().manual_seed(9))
    ref = QuantLinearRef.from_float(w, qtype)
    lin = ql.QuantLinear(ref.raw.numpy(), qtype, (n, k))
    assert (lin.qtype, lin.shape) == (ref.qtype, ref.shape)
    assert torch.equal(lin.raw, ref.raw)
    assert lin.to("cpu") is lin and lin.to(torch.bfloat16) is lin  # dtype moves are ignored
    x = torch.randn((2, 3, k), generator=torch.Generator().manual_seed(4))
    y = lin(x)  # CPU: the reference path
    assert y.shape == (2, 3, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
    # the kernel path through the same call (forced on CPU, or on CUDA by device)
    kern = ql.QuantLinear.from_ref(ref, force_triton=True).to(DEVICE)
    yk = kern(x.to(DEVICE))
    assert yk.shape == (2, 3, n)
    check_close(yk.reshape(6, n), x.reshape(6, k).to(DEVICE), kern.packed)
    prev = ql.set_force_triton(True)
    try:
        assert ql.QuantLinear.from_float(w, qtype)._use_kernel(x) == ql.triton_available()
    finally:
        ql.set_force_triton(prev)
    assert ql.QuantLinear.from_float(w, qtype).shape == (n, k)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quant_linear_cuda_uses_kernel():
    lin = ql.QuantLinear.from_float(weight(64, 128, torch.Generator().manual_seed(1)), "q4_0")
    lin.to("cuda")
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    assert lin._use_kernel(x)
    assert torch.equal(lin(x), ql.quant_linear(x, lin.packed))


# ---------------------------------------------------------------------------------------------
# Fused projections: stacking weights along out, and views of their rows
# ---------------------------------------------------------------------------------------------

# a q/k/v-like stack: parts of unequal out (so the fused shape gets other tiles than each part)
FUSE_K = 96
FUSE_OUTS = (40, 24, 24)


def fuse_parts(qtype: str, seed: int = 0) -> list[ql.QuantLinear]:
    gen = torch.Generator().manual_seed(seed)
    return [ql.QuantLinear.from_float(weight(n, FUSE_K, gen), qtype, force_triton=True).to(DEVICE)
            for n in FUSE_OUTS]


@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_concat_is_the_parts_rows_and_rows_are_views(qtype):
    parts = fuse_parts(qtype)
    fused = ql.QuantLinear.concat(parts)
    p = fused.packed
    assert fused.shape == (sum(FUSE_OUTS), FUSE_K) and fused.qtype == qtype and fused.force_triton
    assert torch.equal(p.qweight, torch.cat([q.packed.qweight for q in parts]))
    assert torch.equal(p.scales, torch.cat([q.packed.scales for q in parts]))
    # the ggml bytes of the stack are the parts' block rows, in order
    assert torch.equal(fused.raw, torch.cat([q.raw for q in parts]))
    lo = 0
    for part in parts:
        hi = lo + part.shape[0]
        view = fused.rows(lo, hi)
        assert view.shape == part.shape and view.force_triton
        # views of the fused rows: nothing copied, and still what the kernel asks of a weight
        assert view.packed.qweight.data_ptr() == p.qweight[lo].data_ptr()
        assert view.packed.scales.data_ptr() == p.scales[lo].data_ptr()
        assert view.packed.qweight.is_contiguous() and view.packed.scales.is_contiguous()
        assert torch.equal(view.packed.dequantize(), part.packed.dequantize())
        lo = hi
    # a view of a view is a view of the first
    inner = fused.rows(8, 64).rows(32, 56)
    assert inner.packed.qweight.data_ptr() == p.qweight[40].data_ptr()
    assert torch.equal(inner.raw, parts[1].raw)


def test_packed_concat_and_rows_refuse_what_does_not_stack():
    a = ql.QuantLinear.from_float(torch.randn(16, 64), "q8_0")
    with pytest.raises(QuantError, match="share qtype"):
        ql.QuantLinear.concat([a, ql.QuantLinear.from_float(torch.randn(16, 64), "q4_0")])
    with pytest.raises(QuantError, match="in-features"):
        ql.QuantLinear.concat([a, ql.QuantLinear.from_float(torch.randn(16, 96), "q8_0")])
    with pytest.raises(QuantError):
        qp.Packed.concat([])
    for lo, hi in ((0, 0), (4, 2), (-1, 3), (0, 17)):
        with pytest.raises(QuantError, match="rows"):
            a.rows(lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_kernel_computes_the_parts_side_by_side(qtype, dtype):
    """One launch on the stack vs one per part, concatenated: both within the kernel's stated
    tolerance of the stack's reference (f32: the summation-order bound F32_TOL; bf16: relative
    L2 BF16_REL_TOL), so in f32 within twice the bound of each other. Not asserted equal: the
    tiles (block_n, split-K) are `config_for(qtype, out, in)`, and `out` differs between the
    stack and its parts, so a K sum may be split and added in another order."""
    parts = fuse_parts(qtype, seed=1)
    fused = ql.QuantLinear.concat(parts)
    assert qt.config_for(qtype, *fused.shape) != qt.config_for(qtype, *parts[1].shape)
    gen = torch.Generator().manual_seed(6)
    for m in (1, 5, 17):
        x = torch.randn((m, FUSE_K), generator=gen).to(DEVICE, dtype)
        y = fused(x)
        y_parts = torch.cat([part(x) for part in parts], dim=-1)
        check_close(y, x, fused.packed)
        check_close(y_parts, x, fused.packed)
        if dtype == torch.float32:
            w = fused.packed.dequantize().to(DEVICE)
            bound = F32_TOL * (x.abs() @ w.abs().T) + 1e-30
            assert ((y - y_parts).abs() <= 2 * bound).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_view_runs_exactly_as_its_own_weight(qtype):
    """A view of rows [lo, hi) and the same rows packed on their own have one shape, hence one
    tile config and one launch: bit-identical outputs (only the weight pointers differ)."""
    parts = fuse_parts(qtype, seed=2)
    fused = ql.QuantLinear.concat(parts)
    x = torch.randn((5, FUSE_K), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    kv = fused.rows(FUSE_OUTS[0], sum(FUSE_OUTS))  # the k/v rows, as a drafter's ingest uses them
    own = ql.QuantLinear.concat(parts[1:])
    assert torch.equal(kv(x), own(x))
    assert torch.equal(fused.rows(0, FUSE_OUTS[0])(x), parts[0](x))


# --------------------------------------------------------------------------------------------
# GLU: a quantized drafter's SwiGLU in the gate/up matmul's launch
# --------------------------------------------------------------------------------------------


# The epilogue does not see how the weights were dequantized, and the mantissa path gives the
# default path's bits (test_mantissa_path_reads_the_dequantized_weights): its GLU is not rerun here.
GLU_CONFIGS = [name for name, c in CONFIGS.items() if c is None or not c.mantissa]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", GLU_CONFIGS, ids=GLU_CONFIGS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_glu_equals_the_two_launches(qtype, config, dtype):
    """glu=True gives silu_mul(quant_linear(x, w)) bit for bit on every tile path (dequantize
    first or scale after the dot, swapped operands, split-K), with a partial last tile (I = 33)."""
    from memra_kernels import activation

    for n in (66, 128):
        packed = packed_weight(qtype, n, 96, seed=n)
        x = torch.randn((17, 96), generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
        for m in (1, 3, 17):
            out = torch.full((m, n // 2), float("nan"), device=DEVICE, dtype=dtype)
            y = ql.quant_linear(x[:m], packed, config=CONFIGS[config], glu=True, out=out)
            two = activation.silu_mul(ql.quant_linear(x[:m], packed, config=CONFIGS[config]))
            assert not torch.isnan(y.float()).any(), f"unwritten outputs at M={m}"
            assert torch.equal(y, two), f"n={n} M={m}: glu differs from the two launches"


@pytest.mark.parametrize("qtype", QTYPES)
def test_glu_drop_in_and_refusals(qtype):
    """QuantLinear.swiglu is the kernel's glu when forced (and on CUDA), torch's SiLU·mul of the
    reference otherwise: the two agree within the kernel's tolerance. An odd weight is refused."""
    gen = torch.Generator().manual_seed(9)
    w = weight(128, 96, gen)
    lin = ql.QuantLinear.from_float(w, qtype, force_triton=True).to(DEVICE)
    ref = ql.QuantLinear.from_float(w, qtype, force_triton=False).to(DEVICE)
    x = torch.randn((2, 5, 96), generator=gen).to(DEVICE)
    y, y_ref = lin.swiglu(x), ref.swiglu(x)
    assert y.shape == (2, 5, 64)
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 1e-5
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    assert torch.equal(TritonStepOps().swiglu(x, lin), y)  # the step op takes the same launch
    with pytest.raises(ValueError, match="even row count"):
        ql.quant_linear(x[0], packed_weight(qtype, 33, 96), glu=True)
