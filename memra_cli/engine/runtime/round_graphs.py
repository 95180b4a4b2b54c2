"""A whole greedy round (or a whole plain decode step) as one CUDA graph.

With the target's step and the drafter's two parts graphed separately (graphs.py,
draft_graphs.py), a round on a small model is still host-bound: between the three replays the
host runs some twenty eager ops (input copies, the candidate concatenation, position ranges,
the argmax, copies out, the packing of the one host read), each a few microseconds of Python
and a launch, and the GPU waits for them after every read. Measured on the H200 with the
embedded pair, a DSpark round cost ~2.5 graphed plain steps where its kernels cost ~2.

A `RoundGraph` captures everything between two host reads as one replay. Its inputs are a few
integers written by one host-to-device copy; its output is one packed vector the host reads
once. What the body computes is the caller's (spec/round_bodies.py): here only the input and
output plumbing and the capture. Like every graph it binds the storages it was captured over,
so it is kept on the target state (`state.graphs`) and holds references to every other storage
it writes (the draft KV cache), which therefore outlive it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from memra_cli.engine.runtime import cuda_graphs


class RoundGraph:
    """`body(inputs [n] long) -> packed [k]` captured once; `run(values)` -> the packed list."""

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], capture_inputs: Sequence[int],
                 device: torch.device, keep: Sequence[object] = ()):
        """`capture_inputs`: the values the warm-up and capture run with (positions in the
        storages' slack, where nothing real lives). `keep`: objects the graph writes into that
        must live as long as it does (another storage)."""
        self.keep = tuple(keep)
        # The replay reads every tensor the body closes over (its constant rows, the block's
        # mask ids) at the addresses of the capture, but a CUDA graph holds no Python reference
        # to them: keep the body, or they are freed and their memory reused under the graph.
        self.body = body
        self.inputs = torch.tensor(list(capture_inputs), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(len(capture_inputs), dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()  # writes through numpy: no torch op per value
        self.graph, self.out = cuda_graphs.capture(lambda: body(self.inputs), device)

    def run(self, values: Sequence[int]) -> list:
        """Set the inputs (one copy from pinned memory, no sync), replay, and read the packed
        output (one device-to-host copy; the round's one sync). The pinned buffer is rewritten
        only after the previous read, so the copy that read it has finished."""
        self._host_np[:] = values
        self.inputs.copy_(self._host, non_blocking=True)
        self.graph.replay()
        return self.out.tolist()
