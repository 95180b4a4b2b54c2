"""What one Qwen3.5 `static_step` launches, counted on the CPU: step-op calls and the torch ops
left around them, per layer kind.

On the GPU every step-op call is one Triton kernel (`attention` two: split over keys, then the
combine) and every other torch op of the step a kernel of its own; the weight matmuls are the
GEMMs. This runs one fixed-width step of a tiny random hybrid through `TorchStepOps` behind a
counting proxy (each call inside a `stepop::<name>` profiler range) and counts, with the CPU
profiler, the leaf aten ops outside those ranges that would launch a kernel (views, allocations
and no-op casts excluded), GEMMs apart. Steps of a few layer mixes give the per-layer numbers of
each kind by least squares (the per-step constant: embedding, final norm, lm_head, position
arithmetic). An op count, not a time: time it on a GPU with benchmarks/gpu/hybrid_step.py. It also counts
the torch ops of the commit after a one-real-row step padded to 16, with the padding rows'
recurrence skipped and run (`count_commit`).

    python -m benchmarks.qwen3_5_step_ops [--width 1] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.unfused import unfused_swiglu
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

# (mkldnn::_linear_pointwise: the CPU torch ops' float32 matmul of 8+ rows, torch_step_ops.onednn_linear)
GEMMS = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
         "mkldnn::_linear_pointwise"}
# ops that are one kernel on CUDA, whatever they decompose into on the CPU (mean: sum + div_)
ONE_KERNEL = {
    "aten::add", "aten::sub", "aten::mul", "aten::div", "aten::neg", "aten::pow", "aten::rsqrt",
    "aten::mean", "aten::sum", "aten::sigmoid", "aten::silu", "aten::softplus", "aten::exp",
    "aten::copy_", "aten::clone", "aten::index_copy_", "aten::cat", "aten::index", "aten::index_select",
    "aten::embedding", "aten::remainder", "aten::fill_", "aten::zero_", "aten::arange", "aten::where",
}
# leaf ops that launch nothing: views, metadata, allocations, casts that return their input
NO_LAUNCH = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
    "aten::slice", "aten::select", "aten::split", "aten::split_with_sizes", "aten::narrow",
    "aten::transpose", "aten::t", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::expand",
    "aten::expand_as", "aten::view_as", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::alias", "aten::detach", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
    "aten::unbind", "aten::chunk", "aten::result_type", "aten::to", "aten::contiguous", "aten::dim",
}
LAUNCHES = {"attention": 2, "gated_attention": 2}  # Triton launches of a step-op call (1 unless listed)


class CountingOps:
    """A step-ops object that counts its calls and marks each with a profiler range (all but
    `linear`: the weight matmuls stay visible to the profiler as GEMMs)."""

    def __init__(self, ops):
        self._ops, self.calls = ops, Counter()

    def __getattr__(self, name):
        if name == "swiglu":
            # the MLP's gate/up matmul and its activation as the torch path runs them (a GEMM,
            # then SiLU·mul); the kernels fuse the two only for the shapes of their measured table
            return functools.partial(unfused_swiglu, self)
        attr = getattr(self._ops, name)
        if not callable(attr) or name == "linear":
            # the weight matmuls go through the seam too (`linear`), but they are the step's
            # GEMMs, counted as such by the profiler (`GEMMS`), not as fused step ops
            return attr

        def call(*args, **kwargs):
            self.calls[name] += 1
            with record_function(f"stepop::{name}"):
                return attr(*args, **kwargs)

        return call


def _torch_leaves(prof) -> Counter:
    """Torch ops outside step-op ranges that launch a kernel on CUDA, by name: the outermost op
    of `GEMMS` / `ONE_KERNEL`, else any leaf aten op not in `NO_LAUNCH`."""
    out: Counter = Counter()

    def walk(ev):
        if ev.name.startswith("stepop::"):
            return
        if ev.name in GEMMS or ev.name in ONE_KERNEL:
            out[ev.name] += 1
            return
        if ev.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in ev.cpu_children):
            if ev.name not in NO_LAUNCH:
                out[ev.name] += 1
            return
        for c in ev.cpu_children:
            walk(c)

    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev)
    return out


def count_step(types: tuple[str, ...], width: int, ops=None, root: Path | None = None,
               dtype: torch.dtype = torch.bfloat16):
    """One `static_step` of `width` rows after a short prefill: (step-op calls, torch leaves)."""
    root = root or Path(tempfile.mkdtemp())
    path = make_tiny_qwen35(root / f"t{len(types)}_{types.count('full_attention')}", layer_types=types)
    model = Qwen35Target.from_dir(path, dtype)
    counting = CountingOps(ops or TorchStepOps())
    model.step_ops = counting
    runner = StepRunner(model, width)
    state = runner.new_state(64)
    runner.prefill(torch.arange(3, 12), state)
    ids, positions = torch.arange(width), torch.arange(state.length, state.length + width)
    counting.calls.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.static_step(ids, positions, state)
    return Counter(counting.calls), _torch_leaves(prof)


def count_commit(mode: str, skip_padding: bool, width: int = 16, root: Path | None = None) -> int:
    """Top-level torch ops of the commit after a fixed step of one real row padded to `width`
    (eager, torch step ops, rollback `mode`): with the padding rows' recurrence skipped (the
    runner's live rows) the step wrote the kept state and the commit is a flip; with it run
    (`set_live_rows` ignored) the commit restores the kept row (replay: the recurrence re-run
    layer by layer, each op a launch on a GPU without the graphed restore)."""
    root = root or Path(tempfile.mkdtemp())
    path = root / "commit"
    if not (path / "config.json").exists():
        make_tiny_qwen35(path, seed=1)
    model = Qwen35Target.from_dir(path, rollback=mode)
    runner = StepRunner(model, width)
    state = runner.new_state(64)
    if not skip_padding:
        state.set_live_rows = lambda n: None
    runner.prefill(torch.arange(3, 12), state)
    runner.fixed_step(torch.full((width,), 5), state.length, state, live=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state.commit(state.length + 1)
    return sum(1 for ev in prof.events() if ev.name.startswith("aten::") and ev.cpu_parent is None)


def per_layer(width: int = 1, ops=None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per-layer counts of each kind (and the per-step constant) from three layer mixes."""
    lin, full = "linear_attention", "full_attention"
    mixes = [(lin, lin, lin, full), (lin, full, full, full), (lin, lin, lin, full) * 2]
    rows, results = [], []
    root = Path(tempfile.mkdtemp())
    for types in mixes:
        calls, leaves = count_step(types, width, ops, root, dtype)
        rows.append([1.0, types.count(lin), types.count(full)])
        results.append((calls, leaves))
    a = torch.tensor(rows, dtype=torch.float64)

    def solve(values):
        sol = torch.linalg.lstsq(a, torch.tensor(values, dtype=torch.float64)[:, None]).solution[:, 0]
        return [round(v, 2) for v in sol.tolist()]

    out = {}
    names_calls = sorted(set().union(*(c for c, _ in results)))
    names_leaves = sorted(set().union(*(lv for _, lv in results)))
    out["step_op_calls"] = {n: solve([c[n] for c, _ in results]) for n in names_calls}
    out["torch_ops"] = {n: solve([lv[n] for _, lv in results]) for n in names_leaves}

    def total(pick):
        return solve([pick(c, lv) for c, lv in results])

    out["launches_step_ops"] = total(lambda c, lv: sum(LAUNCHES.get(n, 1) * k for n, k in c.items()))
    out["launches_torch_non_gemm"] = total(lambda c, lv: sum(k for n, k in lv.items() if n not in GEMMS))
    out["gemms"] = total(lambda c, lv: sum(k for n, k in lv.items() if n in GEMMS))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    res = per_layer(args.width, dtype=getattr(torch, args.dtype))
    print(f"one static_step, width {args.width}, {args.dtype}: "
          "[per step constant, per DeltaNet layer, per attention layer]")
    print("step-op calls (one Triton kernel each on CUDA; attention two):")
    for n, v in res["step_op_calls"].items():
        print(f"  {n:24s} {v}")
    print("torch ops outside the step ops (each a kernel on CUDA):")
    for n, v in res["torch_ops"].items():
        print(f"  {n:24s} {v}")
    for key in ("launches_step_ops", "launches_torch_non_gemm", "gemms"):
        print(f"{key:24s} {res[key]}")
    non_gemm = [round(x + y, 2) for x, y in zip(res["launches_step_ops"], res["launches_torch_non_gemm"])]
    print(f"{'non-GEMM launches (Triton ops)':24s} {non_gemm}")
    root = Path(tempfile.mkdtemp())
    for mode in ("stash", "replay"):
        skipped, run = count_commit(mode, True, root=root), count_commit(mode, False, root=root)
        print(f"commit of one real row padded to 16 ({mode}): {skipped} torch ops with the padding skipped, "
              f"{run} with it run (3 DeltaNet layers)")


if __name__ == "__main__":
    main()
