"""SwiGLU's elementwise middle, the one torch body (no triton): the twin `activation.py`'s
`silu_mul` kernel is tested against, and the engine's `TorchStepOps.silu_mul`."""

from __future__ import annotations

import torch


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up [t, 2*I]` (gate | up) -> `silu(gate) * up` `[t, I]`, in the model dtype (silu
    rounded before the multiply, as torch's eager ops do)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
