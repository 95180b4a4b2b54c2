"""The speculative round loop, and the resumable `Session` around it.

One round:

    block = [last, MASK x (b-1)] at positions start..start+b-1
    proposer.propose(...)   -> drafts [nd] (+ confidence raws [nd] under a confidence policy)
    vt from the window policy (ladder carried, or sized from the raws), capped, within budget
    runner.step([last, drafts[:vt-1]]) with taps -> logits [vt, V], taps [vt, n_taps*hidden]
    sel = sampler.select(logits)   (greedy: argmax; sampled: position-keyed; rejection sampling: verify)
    m = accepted prefix; commit last + drafts[:m]; next = sel[m]
    rollback: state.rollback(start + m + 1)
    proposer.ingest(taps[:m+1]) at positions start..start+m; last = next

Exactness is structural: the target's own selection decides every committed token. Tensors stay
on the device and a round reads the host once: drafts and selections together, and under a
confidence window the raws with them. With fixed-width steps the window is sized after the
verify: the step verifies every draft the window could admit (the same W-row step it would run
for fewer), and the window then decides how many of them count. A row's logits do not depend on
the rows after it (causality, row-invariant kernels), so the accepted prefix, the commit and the
stream are exactly those of sizing it first, without stopping the device mid-round to read the
raws. (Rejection sampling judges rows in sequence, so it sizes the window first.) A session
returns its pooled storages exactly once: when the stream ends, on `close()`, or when a round
raises.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Sequence

import torch

from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import ladder_next
from memra_cli.engine.spec.proposer import DrafterProposer, Program, Proposal, Proposer
from memra_cli.engine.spec.sampling import GREEDY, Sampler, accept_prefix
from memra_cli.engine.stats import DecodeStats, PhaseClock


class Session:
    """A resumable decode: `prime()` once, then `burst(n)` until `finished` (or `run()`).

    With `proposer=None` it is plain decoding through the same runner path (one row per round).
    Use it as a context manager (or call `close()`) when a caller may stop before the end.
    """

    def __init__(self, runner: StepRunner, prompt_ids: Sequence[int], max_new: int, *,
                 proposer: Proposer | None = None, program: Program | None = None, taps: Sequence[int] = (),
                 eos_ids: Sequence[int] = (), sampler: Sampler = GREEDY, timed: bool = False,
                 round_graphs: bool = False, pipelined: bool = True):
        runner.check_prompt(list(prompt_ids), max_new)
        self.runner, self.target = runner, runner.model
        self.proposer, self.program, self.sampler = proposer, program, sampler
        self.prompt, self.max_new, self.eos = list(prompt_ids), max_new, set(eos_ids)
        self.taps = tuple(taps) if proposer is not None else ()
        block = program.block_size if program else 1
        self.capacity = len(self.prompt) + max_new + block + 1
        self.cache = runner.new_state(min(self.capacity, self.target.cfg.max_position_embeddings))
        self.stats = DecodeStats()
        self.clock = PhaseClock(self.stats, self.target.device, timed)
        self.tokens: list[int] = []
        self.finished = max_new == 0
        self.vt = program.verify_cap if program else 1
        self.late_window = self._sizes_after_verify()  # fixed for the session: program, sampler, runner
        self.graphed_rounds = round_graphs and not timed and self._rounds_capturable()
        # graphed rounds queued one ahead of the host (`_pipelined_plain`, `_pipelined_spec`):
        # speculative ones over a state whose commit only moves a host length (a KV cache) or
        # whose rollback the round's graph does itself (the hybrid's, `settles_on_device`)
        self._device_settle = self.cache.settles_on_device
        self.pipelined = pipelined and self.graphed_rounds and (
            proposer is None or self.cache.host_bookkeeping or self._device_settle)
        self._next_variant = 0  # the buffer arrangement the next queued speculative round runs over
        self._chain = None  # the state's RoundChain while this session uses it
        self._ahead: int | None = None  # the chain launch in flight (its anchor committed), if any
        self.last: torch.Tensor | None = None
        self.last_id: int | None = None  # the anchor as a host int, between graphed rounds
        self._t0 = 0.0
        self._released = False  # storages handed back (once: end of stream, close() or an error)

    @property
    def position(self) -> int:
        """Committed length of the target context (prompt + generated tokens whose K/V are in)."""
        return self.cache.length

    def prime(self) -> None:
        """Prefill the prompt (taps armed for a proposer) and the drafter's context."""
        self._t0 = time.perf_counter()
        self.clock.start()
        try:
            n = len(self.prompt)
            ids = torch.tensor(self.prompt, dtype=torch.long, device=self.target.device)
            on_taps = None
            if self.proposer is not None:  # the drafter's context, chunk by chunk as the prefill makes it
                self.proposer.reset(self.capacity)
                on_taps = self._ingest_prompt_chunk
            logits, _ = self.runner.prefill(ids, self.cache, self.taps or None, on_taps=on_taps)
            self.last = self.sampler.select(logits, torch.tensor([n - 1], device=self.target.device))
        except BaseException:
            self.close()
            raise
        self.clock.lap("prefill")

    def _ingest_prompt_chunk(self, taps: torch.Tensor, start: int) -> None:
        """One prefill chunk's taps `[c, n_taps*hidden]` (positions start..start+c-1) into the
        drafter's context."""
        self.proposer.ingest(taps, torch.arange(start, start + taps.shape[0], device=self.target.device))

    def burst(self, n: int) -> list[int]:
        """Run rounds until at least `n` new tokens are committed or the stream ends."""
        if self.last is None and self.last_id is None:
            self.prime()
        out: list[int] = []
        try:
            if self.pipelined and not self.finished:
                out += self._pipelined_plain(n) if self.proposer is None else self._pipelined_spec(n)
            while len(out) < n and not self.finished:
                out += self._graphed_round() if self.graphed_rounds else self._round()
        except BaseException:  # an error or an interrupt mid-stream: the storages still go back
            self.close()
            raise
        if self.finished:
            self.close()
        self.stats.wall_s = time.perf_counter() - self._t0
        self.stats.tokens = len(self.tokens)
        return out

    def run(self) -> list[int]:
        while not self.finished:
            self.burst(1 << 30)
        return self.tokens

    def close(self) -> None:
        """Hand the pooled storages (and their CUDA graphs) back, once; the session is over."""
        if self._released:
            return
        self._released = True
        self.finished = True
        if self._chain is not None:  # a round still queued: read it before the storage goes back
            self._chain.drain()
            self._ahead = None
        self.runner.release(self.cache)
        if self.proposer is not None:
            self.proposer.release()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- one round

    def _budget(self, vt: int) -> int:
        return max(1, min(vt, self.max_new - len(self.tokens)))  # never verify past the budget

    def _window(self, proposal: Proposal) -> int:
        """The window before verify: the ladder's carried size, or sized from the raws."""
        p = self.program
        assert p is not None
        vt = self.vt
        if p.window.is_confidence:
            assert proposal.raws is not None
            vt = p.window.size_window(proposal.raws.tolist(), p.verify_cap)  # a host read before verify
        return self._budget(vt)

    def _sizes_after_verify(self) -> bool:
        """A confidence window may be sized after the verify (see the module docstring): fixed
        steps that hold the widest window in one step, and a sampler that selects row by row."""
        p = self.program
        if p is None or not p.window.is_confidence or self.sampler.rejection:
            return False
        width = self.runner.width
        return width is not None and p.verify_cap <= width

    def _rounds_capturable(self) -> bool:
        """Whether this session's rounds can run as one graph each (module docstring)."""
        r = self.runner
        if not (r.cuda_graphs and r.width is not None and self.sampler.greedy):
            return False
        if self.program is not None and self.program.window.kind == "priced":  # the device settle has no cost model
            return False
        if not self.cache.round_graphs_ok:  # the state's commit needs no host read
            return False
        if self.proposer is None:
            return True
        return (isinstance(self.proposer, DrafterProposer) and self.proposer.graphs and self.program is not None
                and self.program.verify_cap <= r.width)

    def _anchor_to_host(self) -> None:
        """Graphed rounds carry the anchor as a host int (`last_id`): read the prefill's
        selection once per session."""
        if self.last_id is None:
            assert self.last is not None
            self.last_id = int(self.last.item())
        self.last = None

    def _graphed_round(self) -> list[int]:
        """`_round` as one replay (spec/round_bodies.py): same selections, commits and stats."""
        from memra_cli.engine.runtime.round_graphs import RoundGraph
        from memra_cli.engine.spec import round_bodies

        start, width, cache = self.cache.length, self.runner.width, self.cache
        model = self.target
        model.check_span(start, width, cache)
        self._anchor_to_host()
        slack = cache.max_len - width  # the storage's padding slack: the capture writes only there
        # A state whose steps run over one of several buffer arrangements (the hybrid's two
        # committed-state buffers) gets a round graph per arrangement, captured in it.
        variant = cache.graph_variant
        arranged = cache.arranged_for_capture(variant)
        tail = (variant,) if cache.graph_variants > 1 else ()  # a KV cache has one arrangement
        if self.proposer is None:
            key = ("plain-round", width, *tail)
            graph = cache.graphs.get(key)
            if graph is None:
                with arranged:
                    graph = cache.graphs[key] = RoundGraph(round_bodies.plain_step(model, cache, width),
                                                           (slack, 0), model.device)
            out = graph.run((start, self.last_id))
            cand_h, vam_h, vt, m = [self.last_id], [int(out[0])], 1, 0
        else:
            p, kv = self.program, self.proposer.kv
            assert kv.length == start, (kv.length, start)  # row index == position in both caches
            raws = p.window.is_confidence
            model.check_taps(self.taps)
            key = ("round", id(kv), p, raws, self.taps, width, *tail)
            graph = cache.graphs.get(key)
            if graph is None:
                body = round_bodies.speculative_round(self.proposer.drafter, model, p, kv, cache, self.taps, width, raws)
                d_slack = kv.rows - max(width, p.block_size)
                with arranged:
                    graph = cache.graphs[key] = RoundGraph(body, (slack, d_slack, 0), model.device, keep=(kv,))
            out = graph.run((start, start, self.last_id))
            cand_h, vam_h = [int(x) for x in out[:width]], [int(x) for x in out[width : 2 * width]]
            vt = self._budget(p.window.size_window(out[2 * width:], p.verify_cap) if raws else self.vt)
            m = accept_prefix(cand_h, vam_h, vt) if vt > 1 else 0
        committed = self._commit(cand_h, m)
        cache.commit(start + m + 1)
        if self.proposer is not None and not self.finished:  # (the stream's end ingests nothing, as `_round`)
            self.proposer.kv.length = start + m + 1
        self.last_id = vam_h[m]
        self._count_round(vt, m)
        return committed

    def _plain_chain(self):
        """The state's plain RoundChain (kept in `cache.graphs`, like every graph over the
        storage), with a round graph captured for each buffer arrangement of the state. Captured
        here, before any launch: a capture's warm-up writes the shared inputs."""
        from memra_cli.engine.runtime.round_graphs import RoundChain, RoundGraph
        from memra_cli.engine.spec import round_bodies

        cache, width, model = self.cache, self.runner.width, self.target
        key = ("plain-chain", width)
        chain = cache.graphs.get(key)
        if chain is None:
            chain = cache.graphs[key] = RoundChain(model.device, 2)
        chain.drain()  # a session that ended with a round queued over this storage
        n = cache.graph_variants
        slack = cache.max_len - width  # the storage's padding slack: the capture writes only there
        for variant in range(n):
            if variant not in chain.graphs:
                with cache.arranged_for_capture(variant) if n > 1 else nullcontext():
                    chain.graphs[variant] = RoundGraph(round_bodies.plain_step_chained(model, cache, width),
                                                       (slack, 0), model.device, inputs=chain.inputs)
        return chain

    def _launch_plain(self, anchor: int | None) -> None:
        """Queue one plain round at the committed length and commit its row on the host: a plain
        round keeps its one row, so the commit needs no device value (a KV length, or the
        hybrid's buffer flip)."""
        cache, chain = self.cache, self._chain
        start = cache.length
        self.target.check_span(start, self.runner.width, cache)
        seed = (start,) if anchor is None else (start, anchor)
        self._ahead = chain.launch(cache.graph_variant, seed)
        cache.commit(start + 1)

    def _pipelined_plain(self, n: int) -> list[int]:
        """Plain rounds with the next one queued before this one's token is read, until `n` new
        tokens are committed or the stream ends. The same graphs' work as `_graphed_round`, in
        the same order: only the host's reads move.

        Round j commits its anchor a_j and selects a_{j+1}; round j+1 may run once a_j is known
        not to end the stream (EOS, budget). So round j+1 is queued right after a_j is read
        (round j-1's selection), while round j runs, and never past the stream's end: nothing to
        undo. Between bursts one round may stay queued, its anchor committed (`_ahead`): the
        caller's work on the tokens (printing them) overlaps it too."""
        out: list[int] = []
        if self._ahead is None:  # nothing queued: the first round's anchor is a host value
            self._anchor_to_host()
            self._chain = self._plain_chain()
            self._launch_plain(self.last_id)
            out += self._commit([self.last_id], 0)
            self._count_round(1, 0)
        while True:  # a round queued, its anchor committed
            k = self._ahead
            assert k is not None
            if self.finished:
                self.last_id, self._ahead = int(self._chain.read(k)[0]), None
                return out
            if len(out) >= n:
                return out  # it stays queued for the next burst
            self._launch_plain(None)  # round k+1 on round k's selection, already on the device
            anchor = int(self._chain.read(k)[0])
            out += self._commit([anchor], 0)
            self._count_round(1, 0)

    def _spec_chain(self):
        """The speculative RoundChain of this session's program, draft cache, taps and width,
        kept in `cache.graphs`, with a round graph per buffer arrangement of the state (a KV
        cache has one; the hybrid's two alternate round after round, its graphs restoring the
        recurrent state themselves). Captured here, before any launch."""
        from memra_cli.engine.runtime.round_graphs import RoundChain, RoundGraph
        from memra_cli.engine.spec import round_bodies

        cache, width, model = self.cache, self.runner.width, self.target
        p, kv = self.program, self.proposer.kv
        raws = p.window.is_confidence
        model.check_taps(self.taps)
        key = ("spec-chain", id(kv), p, raws, self.taps, width)
        chain = cache.graphs.get(key)
        if chain is None:
            chain = cache.graphs[key] = RoundChain(model.device, 5)
        chain.drain()
        n = cache.graph_variants
        slack, d_slack = cache.max_len - width, kv.rows - max(width, p.block_size)
        for variant in range(n):
            if variant not in chain.graphs:
                with cache.arranged_for_capture(variant) if n > 1 else nullcontext():
                    body = round_bodies.speculative_round_chained(self.proposer.drafter, model, p, kv, cache,
                                                                  self.taps, width, raws)
                    chain.graphs[variant] = RoundGraph(body, (slack, d_slack, 0, p.verify_cap, width), model.device,
                                                       keep=(kv,), inputs=chain.inputs)
        return chain

    def _launch_spec(self, seed=()) -> int:
        """Queue one chained speculative round over the arrangement the previous one left
        (each round of a state restored on the device flips it, whatever it kept)."""
        k = self._chain.launch(self._next_variant, seed)
        if self._device_settle:
            self._next_variant ^= 1
        return k

    def _settle_spec(self, row) -> list[int]:
        """Commit a chained round from its output row `[cand, sel, raws?, vt, m]` (the window and
        the accepted count the device used), as `_graphed_round` does after its read."""
        width, cache = self.runner.width, self.cache
        start = cache.length
        assert self.proposer.kv.length == start, (self.proposer.kv.length, start)
        vt, m = int(row[-2]), int(row[-1])
        cand_h = [int(x) for x in row[:width]]
        committed = self._commit(cand_h, m)
        if self._device_settle:  # the round's graph restored the state: only the host's side is left
            cache.settled_on_device(start + m + 1)
        else:
            cache.commit(start + m + 1)
        if not self.finished:
            self.proposer.kv.length = start + m + 1
        self.last_id = int(row[width + m])
        self._count_round(vt, m)
        return committed

    def _pipelined_spec(self, n: int) -> list[int]:
        """Speculative rounds with the next one queued before this one is read, until `n` new
        tokens are committed or the stream ends (a KV cache, `host_bookkeeping`: the commit needs no
        device work; or a state the round's graph restores itself, `settles_on_device`). Each
        round's graph settles the round on the device (window, accepted count, next inputs, and
        the hybrid's recurrent state: round_bodies.speculative_round_chained) and the host
        commits what the device decided, one round behind: the same rounds as `_graphed_round`.

        Round j+1 is queued before round j is read only while round j cannot exhaust the budget
        (more than W tokens left) and round j+1's rows fit the storage: a round past the end
        would write past the storage's reach. An EOS can still end the stream at round j; round
        j+1 then ran for nothing, its rows past the committed length (a KV cache forgets them by
        its length; the hybrid's wrote only the buffer that is not the committed one). Between
        bursts one round may stay queued (`_ahead`), not yet read."""
        out: list[int] = []
        width, cache = self.runner.width, self.cache
        if self._ahead is None:
            self._anchor_to_host()
            self._chain = self._spec_chain()
            start = cache.length
            self.target.check_span(start, width, cache)
            self._next_variant = cache.graph_variant
            self._ahead = self._launch_spec((start, start, self.last_id, self.vt, self.max_new - len(self.tokens)))
        while len(out) < n:
            k = self._ahead
            assert k is not None
            # round k+1 starts at most W positions after round k: inside the budget, and its
            # W rows inside the storage
            ahead = self.max_new - len(self.tokens) > width and cache.length + 2 * width <= cache.max_len
            if ahead:
                nxt = self._launch_spec()
            out += self._settle_spec(self._chain.read(k))
            if self.finished:
                self._chain.drain()
                self._ahead = None
                return out
            if not ahead:
                self.target.check_span(cache.length, width, cache)
                nxt = self._launch_spec()  # its inputs as round k left them on the device
            self._ahead = nxt
        return out  # the newest round stays queued for the next burst

    def _round(self) -> list[int]:
        start, last = self.cache.length, self.last
        assert last is not None
        self.clock.start()
        late = False  # the confidence window sized after the verify
        if self.proposer is None:
            cand, rows, drafts = last, 1, None
        else:
            want = self.program.window.is_confidence  # type: ignore[union-attr]
            proposal = self.proposer.propose(last, start, want)
            drafts = proposal.drafts
            late = self.late_window
            rows = self._budget(self.program.verify_cap) if late else self._window(proposal)  # type: ignore[union-attr]
            cand = torch.cat([last.reshape(1), drafts[: rows - 1]])
        self.clock.lap("draft")
        logits, taps = self.runner.step(cand, start, self.cache, self.taps or None)
        positions = torch.arange(start, start + rows, device=cand.device)
        if drafts is not None and self.sampler.rejection:  # spec/keyed.py RejectionSampling
            selected = self.sampler.verify(logits, cand, proposal.probs, positions)
        else:
            selected = self.sampler.select(logits, positions)
        if late:  # the round's one host read: candidates, selections and raws in one transfer
            host = torch.cat([cand.double(), selected.double(), proposal.raws.double()]).tolist()  # ids < 2^53: exact
            cand_h, selected_h = [int(x) for x in host[:rows]], [int(x) for x in host[rows : 2 * rows]]
            rows = self._budget(self.program.window.size_window(host[2 * rows:], self.program.verify_cap))  # type: ignore[union-attr]
        else:
            host = torch.cat([cand, selected]).tolist()  # the round's one (ladder) host read
            cand_h, selected_h = host[:rows], host[rows:]
        self.clock.lap("verify")
        m = accept_prefix(cand_h, selected_h, rows) if rows > 1 else 0
        committed = self._commit(cand_h, m)
        self.cache.rollback(start + m + 1)
        self.clock.lap("rollback")
        if self.proposer is not None and not self.finished:
            self.proposer.ingest(taps[: m + 1], torch.arange(start, start + m + 1, device=self.target.device))
        self.clock.lap("ingest")
        self.last = selected[m : m + 1]
        self._count_round(rows, m)
        return committed

    def _count_round(self, vt: int, m: int) -> None:
        """A round's stats (vt rows verified, m drafts accepted) and the ladder's next window."""
        self.stats.rounds += 1
        self.stats.drafted += vt - 1
        self.stats.accepted += m
        self.stats.accept_hist[m] += 1
        if self.program is not None:
            self.vt = ladder_next(m, self.program.verify_cap) if self.program.adapt else self.program.verify_cap

    def _commit(self, cand: list[int], m: int) -> list[int]:
        """Push anchor + accepted drafts; the budget check comes before each push, EOS ends."""
        out: list[int] = []
        for tok in cand[: m + 1]:
            if len(self.tokens) >= self.max_new:
                self.finished = True
                break
            self.tokens.append(tok)
            out.append(tok)
            if tok in self.eos:
                self.finished = True
                break
        if len(self.tokens) >= self.max_new:
            self.finished = True
        return out
