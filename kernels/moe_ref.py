"""The routed experts' GLU and combine, the one torch body (no triton): the twin `moe.py`'s
kernels are tested against, and what the engine's torch path runs (`TorchStepOps.moe_swiglu`,
`layers/moe.py`).

The gate activation is a switch (`ACTIVATIONS`): `silu` (SwiGLU, the Qwen families' experts) or
`gelu_tanh` (GELU with the tanh approximation, Gemma 4's experts). Everything else is one body.

Row invariance at a fixed step width: each expert that any row picked runs once, over a buffer
of the step's full width holding its rows in their own slots (zeros elsewhere), so a row's
products never depend on which or how many rows share its expert; a row's k contributions are
added in ascending expert index, starting from zeros, from that row's values only.

Eagerly it runs the experts the rows routed to, read on the host (`unique`); while a CUDA graph
is being captured, where no value may be read on the host, it runs every expert (one that no row
picked leaves every row unchanged), so the same bits come out either way.

A row whose ids are all E (the expert count: a fixed step's padding row, as `moe_route_ref`
routes it) picks no expert: it reads no weights and its output is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemma4_ref import gemma_add_norm_ref, gemma_rms_norm_ref
from .norm_ref import add_rms_norm_1p_ref, add_rms_norm_ref

# the gate activations the op takes, by the name the step ops and kernels share
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def capturing(x: torch.Tensor) -> bool:
    """Whether `x`'s stream is capturing a CUDA graph now (a host read would fail the capture)."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def moe_swiglu_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Σ_j weights[r, j] · down_e(act(gate_e(x_r)) · up_e(x_r)), e = experts[r, j], for
    `x [t, hidden]`, `weights [t, k]` (x's dtype), `experts [t, k]` (int, distinct in a row, or
    every slot E: a padding row, which runs no expert and comes out zero);
    `w_gate_up [E, 2*I, hidden]` (gate rows first), `w_down [E, hidden, I]`; `activation` a key
    of `ACTIVATIONS` (silu: SwiGLU). Returns `[t, hidden]`.

    Roundings, in the model dtype, in this order: each gate / up product, act(gate), its product
    with up, the down product, the product with the routing weight, and each add of the combine
    (ascending expert index, the order transformers' expert loop adds them, from zeros).
    """
    check_activation(activation)
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    n_exp = w_gate_up.shape[0]
    for e in range(n_exp) if capturing(x) else [e for e in torch.unique(experts).tolist() if e < n_exp]:
        hit = experts == e  # [t, k]; at most one True per row (top-k picks distinct experts)
        rows = hit.any(dim=-1)
        buf = torch.where(rows[:, None], x, x.new_zeros(()))  # on x's device: a capture refuses a CPU operand
        gate, up = F.linear(buf, w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w_down[e])  # [t, hidden]
        w = (weights * hit).sum(dim=-1)  # the row's weight for e, 0 where it did not pick e
        out = torch.where(rows[:, None], out + y * w[:, None], out)
    return out


def moe_swiglu_add_rms_norm_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                w_gate_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor,
                                norm_weight: torch.Tensor, eps: float, activation: str = "silu"
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_swiglu_ref`, then the residual add and the next norm (`norm_ref.add_rms_norm_ref`):
    `residual [t, hidden]`, `norm_weight [hidden]` -> (normed, residual + experts' output)."""
    return add_rms_norm_ref(moe_swiglu_ref(x, weights, experts, w_gate_up, w_down, activation), residual,
                            norm_weight, eps)


def moe_swiglu_shared_add_rms_norm_1p_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                                         w_gate_up: torch.Tensor, w_down: torch.Tensor, shared: torch.Tensor,
                                         gate: torch.Tensor, residual: torch.Tensor, w1p: torch.Tensor, eps: float,
                                         activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """The Qwen3.5 MoE hybrid's layer end: `moe_swiglu_ref` plus the gated shared expert,
    `routed + sigmoid(gate) * shared` (`shared [t, hidden]`, the shared expert's output; `gate
    [t, 1]`, its gate's logit; each op rounded to the model dtype), then the residual add and the
    next zero-centred norm (`norm_ref.add_rms_norm_1p_ref`, `w1p [hidden]` float32 `1 + w`) ->
    (normed, residual + the feed-forward's output)."""
    ff = moe_swiglu_ref(x, weights, experts, w_gate_up, w_down, activation) + torch.sigmoid(gate) * shared
    return add_rms_norm_1p_ref(ff, residual, w1p, eps)


def moe_gemma_add_norm_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor, dense: torch.Tensor, residual: torch.Tensor,
                           norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w_next: torch.Tensor, eps: float,
                           scalar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's MoE layer end (no per-layer inputs): the GELU-tanh experts of the pre-normed
    `x [t, hidden]` (`moe_swiglu_ref`), normed by `post_2`, plus the dense MLP's output `dense
    [t, hidden]` normed by `post_1` (`norms`: post_1, post_2, post-feed-forward; Gemma's norm,
    `gemma4_ref.gemma_rms_norm_ref`), the sum rounded; then `gemma4_ref.gemma_add_norm_ref` onto
    `residual` with the post-feed-forward norm, the layer's `scalar [1]` and the next norm
    `w_next`. Everything in x's dtype -> (new residual, normed)."""
    post_1, post_2, post_ff = norms
    routed = moe_swiglu_ref(x, weights, experts, w_gate_up, w_down, "gelu_tanh")
    ff = gemma_rms_norm_ref(dense, post_1, eps) + gemma_rms_norm_ref(routed, post_2, eps)
    return gemma_add_norm_ref(residual, ff, post_ff, w_next, eps, scalar)
