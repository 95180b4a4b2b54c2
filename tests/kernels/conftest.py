"""Kernel tests: on CUDA when there is a GPU, else through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` runs (Triton reads it when it decorates),
i.e. before a kernel module is imported: this conftest is imported before the test modules.
The folder is skipped when triton is not installed (it is a test extra, not a runtime dep).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    collect_ignore_glob = ["test_*.py"]
else:
    # Triton 3.6's interpreter makes a loop bound loaded from memory a Python int with
    # `int(ndarray of shape (1,))`, which NumPy >= 2.4 rejects (TypeError). Convert through the
    # single element instead; compiled kernels never take this path.
    from triton.runtime import interpreter as _interp

    def _needs_index_shim() -> bool:
        try:
            int(np.zeros(1, dtype=np.int64))
        except TypeError:
            return True
        return False

    # It also narrows float32 to bfloat16 by truncating the mantissa (the GPU rounds to nearest
    # even), which would put a spurious ulp between kernel and torch in every bf16 test: narrow
    # through torch instead, i.e. exactly as the GPU does.
    if hasattr(_interp, "_convert_float"):
        _orig_convert_float = _interp._convert_float

        def _convert_float(input, input_dtype, output_dtype, rounding_mode):
            if input_dtype == triton.language.float32 and output_dtype == triton.language.bfloat16:
                wide = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
                return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return _orig_convert_float(input, input_dtype, output_dtype, rounding_mode)

        _interp._convert_float = _convert_float

    # Its tl.dot is one np.matmul, whose BLAS may sum row i's products in an order that depends
    # on where row i sits in its block of rows (OpenBLAS's AVX2 kernels on a 2-core EPYC do), so
    # a row's bits would change with the rows beside it: the very property the invariance tests
    # check, and one a GPU's tl.dot has (each output row from its own input row). Multiply row by
    # row instead: every row is then one identical [1, K] x [K, N] call whatever surrounds it.
    _builder = getattr(_interp, "InterpreterBuilder", None)
    if _builder is not None and hasattr(_builder, "create_dot"):
        _orig_create_dot = _builder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            a_data, b_data = a.data, b.data
            if a_data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
                return _orig_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            rows = [np.matmul(a_data[i:i + 1], b_data, dtype=d.data.dtype) for i in range(a_data.shape[0])]
            return _interp.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

        _builder.create_dot = create_dot

    if _needs_index_shim() and hasattr(_interp, "_patch_lang_tensor"):
        _orig_patch_lang_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor

# `kernels/` installs as `memra_kernels`; with only PYTHONPATH=<repo> (the GPU image), alias it.
# Alias it too when the installed one is another checkout's (an editable install of a sibling
# worktree): these tests must test this checkout's kernels.
_root = Path(__file__).resolve().parents[2] / "kernels"
_found = importlib.util.find_spec("memra_kernels")
if _found is None or Path(_found.origin or "").resolve().parent != _root:  # pragma: no cover
    _spec = importlib.util.spec_from_file_location(
        "memra_kernels", _root / "__init__.py", submodule_search_locations=[str(_root)])
    sys.modules["memra_kernels"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["memra_kernels"])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
