"""Graphed rounds settled on the device: the driver of `Session`'s rounds when they run as CUDA
graphs (runtime/round_graphs.py `RoundChain`; bodies in spec/round_bodies.py).

Each round is one replay whose graph also writes the next round's inputs (its anchor, and for a
speculative round the start, the window and the budget it settled), so a round needs no host
value to start but what the host already knows. The host reads each round's packed output once
and commits what the device decided.

`lookahead`: queue round k+1 before reading round k (the default), so the host's part of a
round (the read, the commit, the caller's work on the tokens) overlaps the GPU's; or read each
round before queueing the next (MEMRA_PIPELINE=0, for A/B). Both run the same graphs in the same
order: the same tokens; only where the host waits moves (docs/tuning.md#round-graphs).

A round queued ahead never reaches past what the stream may still use:

- plain: round j commits its anchor a_j (a host value) and selects a_{j+1}; round j+1 is
  queued once a_j is committed and has not ended the stream, so no round runs past the end.
- speculative: round k+1 is queued ahead only while round k cannot exhaust the budget (more
  than W tokens left) and its W rows fit the storage. An EOS may still end the stream at round
  k; round k+1 then ran for nothing, its rows past the committed length (a KV cache forgets them
  by its length; the hybrid's round wrote only the buffer that is not the committed one).

Between bursts one round may stay queued (`ahead`), its anchor committed (plain) or unread
(speculative); `drain()` reads it when the session ends.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from memra_cli.engine.runtime.round_graphs import RoundChain, RoundGraph
from memra_cli.engine.spec import round_bodies


class ChainedRounds:
    """The device-settled round driver of one `spec.session.Session` (module docstring): it
    reads the session's state and commits through its `_commit` / `_count_round`."""

    def __init__(self, session, lookahead: bool):
        self.s = session
        self.lookahead = lookahead
        self.chain: RoundChain | None = None  # the state's RoundChain while this session uses it
        self.ahead: int | None = None  # the chain launch in flight, if any
        # the buffer arrangement the next speculative launch runs over: a state restored on the
        # device (the hybrid's, `settles_on_device`) flips it every round, whatever the round kept
        self.next_variant = 0
        self.device_settle = session.cache.settles_on_device

    def advance(self, n: int) -> list[int]:
        """Rounds until at least `n` new tokens are committed or the stream ends."""
        return self._plain(n) if self.s.proposer is None else self._speculative(n)

    def drain(self) -> None:
        """Read a round still queued (before the storage it writes goes back)."""
        if self.chain is not None:
            self.chain.drain()
        self.ahead = None

    # ------------------------------------------------------------------ plain rounds

    def _plain_chain(self) -> RoundChain:
        """The state's plain RoundChain (kept in `cache.graphs`, like every graph over the
        storage), with a round graph captured for each buffer arrangement of the state. Captured
        here, before any launch: a capture's warm-up writes the shared inputs."""
        s = self.s
        cache, width, model = s.cache, s.runner.width, s.target
        key = ("plain-chain", width)
        chain = cache.graphs.get(key)
        if chain is None:
            chain = cache.graphs[key] = RoundChain(model.device, 2)
        chain.drain()  # a session that ended with a round queued over this storage
        n = cache.graph_variants
        # the capture writes the rows of the first round's step, which that round rewrites
        # (runtime/graphs.py: a ring storage has no slack that no live position shares)
        at = cache.length
        cache.set_live_rows(1)  # a plain round's one real row: the rest of its step is padding
        for variant in range(n):
            if variant not in chain.graphs:
                with cache.arranged_for_capture(variant) if n > 1 else nullcontext():
                    chain.graphs[variant] = RoundGraph(round_bodies.plain_step_chained(model, cache, width),
                                                       (at, 0), model.device, inputs=chain.inputs)
        return chain

    def _launch_plain(self, anchor: int | None) -> None:
        """Queue one plain round at the committed length and commit its row on the host: a plain
        round keeps its one row, so the commit needs no device value (a KV length, or the
        hybrid's buffer flip). `anchor` None: the previous round's selection, on the device."""
        s = self.s
        cache = s.cache
        start = cache.length
        s.target.check_span(start, s.runner.width, cache)
        seed = (start,) if anchor is None else (start, anchor)
        cache.set_live_rows(1)  # before the launch: the replay reads it (a no-op while it holds)
        self.ahead = self.chain.launch(cache.graph_variant, seed)
        cache.commit(start + 1)

    def _plain(self, n: int) -> list[int]:
        s, out = self.s, []
        if self.ahead is None:  # nothing queued: the first round's anchor is a host value
            s._anchor_to_host()
            self.chain = self._plain_chain()
            self._launch_plain(s.last_id)
            out += s._commit([s.last_id], 0)
            s._count_round(1, 0)
        while True:  # a round queued, its anchor committed
            k = self.ahead
            assert k is not None
            if s.finished:
                s.last_id, self.ahead = int(self.chain.read(k)[0]), None
                return out
            if len(out) >= n:
                return out  # it stays queued for the next burst
            if self.lookahead:
                self._launch_plain(None)  # round k+1 on round k's selection, already on the device
                anchor = int(self.chain.read(k)[0])
            else:
                anchor = int(self.chain.read(k)[0])
                self._launch_plain(anchor)
            out += s._commit([anchor], 0)
            s._count_round(1, 0)

    # ------------------------------------------------------------ speculative rounds

    def _spec_chain(self) -> RoundChain:
        """The speculative RoundChain of this session's program, draft cache, taps and width,
        kept in `cache.graphs`, with a round graph per buffer arrangement of the state (a KV
        cache has one; the hybrid's two alternate round after round, its graphs restoring the
        recurrent state themselves). Captured here, before any launch."""
        s = self.s
        cache, width, model = s.cache, s.runner.width, s.target
        p, kv = s.program, s.proposer.kv
        raws = p.window.is_confidence
        runs = round_bodies.settle_kind(p.window) == "priced-runs"  # its inputs carry the runs
        model.check_taps(s.taps)
        key = ("spec-chain", id(kv), p, raws, s.taps, width)
        chain = cache.graphs.get(key)
        if chain is None:
            chain = cache.graphs[key] = RoundChain(model.device, 7 if runs else 5)
            # a priced window's step cost: this session's is written in before its first launch
            chain.cost_table = (torch.zeros(p.verify_cap, dtype=torch.float64, device=model.device)
                                if p.window.kind == "priced" else None)
        chain.drain()
        n = cache.graph_variants
        # the target's rows at the first round's step (rewritten by it: runtime/graphs.py), the
        # draft cache's in its block slack
        at, d_slack = cache.length, kv.rows - max(width, p.block_size)
        cache.set_live_rows(None)  # a verify's rows are all candidates
        for variant in range(n):
            if variant not in chain.graphs:
                with cache.arranged_for_capture(variant) if n > 1 else nullcontext():
                    body = round_bodies.speculative_round_chained(s.proposer.drafter, model, p, kv, cache,
                                                                  s.taps, width, raws, chain.cost_table)
                    chain.graphs[variant] = RoundGraph(body, (at, d_slack, 0, p.verify_cap, width) + (0, 0) * runs,
                                                       model.device, keep=(kv,), inputs=chain.inputs)
        return chain

    def _write_cost_table(self) -> None:
        """A priced window's bytes of 1..cap rows for this session (its routed cost, or the
        arm's), into the table its round graphs read."""
        s, table = self.s, self.chain.cost_table
        if table is not None:
            cost = s.cost or s.program.window.cost
            table.copy_(torch.tensor([cost.bytes(v) for v in range(1, table.shape[0] + 1)], dtype=torch.float64))

    def _launch_spec(self, seed=()) -> int:
        """Queue one speculative round over the arrangement the previous one left."""
        self.s.cache.set_live_rows(None)
        k = self.chain.launch(self.next_variant, seed)
        if self.device_settle:
            self.next_variant ^= 1
        return k

    def _settle_spec(self, row) -> list[int]:
        """Commit a round from its output row `[cand (W), sel (W), raws?, vt, m]`: the window and
        the accepted count the device used."""
        s = self.s
        width, cache = s.runner.width, s.cache
        start = cache.length
        assert s.proposer.kv.length == start, (s.proposer.kv.length, start)  # row index == position in both
        vt, m = int(row[-2]), int(row[-1])
        committed = s._commit([int(x) for x in row[:width]], m)
        if self.device_settle:  # the round's graph restored the state: only the host's side is left
            cache.settled_on_device(start + m + 1)
        else:
            cache.commit(start + m + 1)
        if not s.finished:  # (the stream's end ingests nothing, as the eager round)
            s.proposer.kv.length = start + m + 1
        s.last_id = int(row[width + m])
        s._count_round(vt, m)
        return committed

    def _speculative(self, n: int) -> list[int]:
        s, out = self.s, []
        width, cache = s.runner.width, s.cache
        if self.ahead is None:
            s._anchor_to_host()
            self.chain = self._spec_chain()
            start = cache.length
            s.target.check_span(start, width, cache)
            self.next_variant = cache.graph_variant
            self._write_cost_table()
            runs = s.runs if self.chain.n_inputs == 7 else ()
            self.ahead = self._launch_spec((start, start, s.last_id, s.vt, s.max_new - len(s.tokens)) + tuple(runs))
        while len(out) < n:
            k = self.ahead
            assert k is not None
            # round k+1 starts at most W positions after round k: inside the budget, and its
            # W rows inside the storage
            ahead = (self.lookahead and s.max_new - len(s.tokens) > width
                     and cache.length + 2 * width <= cache.max_len)
            if ahead:
                nxt = self._launch_spec()
            out += self._settle_spec(self.chain.read(k))
            if s.finished:
                self.drain()
                return out
            if not ahead:
                s.target.check_span(cache.length, width, cache)
                nxt = self._launch_spec()  # its inputs as round k left them on the device
            self.ahead = nxt
        return out  # the newest round stays queued for the next burst
