"""The DeltaNet causal conv's one torch body (no triton): what `deltanet.py`'s twin
`causal_conv_silu_ref` runs, and the engine's `layers.deltanet.causal_conv_silu`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_silu_body(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. `xs [K-1+t, C]` = the window before the rows, then the rows'
    conv inputs; `w [C, K]` (float32). Returns `[t, C]` in xs's dtype.

    A fixed-order float32 sum over the K taps, elementwise, so a row's value does not depend on
    how many rows share the call (F.conv1d may pick a different algorithm per length)."""
    k = w.shape[1]
    t = xs.shape[0] - (k - 1)
    xf = xs.float()
    acc = xf[0:t] * w[:, 0]
    for j in range(1, k):
        acc = acc + xf[j:j + t] * w[:, j]
    return F.silu(acc.to(xs.dtype))
