"""q8_0 / q4_0 bytes against the `gguf` package (a bit-exact numpy port of llama.cpp's reference)."""

from __future__ import annotations

import struct
import warnings

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from memra_cli.engine.errors import MemraError
from memra_cli.engine.quant.blocks import (
    BLOCK_BYTES,
    QK,
    QuantError,
    QuantLinearRef,
    decode_q4_0,
    decode_q8_0,
    dequantize,
    dequantize_torch,
    encode_q4_0,
    encode_q8_0,
    f32_to_f16_bits,
    quantizable,
    quantize,
)

from fp32_bounds import reorder_bound

GG = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
QTYPES = sorted(GG)
F16_MAX = 65504.0


def oracle(x: np.ndarray, qtype: str) -> np.ndarray:
    # gguf warns (divide/overflow/cast) on the degenerate blocks we test on purpose
    with np.errstate(all="ignore"):
        return gguf.quants.quantize(np.asarray(x, np.float32), GG[qtype])


def ours(x: np.ndarray, qtype: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our encoder must be silent on every finite input
        return quantize(x, qtype, "t")


def assert_same_bytes(x: np.ndarray, qtype: str) -> np.ndarray:
    got, want = ours(x, qtype), oracle(x, qtype)
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    assert got.shape == (rows, x.shape[-1] // QK * BLOCK_BYTES[qtype])
    np.testing.assert_array_equal(got.reshape(-1), want.reshape(-1))
    return got


def f16_scales(raw: np.ndarray, qtype: str) -> np.ndarray:
    """The stored f16 d of every block, as uint16 bits."""
    b = raw.reshape(-1, BLOCK_BYTES[qtype])
    return b[:, :2].copy().view(np.uint16)[:, 0]


# ---- byte identity on random data --------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (1, 32), (3, 4096), (32,), (2, 3, 64), (0, 32)])
def test_random_normal_matches_gguf(shape, qtype):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    assert_same_bytes(x, qtype)


@st.composite
def scaled_blocks(draw):
    """[rows, n_blocks * 32] f32 whose per-block scales span 1e-30 .. 1e30."""
    rows, nb = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lo = draw(st.floats(-30, 30))
    hi = draw(st.floats(lo, min(30.0, lo + draw(st.sampled_from([0.0, 1.0, 10.0, 60.0])))))
    scale = 10.0 ** rng.uniform(lo, hi, size=(rows, nb, 1))
    kind = draw(st.sampled_from(["normal", "uniform", "sparse", "neg", "q8ties", "q4edges"]))
    shape = (rows, nb, QK)
    v = {"normal": lambda: rng.standard_normal(shape),
         "uniform": lambda: rng.uniform(-1, 1, shape),
         "sparse": lambda: rng.standard_normal(shape) * (rng.random(shape) < 0.1),  # zero blocks
         "neg": lambda: -np.abs(rng.standard_normal(shape)),
         "q8ties": lambda: rng.integers(-254, 255, shape) / 2.0,
         "q4edges": lambda: rng.integers(-16, 17, shape) / 2.0}[kind]()
    if kind in ("q8ties", "q4edges"):
        # a +-127 (+-8) extreme and a power-of-two scale make d, id and v*id exact: q8_0 sees
        # exact .5 ties, q4_0 sees v*id + 8.5 land exactly on integers
        ext = np.where(rng.random((rows, nb, 1)) < 0.5, -1, 1) * (127 if kind == "q8ties" else 8)
        np.put_along_axis(v, rng.integers(0, QK, (rows, nb, 1)), ext, axis=-1)
        scale = 2.0 ** np.round(np.log2(scale))
    x = (v * scale).astype(np.float32).reshape(rows, nb * QK)
    rounding = draw(st.sampled_from(["f32", "bf16", "f16"]))
    if rounding == "bf16":  # weights shipped as bf16
        x = torch.from_numpy(x).bfloat16().float().numpy()
    elif rounding == "f16":
        with np.errstate(over="ignore"):
            x = x.astype(np.float16).astype(np.float32)
        x[~np.isfinite(x)] = F16_MAX
    return x


@settings(max_examples=300, deadline=None)
@given(x=scaled_blocks(), qtype=st.sampled_from(QTYPES))
def test_scaled_blocks_match_gguf(x, qtype):
    assert_same_bytes(x, qtype)


@settings(max_examples=300, deadline=None)
@given(x=arrays(np.float32, st.tuples(st.integers(1, 2), st.sampled_from([32, 64])),
                elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       qtype=st.sampled_from(QTYPES))
def test_any_finite_f32_matches_gguf(x, qtype):
    """Every finite f32, subnormals and huge values mixed in one block, matches byte for byte."""
    assert_same_bytes(x, qtype)


# ---- hand-built corner cases -------------------------------------------------------------------


def block(*head: float, fill: float = 0.0) -> np.ndarray:
    return np.array(list(head) + [fill] * (QK - len(head)), np.float32)


def test_pinned_vectors():
    assert encode_q8_0(block(127, 0.5, -1.5, 2.5))[0, :6].tobytes() == bytes.fromhex("003c7f01fe03")
    assert encode_q4_0(block(3.0, 1.6875))[0, :4].tobytes() == bytes.fromhex("00b68084")


@pytest.mark.parametrize("s", [2.0**-20, 2.0**-3, 1.0, 2.0**10])
def test_q8_exact_ties_round_away_from_zero(s):
    # amax = 127 s with s a power of two: d = s and id = 1/s exactly, so v * id = k + 0.5 exactly
    # just below a tie: the largest f32 under 0.5 must give 0 (p + 0.5 would round up to 1.0)
    below = [float(np.nextafter(np.float32(v), np.float32(0))) for v in (0.5, -0.5, 1.5, -2.5)]
    x = block(127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, *below) * np.float32(s)
    raw = assert_same_bytes(x, "q8_0")
    want = [127, 1, -1, 2, -2, 3, -3, 127, -127, 0, 0, 1, -2]
    assert list(raw[0, 2:2 + len(want)].view(np.int8)) == want


def test_q4_exact_edges_and_negative_dominant():
    # max = -8 (negative dominant): d = +1, id = 1, nibble = trunc(v + 8.5) clipped to 15
    x = block(-8, -0.5, 0.5, -7.5, 6.5, 7.5, 7.9, -3.25)
    raw = assert_same_bytes(x, "q4_0")
    assert f16_scales(raw, "q4_0")[0] == 0x3C00  # +1.0
    assert list(raw[0, 2:10] & 15) == [0, 8, 9, 1, 15, 15, 15, 5]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("head", [(-3.0, 3.0), (3.0, -3.0), (0.0, -3.0, 3.0), (-0.0, 3.0, -3.0)])
def test_first_of_equal_magnitude_wins(head, qtype):
    raw = assert_same_bytes(block(*head, 1.0), qtype)
    if qtype == "q4_0":  # d = first(+-3) / -8: the sign follows the first extreme
        first = next(v for v in head if v != 0)
        assert f16_scales(raw, qtype)[0] == (0xB600 if first > 0 else 0x3600)  # -+0.375


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_and_negative_zero_blocks(qtype):
    x = np.stack([block(), block(fill=-0.0), block(-0.0), block(0.0, fill=-0.0)])
    raw = assert_same_bytes(x, qtype)
    if qtype == "q4_0":
        # d = (first element) / -8: +0 -> -0.0 (0x8000); gguf takes x[0] for a -0 first element
        # (-> +0.0), where llama.cpp's C starts from max = +0 and writes 0x8000 for every zero block
        assert list(f16_scales(raw, qtype)) == [0x8000, 0x0000, 0x0000, 0x8000]
        assert (raw[:, 2:] == 0x88).all()
    else:
        assert (raw == 0).all()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("amax", [1e-38, 1e-30, 1e-6, 1e-3, 7.8e-3, 1.0, 5.3e5, 8.3e6, 8.4e6, 1e30, 3e38])
def test_scale_edges(amax, qtype):
    """d in f16 subnormal / zero / overflow range, and d so small 1/d overflows f32."""
    x = block(amax, -amax / 2, amax / 3, amax / 127)
    raw = assert_same_bytes(x, qtype)
    d = np.float32(amax) / np.float32(127.0 if qtype == "q8_0" else -8.0)
    scale = f16_scales(raw, qtype)[0]
    if abs(d) >= 65520.0:  # rounds past f16 max: ggml stores +-inf and the block decodes to inf/NaN
        assert scale == (0x7C00 if d > 0 else 0xFC00)
    else:
        assert scale == struct.unpack("<H", struct.pack("<e", float(d)))[0]
    with np.errstate(over="ignore"):
        inverse_overflows = not np.isfinite(np.float32(1.0) / d)
    assert inverse_overflows == (amax == 1e-38)
    if inverse_overflows:  # the reference casts inf/NaN to int: x86 gives 0, and so does gguf
        assert (raw[0, 2:] == 0).all()


# ---- decode ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(x=scaled_blocks(), qtype=st.sampled_from(QTYPES))
def test_decode_matches_gguf(x, qtype):
    raw = ours(x, qtype)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(raw, GG[qtype]).reshape(x.shape)
        got = dequantize(raw, qtype, x.shape)
        got_t = dequantize_torch(raw, qtype, x.shape).numpy()
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, want)  # NaN == NaN here (inf scale times q = 0)
    np.testing.assert_array_equal(got_t, want)


def test_decode_helpers_and_dtypes():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    r8, r4 = encode_q8_0(x), encode_q4_0(x)
    np.testing.assert_array_equal(decode_q8_0(r8, x.shape), gguf.quants.dequantize(r8, GG["q8_0"]))
    np.testing.assert_array_equal(decode_q4_0(r4, x.shape), gguf.quants.dequantize(r4, GG["q4_0"]))
    bf = dequantize_torch(torch.from_numpy(r8), "q8_0", x.shape, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, torch.from_numpy(decode_q8_0(r8, x.shape)).bfloat16())
    # a bf16 torch tensor is accepted and quantized from its exact f32 values
    xt = torch.from_numpy(x).bfloat16()
    np.testing.assert_array_equal(quantize(xt, "q4_0"), oracle(xt.float().numpy(), "q4_0"))


# ---- round-trip error bounds -------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(x=scaled_blocks(), qtype=st.sampled_from(QTYPES))
def test_round_trip_error_bound(x, qtype):
    """Per element |x - dec| <= c*|d| + qmax*|d - dh| (+ f32 slop), dh the stored f16 scale.

    q = round(x / d) up to the f32 roundings of id = 1/d and of x*id (a few ulps of |q| <= 128),
    so |x - q*d| <= |d| * (c + 2^-16) with c = 1/2; decoding multiplies by dh, not d, which adds
    |q| * |d - dh| (|q| <= 127 for q8_0, |nibble - 8| <= 8 for q4_0; dh may be an f16 subnormal
    or 0, the bound still holds); the f32 product q*dh adds 2^-24 relative. q4_0 clips nibble 16
    to 15: an element at t = x/d in [7.5, 8] (the far side of a -max block) is off by up to one
    full step, so c = 1 there.
    """
    limit = 65000.0 * (127 if qtype == "q8_0" else 8)
    amax = float(np.abs(x).max())
    if amax > limit:  # keep d finite in f16: past it ggml stores inf (pinned in test_scale_edges)
        x = (x * np.float32(limit / amax / 2)).astype(np.float32)
    raw = ours(x, qtype)
    xb = x.reshape(-1, QK).astype(np.float64)
    if qtype == "q8_0":
        d = (np.abs(x.reshape(-1, QK)).max(axis=1, keepdims=True) / np.float32(127.0)).astype(np.float64)
    else:
        first = np.abs(xb).argmax(axis=1)[:, None]
        d = (np.take_along_axis(x.reshape(-1, QK), first, 1) / np.float32(-8.0)).astype(np.float64)
    dh = f16_scales(raw, qtype).view(np.float16).astype(np.float64)[:, None]
    dec = dequantize(raw, qtype, x.shape).reshape(-1, QK).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d != 0, xb / d, 0.0)
    c = np.where(t > 7.49, 1.0, 0.5) if qtype == "q4_0" else 0.5
    qmax = 127.0 if qtype == "q8_0" else 8.0
    bound = np.abs(d) * (c + 2.0**-16) + qmax * np.abs(d - dh) + np.abs(dec) * 2.0**-23
    assert (np.abs(xb - dec) <= bound).all()


# ---- refusals ----------------------------------------------------------------------------------


NAME = "layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_refuses_nonfinite(bad, qtype):
    x = np.ones((3, 128), np.float32)
    x[2, 77] = bad
    with pytest.raises(QuantError, match=rf"tensor '{NAME}' has NaN/Inf values; refusing to quantize"):
        quantize(x, qtype, NAME)


@pytest.mark.parametrize("qtype", QTYPES)
def test_refuses_partial_blocks(qtype):
    with pytest.raises(QuantError, match=rf"'{NAME}'.*rows of 48 values") as info:
        quantize(np.ones((2, 48), np.float32), qtype, NAME)
    assert isinstance(info.value, MemraError) and isinstance(info.value, ValueError)
    with pytest.raises(QuantError, match="unknown quant type"):
        quantize(np.ones((2, 64), np.float32), "q5_0", NAME)
    with pytest.raises(QuantError, match="do not hold"):
        dequantize(np.zeros(35, np.uint8), qtype, (1, 32))


def test_quantizable():
    assert quantizable((4096, 4096)) and quantizable((32,)) and quantizable((2, 3, 64))
    assert not quantizable((4096, 48)) and not quantizable(()) and not quantizable((7, 0))


def test_f32_to_f16_bits_rne_with_subnormals():
    rng = np.random.default_rng(2)
    sub = np.float32(2.0**-24)
    x = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.float32(1e-5),  # f16 subnormal range
        rng.standard_normal(2000).astype(np.float32) * np.float32(1e3),
        np.array([0.5, 1.5, 2.5, 3.5], np.float32) * sub,  # exact ties between subnormals
        np.array([0.0, -0.0, 65504.0, 65519.0, 2.0**-25, 2.0**-25 * 1.0000001], np.float32)])
    want = [struct.unpack("<H", struct.pack("<e", float(v)))[0] for v in x]  # Python's RNE half
    np.testing.assert_array_equal(f32_to_f16_bits(x), np.array(want, np.uint16))
    assert list(f32_to_f16_bits(np.array([65520.0, -1e30], np.float32))) == [0x7C00, 0xFC00]


# ---- reference linear --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_linear_ref_matches_gguf_dequant(qtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 160)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((5, 7, 160)).astype(np.float32))
    lin = QuantLinearRef(quantize(w, qtype, "w"), qtype, w.shape)
    assert lin.raw.dtype == torch.uint8 and "raw" in dict(lin.named_buffers())
    wg = torch.from_numpy(gguf.quants.dequantize(oracle(w, qtype), GG[qtype]))
    want = (x.double() @ wg.double().T)
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (5, 7, 96)
    # float32 against float64 over K = 160: the float32 sum's rounding (tests/engine/fp32_bounds.py)
    assert ((got.double() - want).norm() / want.norm()).item() < reorder_bound(w.shape[1])
    half = QuantLinearRef.from_float(torch.from_numpy(w), qtype)(x.bfloat16())
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_linear_ref_concat_is_block_rows_and_computes_the_parts_side_by_side(qtype):
    """ggml stores a weight row by row, so stacking along out is stacking block rows; the stack's
    matmul is the parts' matmuls side by side bit for bit (the reference dequantizes each row
    alone), and its `rows` are views that compute each part again."""
    rng = np.random.default_rng(4)
    outs, k = (64, 32, 32), 96
    parts = [QuantLinearRef.from_float(rng.standard_normal((n, k)).astype(np.float32), qtype) for n in outs]
    fused = QuantLinearRef.concat(parts)
    assert fused.shape == (sum(outs), k) and fused.qtype == qtype
    assert torch.equal(fused.raw, torch.cat([p.raw for p in parts]))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32)).to(dtype)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    lo = 0
    for p in parts:
        view = fused.rows(lo, lo + p.shape[0])
        assert view.shape == p.shape and view.raw.data_ptr() == fused.raw[lo].data_ptr()
        assert torch.equal(view.raw, p.raw) and torch.equal(view(x), p(x))
        lo += p.shape[0]
    kv = fused.rows(64, 128)  # a view of a view is a view of the first
    assert kv.rows(32, 64).raw.data_ptr() == fused.raw[96].data_ptr()
    # raw as `quantize` or a GGUF gives it ([rows, row_bytes]) or flat: stacked the same
    flat = QuantLinearRef(parts[0].raw.reshape(-1), qtype, parts[0].shape)
    assert torch.equal(QuantLinearRef.concat([flat, parts[1]]).raw, torch.cat([p.raw for p in parts[:2]]))


def test_quant_linear_ref_concat_and_rows_refuse_what_does_not_stack():
    w = np.ones((16, 64), np.float32)
    a = QuantLinearRef.from_float(w, "q8_0")
    with pytest.raises(QuantError, match="share qtype"):
        QuantLinearRef.concat([a, QuantLinearRef.from_float(w, "q4_0")])
    with pytest.raises(QuantError, match="in-features"):
        QuantLinearRef.concat([a, QuantLinearRef.from_float(np.ones((16, 96), np.float32), "q8_0")])
    with pytest.raises(QuantError):
        QuantLinearRef.concat([])
    for lo, hi in ((0, 0), (4, 2), (-1, 3), (0, 17)):
        with pytest.raises(QuantError, match="rows"):
            a.rows(lo, hi)
