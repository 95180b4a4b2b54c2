"""Kernel launches of the Qwen3.5 hybrid's speculative round, counted on the CPU (not a timing):
its 16-row verify step and its commit, at the Qwen3.5-4B shape.

Builds tiny random hybrids in bf16 with a few layer mixes, puts the Triton step ops in (under
Triton's interpreter when there is no GPU), routes each weight matmul where the 4B shape's goes
(the dense kernel for every 4B weight in `dense_linear.TUNED`: all of them), and counts, with
`benchmarks.step_launches.counting` (Triton launches by kernel name; torch ops that launch a GPU
kernel, by op name):

- ``verify``: one 16-row step as a greedy round runs it (`round_bodies.greedy_step`: the lm_head's
  picks, no float32 logits), every row live;
- ``restore``: the commit of a round queued on the device, inside its graph
  (`Qwen35State.restore_round`, after the settlement wrote the kept rows): the conv windows and
  recurrent states of every DeltaNet layer after 8 kept rows of 16 (``restore``), and with a
  ladder window of 8 kept whole (``restore_window``: the live rows turn the replay into none);
- ``host_commit``: the same commit as the host runs it between two runner steps
  (`state.commit(start + 16)` then `state.rollback(start + 8)`), its restore graphed as on CUDA
  in replay mode (`_graphed_replay`: one small copy of the rows, then the graph, stood in for here
  by a call of its body, whose launches are counted; stash mode's is eager, on CUDA too);
- ``settle``: the settlement's launch (`settle_round`).

Per DeltaNet layer, per attention layer and per step come from the mixes by least squares;
``at_4b`` is each count at the 4B's 24 DeltaNet + 8 attention layers (the argmax's second launch,
where the 4B's vocabulary splits its rows, added). Counts per kernel name are given for the tiny
mix (3 DeltaNet + 1 attention layers).

    python -m benchmarks.hybrid_launches [--mode replay|stash] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from benchmarks.step_launches import counting  # sets up Triton's interpreter without a GPU

W, KEPT = 16, 8
LIN, FULL = "linear_attention", "full_attention"
MIXES = ((LIN, LIN, LIN, FULL), (LIN, FULL), (LIN, FULL, FULL))  # the first is the one shown by name
LAYERS_4B = {LIN: 24, FULL: 8}
VOCAB_4B = 248320
# the 4B's weights by role: (out, in), as `dense_linear.TUNED` keys them
SHAPES_4B = {"w_in": (12352, 2560), "w_out": (2560, 4096), "wqkv": (10240, 2560), "wo": (2560, 4096),
             "w_gate_up": (18432, 2560), "w_down": (2560, 9216), "lm_head": (VOCAB_4B, 2560)}


def route_like_4b(target) -> None:
    """Add the tiny target's weight shapes to `dense_linear.TUNED`, split or not as the 4B's
    weight of the same role is, so the tiny step launches what the 4B step launches."""
    from memra_kernels import dense_linear

    lin = next(w for w in target.layers if w.gdn is not None)
    full = next(w for w in target.layers if w.attn is not None)
    tiny = {"w_in": lin.gdn.w_in, "w_out": lin.gdn.w_out, "wqkv": full.attn.wqkv, "wo": full.attn.wo,
            "w_gate_up": lin.w_gate_up, "w_down": lin.w_down, "lm_head": target.lm_head_weight}
    for role, w in tiny.items():
        big = dense_linear.TUNED.get(SHAPES_4B[role])
        if big is None:
            continue  # the 4B's weight runs F.linear: so does the tiny one
        split = 2 if big.split_k > 1 else 1
        dense_linear.TUNED.setdefault(tuple(w.shape), dense_linear.KernelConfig(block_n=16, block_k=16, split_k=split))


class _CallingCache:
    """The runtime's `GraphCache` for a state's restores, its capture and replay a plain call."""

    def run(self, key, make, *args):
        make(*args)()


def _total(counts: tuple[Counter, Counter]) -> int:
    return sum(counts[0].values()) + sum(counts[1].values())


def count_mix(types: tuple[str, ...], mode: str, root: Path) -> dict[str, tuple[Counter, Counter]]:
    """Each section's (triton, torch) launch counters for a tiny hybrid with `types` layers."""
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps
    from memra_cli.engine.models.qwen3_5 import Qwen35Target
    from memra_cli.engine.runtime.steps import StepRunner
    from memra_cli.engine.spec.round_bodies import greedy_step
    from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

    path = make_tiny_qwen35(root / "_".join("l" if t == LIN else "f" for t in types), layer_types=types,
                            dtype=torch.bfloat16, seed=3)
    target = Qwen35Target.from_dir(path, torch.bfloat16, rollback=mode)
    target.step_ops = ops = TritonStepOps()
    route_like_4b(target)
    runner = StepRunner(target, W)
    state = runner.new_state(96)
    state._restore_graphs, state.graph_restores = _CallingCache(), mode == "replay"  # as on CUDA
    runner.prefill(torch.arange(3, 12), state)
    ids = torch.arange(W)
    out = {}

    state.set_live_rows(None)
    positions = torch.arange(state.length, state.length + W)
    greedy_step(target, ids, positions, state, None)  # a warm-up: what a runner sets up once (rope tables)
    state.commit(state.length + W)
    start, positions = state.length, positions + W  # (the round body's positions: one add, its own)
    with counting() as counts:
        sel, _ = greedy_step(target, ids, positions, state, None)
    out["verify"] = counts
    inputs = torch.tensor([start, start, 0, W, 1 << 40])
    cand = ids.clone()
    cand[KEPT] = (sel[KEPT - 1] + 1) % target.vocab_size  # slot KEPT wrong: KEPT rows kept
    cand[1:KEPT] = sel[:KEPT - 1]
    with counting() as counts:
        ops.settle_round(cand, sel, None, inputs, None, kind="ladder", cap=W, adapt=False,
                         restore=state.round_params, ring=state.ring)
    out["settle"] = counts
    state.round_params.copy_(torch.tensor([start % state.ring, KEPT], dtype=torch.int32))
    with counting() as counts:
        state.restore_round()
    out["restore"] = counts
    live = torch.tensor([KEPT], dtype=torch.int32)
    state.round_params.copy_(torch.tensor([start % state.ring, KEPT], dtype=torch.int32))
    with counting() as counts:
        state.restore_round(live)
    out["restore_window"] = counts
    with counting() as counts:  # the host's commit and rollback of the same step
        state.commit(start + W)
        state.rollback(start + KEPT)
    out["host_commit"] = counts
    return out


def count_round(mode: str = "replay") -> dict:
    """Every section's launches: by name for the first mix, per layer kind and at the 4B shape."""
    from memra_kernels import argmax, dense_linear

    table = dict(dense_linear.TUNED)
    root = Path(tempfile.mkdtemp())
    try:
        with torch.inference_mode():
            results = [count_mix(types, mode, root) for types in MIXES]
    finally:
        dense_linear.TUNED.clear()
        dense_linear.TUNED.update(table)
    a = torch.tensor([[1.0, t.count(LIN), t.count(FULL)] for t in MIXES], dtype=torch.float64)
    out: dict = {"mode": mode, "rows": W, "kept": KEPT, "mix_by_name": list(MIXES[0]), "sections": {}}
    for name in results[0]:
        totals = torch.tensor([[float(_total(r[name]))] for r in results], dtype=torch.float64)
        rest, per_lin, per_full = (round(v, 2) for v in torch.linalg.lstsq(a, totals).solution[:, 0].tolist())
        tri, tor = results[0][name]
        if name == "verify" and tri.get("_row_argmax_kernel"):  # the 4B's vocabulary splits the argmax's rows
            rest += int(argmax.plan(W, VOCAB_4B)[2] > 1) - int(argmax.plan(W, 512)[2] > 1)
        out["sections"][name] = {"triton": dict(tri), "torch": dict(tor), "launches": _total((tri, tor)),
                                 "per_deltanet_layer": per_lin, "per_attention_layer": per_full,
                                 "outside_layers": rest,
                                 "at_4b": round(rest + per_lin * LAYERS_4B[LIN] + per_full * LAYERS_4B[FULL])}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("replay", "stash"), default="replay", help="the rollback record")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    res = count_round(a.mode)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
