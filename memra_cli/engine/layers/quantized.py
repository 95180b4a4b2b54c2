"""Quantized weights at the layer seam: ggml q8_0 / q4_0 blocks packed once at load.

`for_device(weight, device)` takes what the loaders produce (a plain tensor, or a
`QuantLinearRef` holding ggml blocks) and returns what the model should call: on CUDA, a
`memra_kernels` `QuantLinear` (repacked once into aligned int8 / nibbles + f16 scales, and
dequantized in registers by a small-M Triton kernel, so a call reads the quantized bytes once);
elsewhere the reference, which dequantizes on the fly. Plain tensors pass through.
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
