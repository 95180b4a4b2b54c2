"""Quantized weights at the layer seam: ggml q8_0 / q4_0 blocks packed once at load.

`for_device(weight, device)` takes what the loaders produce (a plain tensor, or a
`QuantLinearRef` holding ggml blocks) and returns what the model should call: on CUDA, a
`memra_kernels` `QuantLinear` (repacked once into aligned int8 / nibbles + f16 scales, and
dequantized in registers by a small-M Triton kernel, so a call reads the quantized bytes once);
elsewhere the reference, which dequantizes on the fly. Plain tensors pass through.

`stack_out(parts)` and `out_rows(w, lo, hi)` fuse projections that share an input (a layer's
q/k/v, its gate/up) whatever the weights are: both quantized forms store a weight row by row per
output feature, so stacking along out is concatenating rows (ggml block rows, or packed qweight
and scales rows) and a run of output features is a view of them, as for a plain `[out, in]`.
"""

from __future__ import annotations

import torch


def for_device(weight: object, device: torch.device) -> object:
    from memra_cli.engine.quant.blocks import QuantLinearRef

    if not isinstance(weight, QuantLinearRef) or torch.device(device).type != "cuda":
        return weight
    try:
        from memra_kernels.quant_linear import QuantLinear
    except ImportError:  # no triton on this machine: the reference still computes the same function
        return weight
    return QuantLinear(weight.raw, weight.qtype, weight.shape).to(device)


def _kind(w: object) -> tuple | None:
    """What must agree for weights to stack: (type, storage dtype or qtype, in-features, device);
    None for what cannot stack (not 2-D, or no known row layout)."""
    if isinstance(w, torch.Tensor):
        return (torch.Tensor, w.dtype, w.shape[1], w.device) if w.dim() == 2 else None
    qtype, shape = getattr(w, "qtype", None), getattr(w, "shape", None)
    if qtype is None or shape is None or len(shape) != 2 or not hasattr(type(w), "concat"):
        return None
    device = w.device if hasattr(w, "packed") else w.raw.device  # QuantLinear / QuantLinearRef
    return (type(w), qtype, shape[1], device)


def stack_out(parts: list[object]) -> object | None:
    """Weights `[out_i, in]` sharing an input -> one weight `[sum(out_i), in]` whose output is
    theirs side by side (one matmul instead of len(parts)); None unless all are the same kind:
    plain tensors of one dtype, or quantized linears of one type and qtype (a q4_0 q beside q8_0
    k/v, or a bf16 part beside quantized ones, stays separate), with one in-features and device.
    The parts' bytes are copied once into the result: replace them with `out_rows` views."""
    kinds = {_kind(w) for w in parts}
    if len(kinds) != 1 or None in kinds:
        return None
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    return type(parts[0]).concat(parts)  # type: ignore[attr-defined]


def out_rows(w: object, lo: int, hi: int) -> object:
    """Output features `[lo, hi)` of a plain or quantized weight, as a view of its rows."""
    if isinstance(w, torch.Tensor):
        return w[lo:hi]
    return w.rows(lo, hi)  # type: ignore[attr-defined]
