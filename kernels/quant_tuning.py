"""Launch tiles of the quantized linear kernel (kernels/quant_linear.py), per weight shape.

The tiles and the split-K count are a function of (qtype, out, in) alone, never of M: that is
what keeps a row's output bit-identical whatever rows share its call (quant_linear's
"Determinism"). `KernelConfig` is one launch's tiles; `TUNED` the measured choice for the shapes
the engine launches; `config_for` picks a shape's (from `TUNED`, else a heuristic) and caches it.
A sweep (benchmarks/gpu/quant_linear_sweep.py) writes a whole candidate table as JSON, keyed by
`tuned_key`, which `load_tuned` puts in place of `TUNED` before a benchmark's first launch.

Public API: `KernelConfig`, `TUNED`, `config_for`, `tuned_key`, `load_tuned`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ggml_blocks_ref import QK
from .quant_pack import QTYPES

try:  # the package also works without Triton (quant_linear then runs the torch reference)
    import triton
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None

__all__ = ["KernelConfig", "TUNED", "config_for", "tuned_key", "load_tuned"]


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of one launch.

    block_m: rows of x per program (M is padded up to it; larger M runs several row tiles, each
    re-reading the weight); block_n: output features per program; block_k: `in` columns per
    loop step; split_k: programs sharing one tile's `in` range (partials reduced in a fixed
    order); scale_after_dot: multiply exact integer weights into x per 32-block and scale the
    partial product (fewer conversions) instead of dequantizing the weight before the dot;
    swap_ab: compute out.T tiles (weight tile as the dot's left operand; with 4+ warps and
    block_n >= 64 the sm_90 compiler takes warpgroup MMAs, below that the per-warp ones);
    mantissa: dequantize-first through byte permutes (kernels/quant_linear.py), the same weights.
    """

    block_m: int = 32
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_after_dot: bool = False
    swap_ab: bool = False
    mantissa: bool = False

    def check(self) -> "KernelConfig":
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.block_k < QK:
            raise ValueError(f"block_k must be >= {QK}, got {self.block_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.mantissa and self.scale_after_dot:
            raise ValueError("mantissa is a dequantize-first path: it cannot go with scale_after_dot")
        return self


# Measured per-shape choices, keys (qtype, out, in): the fastest at M = 16 of the sweep in
# benchmarks/gpu/kernels_quant.py on an H200 (CUDA-graph timing), each checked there against the
# reference and for row invariance. Rerun the script and paste its TUNED table to update.
_C = KernelConfig
TUNED: dict[tuple[str, int, int], KernelConfig] = {
    ("q8_0", 4096, 4096): _C(block_m=16, block_n=64, block_k=128, split_k=8, num_stages=2),
    ("q8_0", 1024, 4096): _C(block_m=16, block_n=32, block_k=256, split_k=8),
    ("q8_0", 12288, 4096): _C(block_m=16, block_n=64, block_k=128, split_k=2),
    ("q8_0", 4096, 12288): _C(block_m=16, block_n=64, block_k=128, split_k=8),
    ("q8_0", 4096, 20480): _C(block_m=32, block_n=64, block_k=128, split_k=8, num_stages=2,
                              swap_ab=True),
    # the fused drafter's stacks (q/k/v, and k/v for the ingest)
    ("q8_0", 6144, 4096): _C(block_m=16, block_n=64, block_k=128, split_k=4),
    ("q8_0", 2048, 4096): _C(block_m=16, block_n=64, block_k=128, split_k=8, num_warps=8),
    ("q4_0", 4096, 4096): _C(block_m=16, block_n=64, block_k=128, split_k=8, swap_ab=True),
    ("q4_0", 1024, 4096): _C(block_m=16, block_n=64, block_k=256, split_k=16),
    ("q4_0", 12288, 4096): _C(block_m=32, block_n=64, block_k=128, split_k=2, swap_ab=True),
    ("q4_0", 4096, 12288): _C(block_m=16, block_n=64, block_k=128, split_k=8, swap_ab=True),
    ("q4_0", 4096, 20480): _C(block_m=16, block_n=64, block_k=128, split_k=8, swap_ab=True),
}

_CONFIG_CACHE: dict[tuple[str, int, int], KernelConfig] = {}


def _pow2_at_most(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def _heuristic(qtype: str, n: int, k: int) -> KernelConfig:
    """Tiles for shapes not in TUNED: the H200 sweep's usual winners, with `in` split until
    there are about two programs per multiprocessor (keeping >= 2 loop steps per program)."""
    q4 = qtype == "q4_0"
    block_n = min(64, max(16, triton.next_power_of_2(n) if triton else 64))
    block_k = max(QK, min(128, _pow2_at_most(k)))
    from ._splitk import split_for  # imports triton, as every caller of these tiles does

    split = split_for(-(-n // block_n), -(-k // block_k))
    return KernelConfig(block_m=16, block_n=block_n, block_k=block_k, split_k=split,
                        swap_ab=q4)


def config_for(qtype: str, n: int, k: int) -> KernelConfig:
    """The fixed tile configuration for a weight [n, k] of `qtype` (same for every M)."""
    key = (qtype, int(n), int(k))
    cfg = _CONFIG_CACHE.get(key)
    if cfg is None:
        cfg = TUNED.get(key) or _heuristic(*key)
        _CONFIG_CACHE[key] = cfg.check()
    return cfg


def tuned_key(qtype: str, n: int, k: int) -> str:
    """A TUNED key as the sweep's JSON table writes it: "q8_0 6144x4096"."""
    return f"{qtype} {int(n)}x{int(k)}"


def load_tuned(path) -> dict[tuple[str, int, int], KernelConfig]:
    """Replace TUNED with the table a sweep wrote (benchmarks/gpu/quant_linear_sweep.py `--tuned`:
    {"QTYPE OUTxIN": {KernelConfig fields}}), for a benchmark that times a candidate table
    before its first launch; returns the table. A key or field it cannot read raises ValueError
    naming it (nothing replaced)."""
    import json
    from pathlib import Path

    raw = json.loads(Path(path).read_text())
    table = {}
    for key, fields in raw.items():
        try:
            qtype, dims = key.split(" ")
            n, k = (int(v) for v in dims.split("x"))
            if qtype not in QTYPES:
                raise ValueError(f"unknown quant type {qtype!r}")
            table[(qtype, n, k)] = KernelConfig(**fields).check()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: entry {key!r}: {exc} (expected \"q8_0|q4_0 OUTxIN\": "
                             f"{{KernelConfig fields}})") from exc
    TUNED.clear()
    TUNED.update(table)
    _CONFIG_CACHE.clear()
    return table
