"""Kernel launches of one fixed-width target step, counted on the CPU (not a timing).

Builds a small random Qwen3 or LLaMA target (`gpu_shapes.SHAPES` "small" / "llama-small", bf16),
or a tiny Qwen3-MoE one (`--family qwen3_moe`: `moe_step.build("tiny")`, routed as its "a3b"
shape, one live row as a plain decode step runs), or a tiny random Qwen3.5 MoE hybrid / MoE Gemma 4
(`--family qwen3_5_moe` / `gemma4_moe`: `memra_cli.tiny`'s checkpoints, loaded in bf16, every weight
matmul routed to the dense kernel, one live row; counted, not scaled: the `8b` keys are the tiny
model's own layer count), or the embedded target itself (`--family embedded`: its weight matmuls
on the dense kernel, as shipped; `embedded_cublas`: on cuBLAS, benchmarks/gpu/embedded_dense.py's
shapes taken out of the table, the A/B that script times; counted, not scaled), puts the Triton step ops in (under Triton's interpreter when there is no
GPU), routes each weight matmul where the 8B shape's would go (the dense kernel where the 8B
weight's shape is in `dense_linear.TUNED`, `F.linear` else), runs one 16-row `static_step` and
counts

- Triton launches, by kernel name (every `kernel[grid](...)`);
- torch ops that launch a kernel on a GPU (a `TorchDispatchMode` over the step; views, `empty*`
  and the ops inside a Triton launch are not counted), by op name: a weight matmul left to
  cuBLAS counts as one here, though cuBLAS may launch two (a split-K reduction).

`--round dspark|dflash` (the embedded families only) counts a whole greedy speculative round
instead: the body a round graph captures (`spec/round_bodies.py`'s `speculative_round_chained`:
the drafter's block forward, heads and chain, the verify step, the ingest and the settlement),
with the embedded drafter of that kind, beside the plain decode step's body (`plain_step_chained`).

`--greedy` counts a greedy round's step instead (`spec/round_bodies.py`'s `greedy_step`: the
lm_head and its argmax, no float32 logits); `--variant unfused` installs the step ops with their
launch fusions undone (`TritonStepOps.unfused`: the q/k/v projection + rope, the embedding +
first norm, the lm_head + argmax, the projections' residual add + the norm folded into the next
matmul), the A/B the GPU benchmark times (`target_step --variants triton,triton-unfused`).

    python -m benchmarks.step_launches [--family qwen3|llama|qwen3_moe|qwen3_5_moe|gemma4_moe|embedded|embedded_cublas]
        [--greedy] [--variant fused|unfused] [--round dspark|dflash] [--json OUT]

Per layer, and per step (the per-layer count times the 8B shape's layers plus the rest) are
printed: the 8B step launches the same kernels per layer, only more layers.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton's interpreter, with the kernel tests' shims for it (NumPy >= 2.4, bf16 rounding, a
    # row-by-row dot), set before any @triton.jit runs (under pytest that conftest already ran)
    os.environ["TRITON_INTERPRET"] = "1"
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_kernel_test_shims", Path(__file__).resolve().parents[1] / "tests" / "kernels" / "conftest.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu_shapes import SHAPES, random_target

W = 16
# --family -> (counted, routed as): gpu_shapes.SHAPES keys, or moe_step.SHAPES keys for qwen3_moe
FAMILIES = {"qwen3": ("small", "8b"), "llama": ("llama-small", "llama-8b"), "qwen3_moe": ("tiny", "a3b"),
            "qwen3_5_moe": ("tiny", None), "gemma4_moe": ("tiny", None),
            # the embedded target itself (memra_cli/assets), its matmuls as shipped (the dense kernel) or
            # on cuBLAS (benchmarks/gpu/embedded_dense.py's shapes taken out of the table)
            "embedded": ("assets", "dense"), "embedded_cublas": ("assets", "cublas")}
# the tiny checkpoints' MoE: (experts, top-k, intermediate), as `memra_cli.tiny`'s own
TINY_MOE = (8, 2, 32)
# torch ops that launch no kernel: allocations and metadata
_FREE = ("empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh", "_local_scalar_dense", "promote_types")
# the CPU's form of a GPU op, counted under the GPU op's name: the torch step ops send a CPU weight
# matmul of 8+ rows to oneDNN over its packed weight (torch_step_ops.onednn_linear), F.linear on a GPU
_CPU_AS_GPU = {"_linear_pointwise": "linear"}


class _TorchOps(TorchDispatchMode):
    """Counts the torch ops of a block that would launch a GPU kernel (not views, not allocations)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # `to` may return its input (a view) or a converted copy (a kernel): told apart by storage
        copied = name == "to" and out.data_ptr() != args[0].data_ptr()
        if not self.paused and name not in _FREE and (copied or not func.is_view):
            self.counts[_CPU_AS_GPU.get(name, name)] += 1
        return out


@contextlib.contextmanager
def counting():
    """`(triton, torch)` Counters of the launches inside the block."""
    from triton.runtime.jit import KernelInterface

    triton_counts: collections.Counter = collections.Counter()
    torch_ops = _TorchOps()
    original = KernelInterface.__getitem__

    def launch(self, grid):
        run = original(self, grid)
        name = getattr(getattr(self, "fn", None), "__name__", None) or type(self).__name__

        def counted(*args, **kwargs):
            triton_counts[name] += 1
            torch_ops.paused = True  # the interpreter's own torch calls are not the step's
            try:
                return run(*args, **kwargs)
            finally:
                torch_ops.paused = False

        return counted

    KernelInterface.__getitem__ = launch
    try:
        with torch_ops:
            yield triton_counts, torch_ops.counts
    finally:
        KernelInterface.__getitem__ = original


def _shape_pairs(target, family: str, big: dict) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(small weight shape, its big-shape counterpart) for the weights the step ops' `linear` /
    `swiglu` / `qkv_rope_kv_write` take: qkv, o, (dense) gate/up and down, lm_head."""
    w = target.layers[0]
    small = [tuple(w.wqkv.shape), tuple(w.wo.shape), tuple(target.lm_head_weight.shape)]
    if family == "qwen3_moe":  # moe_step.SHAPES keys; every layer routes (no dense gate/up): the router
        h, q, kv = big["hidden_size"], big["num_attention_heads"] * big["head_dim"], \
            big["num_key_value_heads"] * big["head_dim"]
        return list(zip(small + [tuple(w.experts.router.shape)],
                        [(q + 2 * kv, h), (h, q), (big["vocab_size"], h), (big["num_experts"], h)]))
    h, q, kv, ff = big["hidden"], big["heads"] * big["hd"], big["kv"] * big["hd"], big["ffn"]
    pairs = list(zip(small, [(q + 2 * kv, h), (h, q), (big["vocab"], h)]))
    return pairs + [(tuple(w.w_gate_up.shape), (2 * ff, h)), (tuple(w.w_down.shape), (h, ff))]


def route_like(target, routed_as: dict, family: str = "qwen3") -> list[tuple[int, int]]:
    """The small target's weight shapes whose big counterparts are in `dense_linear.TUNED`
    (qkv, o, gate/up, down, lm_head by role), added to TUNED so its step routes as the big one's."""
    from memra_kernels import dense_linear

    if routed_as in ("dense", "cublas"):  # the embedded target: its shapes as shipped, or taken out
        from benchmarks.gpu.embedded_dense import EMBEDDED_SHAPES, without_embedded

        if routed_as == "cublas":
            without_embedded(dense_linear.TUNED)
        return [shape for shape in EMBEDDED_SHAPES if shape in dense_linear.TUNED]
    if routed_as is None:  # a tiny MoE hybrid / Gemma 4: every weight matmul to the dense kernel, unsplit
        shapes = sorted({tuple(w.shape) for w in _weights(target.layers) if w.dim() == 2} |
                        {tuple(target.lm_head_weight.shape)})
        for sm in shapes:
            dense_linear.TUNED.setdefault(sm, dense_linear.KernelConfig(block_n=16, block_k=16, split_k=1))
        return shapes
    added = []
    for sm, b in _shape_pairs(target, family, routed_as):
        if b in dense_linear.TUNED:  # split or not as the big shape's tiles are (the argmax epilogue needs unsplit)
            added.append(sm)
            split = 2 if dense_linear.TUNED[b].split_k > 1 else 1
            dense_linear.TUNED.setdefault(sm, dense_linear.KernelConfig(block_n=16, block_k=16, split_k=split))
    return added


def _weights(obj):
    """Every tensor of a layer list's weight dataclasses (walked)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _weights(x)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _weights(getattr(obj, f.name))


def _build_tiny_moe(family: str, device):
    """A tiny random `qwen3_5_moe` / `gemma4_moe` target in bf16 (a checkpoint written to a
    temporary folder, then loaded as the engine loads it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        if family == "qwen3_5_moe":
            from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget
            from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

            path = make_tiny_qwen35(Path(root) / family, moe=TINY_MOE, intermediate=48)
            return Qwen35MoeTarget.from_dir(path, dtype=torch.bfloat16, device=device)
        from memra_cli.engine.models.gemma4_moe import Gemma4MoeTarget
        from memra_cli.tiny.gemma4 import make_tiny_gemma4

        path = make_tiny_gemma4(Path(root) / family, moe=TINY_MOE)
        return Gemma4MoeTarget.from_dir(path, dtype=torch.bfloat16, device=device)


def _build(family: str, device):
    """(the small target of `family`, the shape it is routed as, that shape's layers and vocab)."""
    small, big = FAMILIES[family]
    if small == "assets":  # counted as it is: its own layers and vocabulary
        from memra_cli.assets import ASSETS
        from memra_cli.engine.models.qwen3 import Qwen3Target

        target = Qwen3Target.from_dir(ASSETS / "target", dtype=torch.bfloat16, device=device)
        return target, big, len(target.layers), target.vocab_size
    if big is None:
        target = _build_tiny_moe(family, device)
        return target, None, len(target.layers), target.vocab_size
    if family == "qwen3_moe":
        from benchmarks.moe_step import SHAPES as MOE_SHAPES, build

        torch.manual_seed(0)
        s = MOE_SHAPES[big]
        return build(small, torch.bfloat16, device), s, s["num_hidden_layers"], s["vocab_size"]
    return random_target(SHAPES[small], torch.bfloat16, device), SHAPES[big], SHAPES[big]["layers"], \
        SHAPES[big]["vocab"]


def _count_once(target, greedy: bool, device) -> tuple[collections.Counter, collections.Counter]:
    """One step's launches, after the set-up a runner does once (rope tables); an MoE target's
    step with one live row (a plain decode: its 15 padding rows route to no expert). The state
    holds more keys than any attention tile's split, as a step at the big shapes' contexts does
    (a storage of one split would write its outputs without the combine's launch)."""
    state = target.new_state(1100)
    if hasattr(state, "set_live_rows"):
        state.set_live_rows(1)
    target.ensure_positions(state.max_len)
    ids = torch.randint(0, target.vocab_size, (W,), device=device)
    pos = torch.arange(20, 20 + W, device=device)
    with counting() as (tri, tor):
        if greedy:  # as a greedy round runs its step
            from memra_cli.engine.spec.round_bodies import greedy_step

            greedy_step(target, ids, pos, state, None)
        else:
            target.static_step(ids, pos, state)
    return tri, tor


def count_step(family: str = "qwen3", greedy: bool = False, variant: str = "fused") -> dict:
    """One 16-row step's launches on the small target of `family`, routed as its big shape (8B,
    or A3B for qwen3_moe): by kernel, per layer (the step counted with all its layers and with
    one fewer), outside the layers, and the big shape's total (its layers times the per-layer
    count, plus the rest; the keys keep the name `8b`)."""
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps
    from memra_kernels import dense_linear

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = dict(dense_linear.TUNED)
    try:
        with torch.inference_mode():
            target, big, big_layers, big_vocab = _build(family, device)
            routed = route_like(target, big, family)
            ops = TritonStepOps()
            target.step_ops = ops.unfused() if variant == "unfused" else ops
            _count_once(target, greedy, device)  # a warm-up: buffers a runner keeps (counters, key slots)
            tri, tor = _count_once(target, greedy, device)
            layers = target.layers
            target.layers = layers[:-1]
            tri_less, tor_less = _count_once(target, greedy, device)
            target.layers = layers
    finally:
        dense_linear.TUNED.clear()
        dense_linear.TUNED.update(table)
    total = sum(tri.values()) + sum(tor.values())
    per_layer = total - sum(tri_less.values()) - sum(tor_less.values())
    rest = total - per_layer * len(layers)
    if tri.get("_row_argmax_kernel"):  # the 8B vocabulary's argmax splits its rows: a second launch folds them
        from memra_kernels import argmax

        rest += int(argmax.plan(W, big_vocab)[2] > 1) - int(argmax.plan(W, target.vocab_size)[2] > 1)
    return {"family": family, "greedy": greedy, "variant": variant, "layers": len(layers),
            "triton": dict(tri), "torch": dict(tor), "launches": total, "per_layer": per_layer,
            "per_layer_kernels": dict((tri - tri_less) + (tor - tor_less)),  # by name: what one more layer adds
            "outside_layers": rest, "shape_8b_layers": big_layers,
            "launches_8b": per_layer * big_layers + rest,  # outside_layers: at the 8B vocabulary
            "routed_to_dense": [list(r) for r in routed]}


def count_round(family: str, kind: str) -> dict:
    """A greedy speculative round's body and a plain decode step's body on the embedded pair
    (`family` embedded or embedded_cublas: its matmuls routed as `_build` routes them), with the
    embedded `kind` drafter, bf16, the Triton step ops: launches by kernel, as `count_step`."""
    from memra_cli.assets import ASSETS
    from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps
    from memra_cli.engine.spec.round_bodies import plain_step_chained, speculative_round_chained
    from memra_kernels import dense_linear

    if FAMILIES[family][0] != "assets":
        raise ValueError(f"--round counts the embedded pair's rounds: --family embedded or embedded_cublas, "
                         f"not {family}")
    table = dict(dense_linear.TUNED)
    out = {"family": family, "round": kind}
    try:
        with torch.inference_mode():
            engine = Engine.load(EngineConfig(target=ASSETS / "target", device="cpu", dtype="bfloat16", kernels=False))
            target = engine.target
            routed = route_like(target, FAMILIES[family][1], family)
            target.step_ops = TritonStepOps()  # under the interpreter (Engine.load takes them on CUDA only)
            arm = engine.arm(ArmConfig(draft=ASSETS / kind, mode=kind))
            arm.drafter.step_ops = target.step_ops
            # 35 + 400 tokens: the target's cache spans two of its 256-key splits and the draft
            # cache one of the drafter's 1,024 (attention.DRAFT_TILES), as in a bench session
            session = engine.session(list(range(5, 40)), 400, arm)
            session.prime()  # the prompt's K/V, in both caches
            kv, cache = session.proposer.kv, session.cache
            width = engine.runner.width
            bodies = {
                "round": (speculative_round_chained(arm.drafter, target, arm.program, kv, cache, arm.taps, width,
                                                    arm.program.window.is_confidence),
                          lambda: torch.tensor([cache.length, kv.length, 7, width, 100])),
                "plain": (plain_step_chained(target, cache, width), lambda: torch.tensor([cache.length, 7])),
            }
            for name, (body, inputs) in bodies.items():
                body(inputs())  # a warm-up: buffers a runner keeps (counters, the chain's table)
                x = inputs()  # (a round graph's inputs arrive by one copy, outside its body)
                with counting() as (tri, tor):
                    body(x)
                out[name] = {"launches": sum(tri.values()) + sum(tor.values()), "triton": dict(tri), "torch": dict(tor)}
            out["routed_to_dense"] = [list(r) for r in routed]
    finally:
        dense_linear.TUNED.clear()
        dense_linear.TUNED.update(table)
    out["round_over_plain"] = round(out["round"]["launches"] / out["plain"]["launches"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    p.add_argument("--greedy", action="store_true", help="a greedy round's step: model-dtype logits and the argmax")
    p.add_argument("--variant", choices=("fused", "unfused"), default="fused")
    p.add_argument("--round", choices=("dspark", "dflash"), default=None,
                   help="count a whole greedy speculative round with this embedded drafter, beside a plain decode "
                        "step (--family embedded or embedded_cublas)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if a.round and FAMILIES[a.family][0] != "assets":
        p.error(f"--round {a.round}: counts the embedded pair's rounds, so --family embedded or embedded_cublas")
    res = count_round(a.family, a.round) if a.round else count_step(a.family, a.greedy, a.variant)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
