"""Routed experts' weights as every MoE family reads them, and the weights a step reads besides.

Two checkpoint layouts hold a layer's `E` SwiGLU experts under `<prefix>experts.`:

- per expert: `{e}.gate_proj.weight [I, h]`, `{e}.up_proj.weight [I, h]`, `{e}.down_proj.weight
  [h, I]` (what transformers 5.25's `save_pretrained` writes for the Qwen MoE families, and the
  published Qwen checkpoints);
- stacked: `gate_up_proj [E, 2I, h]` (gate rows first) and `down_proj [E, h, I]` (transformers 5's
  in-memory layout, which it writes as is for Gemma 4).

Either loads to the stacked tensors layers/moe.py's `moe_swiglu` takes. `RoutingRecorder`: what
every MoE family mixes in so a forward's routing can be kept (the priced window's routed cost);
`LiveRouting`: what routes a fixed step's padding rows to no expert.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch


def expert_shapes(tensors, prefix: str, num_experts: int, hidden: int, inter: int) -> tuple[dict, bool]:
    """The expert tensors a layer needs in the layout the checkpoint holds (name -> shape), and
    whether that layout is the stacked one. `tensors`: the checkpoint's names; `prefix`: up to and
    including `experts.`. The stacked layout is picked when its `gate_up_proj` is present."""
    if prefix + "gate_up_proj" in tensors:
        return {prefix + "gate_up_proj": (num_experts, 2 * inter, hidden),
                prefix + "down_proj": (num_experts, hidden, inter)}, True
    need = {}
    for e in range(num_experts):
        need.update({f"{prefix}{e}.gate_proj.weight": (inter, hidden), f"{prefix}{e}.up_proj.weight": (inter, hidden),
                     f"{prefix}{e}.down_proj.weight": (hidden, inter)})
    return need, False


def load_experts(load, prefix: str, num_experts: int, stacked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w_gate_up [E, 2I, h], w_down [E, h, I])` of the experts under `prefix`, read by `load(name)`
    (in the model dtype, on the device) from the layout `expert_shapes` found (and checked)."""
    if stacked:
        return load(prefix + "gate_up_proj"), load(prefix + "down_proj")
    gate_up = torch.stack([torch.cat([load(f"{prefix}{e}.gate_proj.weight"), load(f"{prefix}{e}.up_proj.weight")])
                           for e in range(num_experts)])
    down = torch.stack([load(f"{prefix}{e}.down_proj.weight") for e in range(num_experts)])
    return gate_up, down


def step_weight_elements(layers, lm_head: torch.Tensor, hidden: int, final_norm: torch.Tensor | None = None) -> int:
    """Weight elements a one-row step reads outside the routed experts: every tensor of every
    layer's weights (dataclasses, walked; a stacked `w_gate_up` / `w_down` of `[E, ., .]` under
    an `experts` field left out), the final norm, the lm_head and one embedding row. The priced
    verify window's fixed cost for a family whose shape the Qwen3 formula does not describe."""
    total = lm_head.numel() + hidden + (0 if final_norm is None else final_norm.numel())
    for layer in layers:
        total += _elements(layer)
    return total


def _elements(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (tuple, list)):
        return sum(_elements(x) for x in obj)
    if not dataclasses.is_dataclass(obj):
        return 0
    total = 0
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name == "experts" and value is not None:  # routed: priced per expert, not here
            total += sum(_elements(getattr(value, f.name)) for f in dataclasses.fields(value)
                         if f.name not in ("w_gate_up", "w_down"))
        else:
            total += _elements(value)
    return total


class RoutingRecorder:
    """Mixed into every MoE family: `recording_routing()` keeps the expert ids each sparse layer
    routes to while it is open (spec/priced.py `routed_unions` reads them). Each family calls
    `_record_routing(layer, ids [t, k])` after routing (`layer`: any key one layer keeps, e.g.
    `id()` of its expert weights); nothing is kept outside the context."""

    _routing: dict | None = None

    @contextmanager
    def recording_routing(self):
        """Yields `{layer key: [ids [t, k] per call, in call order]}`, filled by the forwards run
        inside (an eager prefill: its chunks in token order)."""
        self._routing = {}
        try:
            yield self._routing
        finally:
            self._routing = None

    def _record_routing(self, layer, ids: torch.Tensor) -> None:
        if self._routing is not None:
            self._routing.setdefault(layer, []).append(ids.detach().clone())


class LiveRouting:
    """Mixed into every MoE family (before its base target): a fixed step's padding rows read no
    experts. `static_step` (and `static_step_picks`, a greedy round's step, where the family has
    one) takes the state's live-row count (`state.live`, int32 `[1]` on the device:
    models/state.py `LiveRows`) for the routings it runs (`_live_rows`, which each family
    hands to the step ops' `moe_route`): every row from it on gets the no-expert id and weight 0,
    and the counter (`self.reads`) counts the live rows' experts only. Inside the state's
    `reading_rows(n)` (a plain decode step: n = 1) the rows from n on are padding too, and the
    routing knows it on the host (`_live_bound`): the expert kernels' grid then holds n * k
    experts' programs, not every expert's. An eager `forward` (every
    row real) masks nothing. The count is read on the device, so a graph replay takes whatever
    the state holds then. A graphed prefill's padding rows are masked the same way
    (`padded_forward`)."""

    _live_rows: torch.Tensor | None = None
    _live_bound: int | None = None

    @contextmanager
    def _routing_live_rows(self, live: torch.Tensor, bound: int | None = None):
        """The routings run inside take their live-row count from `live` (int32 `[1]`), and
        treat the rows from `bound` on (a host int, the state's `reading_rows`) as padding too."""
        self._live_rows, self._live_bound = live, bound
        try:
            yield
        finally:
            self._live_rows, self._live_bound = None, None

    def static_step(self, ids, positions, state, taps=None, widen: bool = True):
        with self._routing_live_rows(state.live, state.live_bound):
            return super().static_step(ids, positions, state, taps, widen)

    @property
    def static_step_picks(self):
        """The base family's greedy-round step (`round_bodies.greedy_step`) under the same live
        rows as `static_step`, or None where the family has none (the round then runs
        `static_step`)."""
        fused = getattr(super(), "static_step_picks", None)
        if fused is None:
            return None

        def picks(ids, positions, state, taps=None):
            with self._routing_live_rows(state.live, state.live_bound):
                return fused(ids, positions, state, taps)

        return picks

    def padded_forward(self, ids, start, state, taps, live: torch.Tensor):
        """`forward` of `ids [t]` whose first `live` rows (int32 `[1]` on the device) are real and
        the rest padding that reads no experts: a graphed prefill's bucket (runtime/graphs.py
        `PrefillGraph`), whose replay takes the count its run writes."""
        with self._routing_live_rows(live):
            return self.forward(ids, start, state, taps)
