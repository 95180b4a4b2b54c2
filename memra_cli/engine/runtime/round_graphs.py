"""A whole greedy round (or a whole plain decode step) as one CUDA graph.

With the target's step and the drafter's two parts graphed separately (graphs.py,
draft_graphs.py), a round on a small model is still host-bound: between the three replays the
host runs some twenty eager ops (input copies, the candidate concatenation, position ranges,
the argmax, copies out, the packing of the one host read), each a few microseconds of Python
and a launch, and the GPU waits for them after every read (docs/tuning.md#round-graphs).

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


def _stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RoundGraph:
    """`body(inputs [n] long) -> packed [k]` captured once; `run(values)` -> the packed list."""

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], capture_inputs: Sequence[int],
                 device: torch.device, keep: Sequence[object] = (), inputs: torch.Tensor | None = None):
        """`capture_inputs`: the values the warm-up and capture run with (positions where
        nothing real lives: the first round's rows, or a storage's slack). `keep`: objects the
        graph writes into that must live as long as it does (another storage). `inputs`: a long vector to read the
        inputs from instead of the graph's own (graphs that share them: `RoundChain`). Each warm-up
        run of the capture starts from `capture_inputs`."""
        self.keep = tuple(keep)
        # The replay reads every tensor the body closes over (its constant rows, the block's
        # mask ids) at the addresses of the capture, but a CUDA graph holds no Python reference
        # to them: keep the body, or they are freed and their memory reused under the graph.
        self.body = body
        values = torch.tensor(list(capture_inputs), dtype=torch.long).to(device)
        self.inputs = values.clone() if inputs is None else inputs
        pin = device.type == "cuda"
        self._host = torch.zeros(len(capture_inputs), dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()  # writes through numpy: no torch op per value
        capturing = [True]

        def run():
            # A chained body writes its inputs (the next round's): each warm-up run of the
            # capture starts again from the capture values, or the second would run at the
            # positions the first wrote (past the capture's). Not recorded in the graph (a capture
            # executes nothing), and not done by the replays of the tests' eager stand-in.
            if capturing[0] and not _stream_capturing():
                self.inputs.copy_(values)
            return body(self.inputs)

        self.graph, self.out = cuda_graphs.capture(run, device)
        capturing[0] = False

    def run(self, values: Sequence[int]) -> list:
        """Set the inputs (one copy from pinned memory, no sync), replay, and read the packed
        output (one device-to-host copy; the round's one sync). The pinned buffer is rewritten
        only after the previous read, so the copy that read it has finished."""
        self._host_np[:] = values
        self.inputs.copy_(self._host, non_blocking=True)
        self.graph.replay()
        return self.out.tolist()


class RoundChain:
    """Rounds queued one ahead of the host's read: the device side of `Session`'s pipelined rounds.

    A graphed round costs its replay plus the host's part between two replays: reading the
    round's output (a sync), Python bookkeeping, the next input copy and the launch. The GPU
    idles through all of it (docs/tuning.md#round-graphs). Here each round's graph also writes the
    next round's inputs (a chained body: round_bodies.py), so the host can queue round j+1
    before it reads round j: the host's part then overlaps the GPU's.

    `inputs [n] long` is shared by the round graphs of every buffer arrangement of the state
    (`graphs[variant]`). A launch copies a seed from a pinned slot into the first entries of
    `inputs` (the host-known ones: a plain round's start; everything for the first round of a
    run; nothing when the device has them all), replays, and queues the copy of the output
    (`[k]`) into another pinned slot and an event. Slots alternate, so a launch may be queued
    while the previous launch is unread, but not two (`launch` refuses): the slot it rewrites
    was read by then, and so was the seed copy that read it.
    """

    def __init__(self, device: torch.device, n_inputs: int):
        self.device, self.n_inputs = device, n_inputs
        self.inputs = torch.zeros(n_inputs, dtype=torch.long, device=device)
        self._pin = device.type == "cuda"
        self._in_host = torch.zeros((2, n_inputs), dtype=torch.long, pin_memory=self._pin)
        self._in_np = self._in_host.numpy()
        self._out_host: torch.Tensor | None = None  # [2, k] float64 or long, made at the first launch
        self._out_np = None
        self._events: list = [None, None]
        self.graphs: dict[int, RoundGraph] = {}  # buffer arrangement -> the round's graph
        self.launched = 0  # launches so far; launch k uses slot k % 2
        self.read_upto = 0  # launches whose output has been read: [0, read_upto)

    def launch(self, variant: int, seed: Sequence[int] = ()) -> int:
        """Queue one round: `inputs[:len(seed)] = seed`, the rest as the previous round left
        them on the device. Returns the launch's index for `read`."""
        k = self.launched
        if k - self.read_upto >= 2:
            raise RuntimeError("RoundChain: launch with two rounds unread (their pinned slots are in use)")
        if k == 0 and len(seed) != self.n_inputs:
            raise RuntimeError("RoundChain: the first launch needs every input")
        slot, graph = k % 2, self.graphs[variant]
        if seed:
            self._in_np[slot, : len(seed)] = seed
            self.inputs[: len(seed)].copy_(self._in_host[slot, : len(seed)], non_blocking=True)
        graph.graph.replay()
        out = graph.out.reshape(-1)
        if self._out_host is None:
            self._out_host = torch.zeros((2, out.shape[0]), dtype=out.dtype, pin_memory=self._pin)
            self._out_np = self._out_host.numpy()
        self._out_host[slot].copy_(out, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self.launched = k + 1
        return k

    def read(self, k: int):
        """The output of launch `k` as a numpy row (waits for it; launches are read in order).
        The row is the pinned slot itself: use it before launch k + 2 reuses the slot."""
        if k != self.read_upto or k >= self.launched:
            raise RuntimeError(f"RoundChain: read of launch {k}, expected {self.read_upto} of {self.launched}")
        event = self._events[k % 2]
        if event is not None:
            event.synchronize()
        self.read_upto = k + 1
        return self._out_np[k % 2]

    def drain(self) -> None:
        """Read whatever is still queued (a session that stops with a round ahead)."""
        while self.read_upto < self.launched:
            self.read(self.read_upto)
