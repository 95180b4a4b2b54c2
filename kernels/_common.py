"""Host-side helpers shared by memra's Triton kernel wrappers (no kernels here).

Under `TRITON_INTERPRET=1` Triton runs kernels on CPU torch tensors (the tests); otherwise the
tensors must live on a CUDA device. Two interpreter facts shape the kernels:

* it stores bfloat16 as raw uint16 and does arithmetic (and `tl.dot`) on those bits, so every
  kernel widens bf16/f16 to float32 before any arithmetic (they would anyway: statistics and
  accumulations are float32), and attention's `tl.dot` widens its operands under the
  interpreter only (`interpreting()`), which leaves the values multiplied unchanged;
* Triton 3.6's interpreter turns a loop bound loaded from memory into a Python int with
  `int(ndarray of shape (1,))`, which NumPy >= 2.4 rejects; tests/kernels/conftest.py carries the
  shim. Compiled kernels are unaffected.
"""

from __future__ import annotations

import os

import torch
import triton

# Model dtypes the kernels accept (the engine runs float32 on the CPU, bf16 on the GPU).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensors(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device is CUDA unless the interpreter runs kernels."""
    device = tensors[0].device
    for x in tensors:
        if x.device != device:
            raise ValueError(f"tensors on different devices: {x.device} vs {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run "
            "them on the CPU through Triton's interpreter (tests only: it is slow)"
        )


def check_dtype(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} not supported (float32, bfloat16, float16)")


def check_last_contiguous(x: torch.Tensor, name: str) -> None:
    """The kernels index rows through strides but read each row as one contiguous span."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous (stride {x.stride(-1)})")


def check_positions(positions: torch.Tensor, t: int) -> None:
    """One position per row: `positions [t]` int64 or int32 (read on the device)."""
    if positions.shape != (t,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be [t] int64/int32, got {tuple(positions.shape)} {positions.dtype}")


def check_kv_caches(k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, n_kv: int, hd: int) -> None:
    """The caches a step writes in place: each `[n_kv, S, head_dim]`."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c is None or c.dim() != 3 or c.shape[0] != n_kv or c.shape[2] != hd:
            raise ValueError(f"{name} {None if c is None else tuple(c.shape)} is not [n_kv={n_kv}, S, head_dim={hd}]")


def gate_up_out(gate_up: torch.Tensor) -> torch.Tensor:
    """Checks a fused gate/up projection `[t, 2*I]` (gate the first half, up the second) and
    returns the `[t, I]` output the gated activations write."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [t, 2*I], got {tuple(gate_up.shape)}")
    check_tensors(gate_up)
    check_dtype(gate_up, "gate_up")
    check_last_contiguous(gate_up, "gate_up")
    return torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)
