"""Float32 tolerances derived from the arithmetic, for two evaluations of the same math that may
sum in different orders (ours against transformers; a graphed replay against eager; a GEMM at 3
rows against the same rows inside a 16-row one). Which order a BLAS call uses depends on the
CPU (AVX2, AVX-512, AMX pick different kernels and blockings) and on the matrix shape, so a
bound must hold for any order, not the one measured on one machine.

The model: a float32 sum of K products rounds K times, each by at most u = 2^-24 of the running
sum. The roundings are independent with random sign, so they add like a random walk: with high
probability the result is off by at most ~ sqrt(K)·u of its magnitude (Higham & Mary, "A new
approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019; the
worst case K·u is never approached by BLAS's blocked sums). Two evaluations each carry their
own error (factor 2), and through a chain of reductions (a layer's norms, projections, attention
scores, attention over the keys, MLP) the relative errors add.

Everything that must be bit-equal (fixed-width steps, a rollback against a fresh run) is compared
with `torch.equal` in the tests, not here.
"""

from __future__ import annotations

import math

import torch

U = 2.0 ** -24  # float32 unit roundoff: half of torch.finfo(torch.float32).eps


def reorder_bound(*reductions: int) -> float:
    """Relative bound on the difference of two float32 evaluations of a chain of reductions of
    the given lengths (each a sum of that many products), summed in any two orders."""
    return 2 * U * sum(math.sqrt(k) for k in reductions)


def layer_reductions(hidden: int, mixer_dim: int, head_dim: int, keys: int, intermediate: int) -> tuple[int, ...]:
    """The reduction lengths one decoder layer chains: input norm and q/k/v (or DeltaNet input)
    projections over `hidden`, scores over `head_dim`, the weighted sum over `keys` rows (the
    recurrent state of a DeltaNet layer sums as many), the output projection over `mixer_dim`
    (heads × head_dim), the post norm and the gate/up projections over `hidden`, down over
    `intermediate`."""
    return (hidden, hidden, head_dim, keys, mixer_dim, hidden, hidden, intermediate)


def assert_close_at_scale(got: torch.Tensor, want: torch.Tensor, bound: float, what: object = "") -> None:
    """Every element within `bound` × the tensor's largest magnitude: an element's rounding error
    scales with the terms summed into it, which the tensor's scale bounds, not its own value
    (an element near zero after cancellation carries the error of its large terms)."""
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    worst = (got - want).abs().max().item()
    assert worst <= bound * scale, f"{what}: max |diff| {worst:.3e} > {bound:.2e} × scale {scale:.3e}"
