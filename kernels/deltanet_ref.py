"""The DeltaNet's torch bodies (no triton): the causal conv (what `deltanet.py`'s twin
`causal_conv_silu_ref` runs, and the engine's `layers.deltanet.causal_conv_silu`) and one row of
the gated delta rule (what the twin `gated_delta_rule_ref` and the engine's `gated_delta_rule` loop)."""

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


def delta_rule_row(s: torch.Tensor, q_i: torch.Tensor, k_i: torch.Tensor, v_i: torch.Tensor, g_i: torch.Tensor,
                   beta_i: torch.Tensor, s_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of the gated delta rule (HF `torch_recurrent_gated_delta_rule`), all float32:
    state `s [Hv, dk, dv]`, `q_i, k_i [Hv, dk]`, `v_i [Hv, dv]`, `g_i, beta_i [Hv]` ->
    (the new state, written into `s_out` when given; the row's output `[Hv, dv]`):

        S = S * exp(g);  delta = (v - k.S) * beta;  S = S + k (x) delta;  o = q.S
    """
    s = s * g_i.exp()[:, None, None]
    k_col = k_i.unsqueeze(-1)
    delta = (v_i - (s * k_col).sum(dim=-2)) * beta_i.unsqueeze(-1)
    update = k_col * delta.unsqueeze(-2)
    s = s + update if s_out is None else torch.add(s, update, out=s_out)
    return s, (s * q_i.unsqueeze(-1)).sum(dim=-2)
