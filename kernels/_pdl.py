"""Programmatic dependent launch (PDL): a kernel's launch overlaps the end of the one before it.

On sm_90+ a kernel launched with CUDA's programmatic-stream-serialization attribute may start
while the previous kernel in its stream is still running; it must then wait (`griddepcontrol.wait`)
before it touches memory that kernel wrote or reads. Every memra kernel that the wrappers launch
with PDL waits first thing (`pdl_wait(PDL)` is its first statement), so the only thing that
overlaps is the launch itself: block scheduling and argument set-up, a few microseconds per kernel
in a decode step of hundreds of small kernels. The math and the bits are unchanged; the wait
orders every access exactly as plain stream order does.

Each kernel also signals `griddepcontrol.launch_dependents` right after its wait, so the next
PDL-launched kernel may be scheduled as soon as every block of this one is running. Kernels that
are not ours (cuBLAS, torch) are launched as usual and keep plain stream order on both sides.

Off on the CPU, under Triton's interpreter, below sm_90, with `MEMRA_PDL=0` (read at each
launch, so a graph captured after changing it follows it), and inside `plain_launches()`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl

from ._common import interpreting

ENV = "MEMRA_PDL"
_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


_SCOPE = threading.local()


@contextlib.contextmanager
def plain_launches():
    """Launch every kernel in plain stream order inside this block, this thread (and so in any
    CUDA graph captured in it), whatever `MEMRA_PDL` says. For a chain measured slower with PDL:
    the quantized drafter's round (docs/perf.md, "The drafter's side of the round")."""
    prev = getattr(_SCOPE, "plain", False)
    _SCOPE.plain = True
    try:
        yield
    finally:
        _SCOPE.plain = prev


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    raw = os.environ.get(ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV}={raw!r}: expected 0 or 1")
    if device.type != "cuda" or interpreting() or raw == "0" or getattr(_SCOPE, "plain", False):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(x: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose tensors live where `x` does: `PDL=True` (the kernel's
    wait) together with `launch_pdl=True` (the launch attribute), or nothing."""
    return _ON if enabled(x.device) else _OFF


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each pointer (no registers written, nothing waited for):
    what a kernel may do with its weights (which no kernel writes) before its PDL wait."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """First statement of every launched kernel: with PDL, wait for the previous kernel to finish
    and its writes to be visible, then let the next kernel's launch begin."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
