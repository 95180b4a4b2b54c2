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
                 device: torch.device, keep: Sequence[object] = (), inputs: torch.Tensor | None = None):
        """`capture_inputs`: the values the warm-up and capture run with (positions in the
        storages' slack, where nothing real lives). `keep`: objects the graph writes into that
        must live as long as it does (another storage). `inputs`: a long vector to read the
        inputs from instead of the graph's own (graphs that share them: `PlainChain`); it is set
        to `capture_inputs` for the capture."""
        self.keep = tuple(keep)
        # The replay reads every tensor the body closes over (its constant rows, the block's
        # mask ids) at the addresses of the capture, but a CUDA graph holds no Python reference
        # to them: keep the body, or they are freed and their memory reused under the graph.
        self.body = body
        values = torch.tensor(list(capture_inputs), dtype=torch.long)
        if inputs is None:
            self.inputs = values.to(device)
        else:
            self.inputs = inputs
            inputs.copy_(values)
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


class PlainChain:
    """Plain decoding one round ahead: the device side of `Session`'s pipelined plain rounds.

    A graphed plain round costs its replay plus the host's part between two replays: reading the
    token (a sync), Python bookkeeping, the next input copy and the launch. The GPU idles
    through all of it (measured on the H200: ~0.2 ms a token on the embedded target, whose
    replay is 0.15 ms; ~0.1 ms on a 4B-shape hybrid). Here each round's graph writes its
    selection into the shared `inputs[1]`, the next round's anchor, so the host can queue round
    j+1 before it reads round j's token: the host's part then overlaps the GPU's.

    `inputs [2] long` (start, anchor) is shared by the round graphs of every buffer arrangement
    of the state (`graphs[variant]`). A launch copies the start (host-known) and, for the first
    round of a run, the anchor from a pinned slot, replays, and queues the selection's copy into
    another pinned slot and an event. Slots alternate, so a launch may be queued while the
    previous launch is unread, but not two (`launch` refuses): the slot it rewrites was read by
    then, and so was the input copy that read its start.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.inputs = torch.zeros(2, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._in_host = torch.zeros((2, 2), dtype=torch.long, pin_memory=pin)
        self._out_host = torch.zeros((2, 1), dtype=torch.long, pin_memory=pin)
        self._in_np, self._out_np = self._in_host.numpy(), self._out_host.numpy()
        self._events: list = [None, None]
        self.graphs: dict[int, RoundGraph] = {}  # buffer arrangement -> the round's graph
        self.launched = 0  # launches so far; launch k uses slot k % 2
        self.read_upto = 0  # launches whose selection has been read: [0, read_upto)

    def launch(self, variant: int, start: int, anchor: int | None) -> int:
        """Queue one round at `start`: anchor `anchor`, or (None) the selection of the previous
        launch, already on the device. Returns the launch's index for `read`."""
        k = self.launched
        if k - self.read_upto >= 2:
            raise RuntimeError("PlainChain: launch with two rounds unread (their pinned slots are in use)")
        if anchor is None and k == 0:
            raise RuntimeError("PlainChain: the first launch needs its anchor")
        slot, graph = k % 2, self.graphs[variant]
        self._in_np[slot] = (start, 0 if anchor is None else anchor)
        src = self._in_host[slot] if anchor is not None else self._in_host[slot, :1]
        self.inputs[: src.shape[0]].copy_(src, non_blocking=True)
        graph.graph.replay()
        self._out_host[slot].copy_(graph.out.reshape(-1)[:1], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self.launched = k + 1
        return k

    def read(self, k: int) -> int:
        """The selection of launch `k` (waits for it; launches are read in order)."""
        if k != self.read_upto or k >= self.launched:
            raise RuntimeError(f"PlainChain: read of launch {k}, expected {self.read_upto} of {self.launched}")
        event = self._events[k % 2]
        if event is not None:
            event.synchronize()
        self.read_upto = k + 1
        return int(self._out_np[k % 2, 0])

    def drain(self) -> None:
        """Read whatever is still queued (a session that stops with a round ahead)."""
        while self.read_upto < self.launched:
            self.read(self.read_upto)
