"""A row's sum of squares in one fixed order, whatever the tiles, warps or kernel (no launches here).

The residual add + RMSNorm folded into the dense kernel (kernels/dense_linear.py) splits a row's
statistic over kernels: the producing matmul sums the squares of each of its n tiles, the consuming
matmul sums those partials. `tl.sum`'s order follows the tensor's layout (threads, warps), which
differs between kernels, so here the order is the index's: the pairwise tree over adjacent
elements of the row zero-padded to a power of two, ((x0² + x1²) + (x2² + x3²)) + ..., built from
reshapes and splits (pure element pairings, no layout reduction). A power-of-two tile aligned in the
row is a subtree, and a zero half adds +0 exactly, so the producer's per-tile trees summed by the
consumer's tree over tiles (or by the norm kernel's, `norm.rms_norm_partials`) are the tree over
the whole row, whatever the producer's tile width: the torch twin's (`norm_ref.tree_sumsq_ref`).

The squares are rounded on their own (`square_rn`): with the compiler's multiply-add contraction a
square feeding the tree's first add could become one fused multiply-add in one kernel and not in
another.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def square_rn(x, PLAIN: tl.constexpr):
    """x * x (float32), rounded on its own (PTX `mul.rn` is never contracted into an FMA); PLAIN
    (the interpreter's: no inline PTX, and it never contracts) multiplies plainly."""
    if PLAIN:
        return x * x
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def pairwise_rows(v, ROWS: tl.constexpr, N: tl.constexpr):
    """Each row of `v [ROWS, N]` (float32, N a power of two) summed as the adjacent-pair tree -> [ROWS]."""
    for level in tl.static_range(N.bit_length() - 1):
        a, b = tl.split(tl.reshape(v, (ROWS, N >> (level + 1), 2)))
        v = a + b
    return tl.reshape(v, (ROWS,))
