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

import dataclasses
import time
from contextlib import nullcontext
from typing import Sequence

import torch

from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.chained import ChainedRounds
from memra_cli.engine.spec.priced import routed_unions
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
        # the priced window's step cost for this prompt when it is measured (`cost_model`
        # routed, set by `prime`); None: the arm's
        self.cost = None
        self.runs = (0, 0)  # (drafts accepted, rounds that rejected one): the fitted survival's evidence
        self.vt = self._carried_window(program.verify_cap - 2) if program else 1
        self.late_window = self._sizes_after_verify()  # fixed for the session: program, sampler, runner
        self.graphed_rounds = round_graphs and not timed and self._rounds_capturable()
        # graphed rounds settle on the device (spec/chained.py), queued one ahead of the host's
        # read unless `pipelined` is off; otherwise `_round` runs them (its parts graphed or not)
        self.pipelined = pipelined and self.graphed_rounds
        self.chained = ChainedRounds(self, self.pipelined) if self.graphed_rounds else None
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
            routed = self.program is not None and self.program.window.cost_model == "routed"
            with self.target.recording_routing() if routed else nullcontext() as routing:
                # recorded routing needs the eager forwards (a graph replay runs nothing on the host)
                logits, _ = self.runner.prefill(ids, self.cache, self.taps or None, on_taps=on_taps,
                                                **({"eager": True} if routed else {}))
            if routed:
                self._price_by_routing(routing)
            self.last = self.sampler.select(logits, torch.tensor([n - 1], device=self.target.device))
        except BaseException:
            self.close()
            raise
        self.clock.lap("prefill")

    def _price_by_routing(self, routing: dict) -> None:
        """The routed cost model: this prompt's measured expert union of `vt` consecutive tokens
        (spec/priced.py `routed_unions`) prices its windows; a prompt shorter than the cap has no
        window that wide to measure, so the shape model prices it, and `stats.window_cost` says which and why."""
        p = self.program
        base, cap, n = p.window.cost, p.verify_cap, len(self.prompt)
        if n < cap:
            cost, why = base, f"routed -> shape (a {n}-token prompt has no {cap}-token window to measure)"
        else:
            layers = [torch.cat(calls) for calls in routing.values()]
            cost = dataclasses.replace(base, unions=routed_unions(layers, cap))
            why = f"routed (the prefill's routing of {n} tokens over {len(layers)} sparse layers)"
        self.cost = cost
        self.vt = self._carried_window(cap - 2)
        self.stats.window_cost = {"model": cost.model, "why": why,
                                  "experts_per_layer": [round(cost.expected_union(v), 4) for v in range(1, cap + 1)],
                                  "gb": [round(cost.bytes(v) / 1e9, 6) for v in range(1, cap + 1)]}

    def _carried_window(self, accepted: int) -> int:
        """The window carried into the next round (the ladder's, or the priced window on the
        survival fitted to `runs`): `accepted = cap - 2` for the first, where the ladder opens at the cap."""
        p = self.program
        return p.window.next_window(accepted, p.verify_cap, self.cost, self.runs) if p.adapt else p.verify_cap

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
            if self.chained is not None:
                out += self.chained.advance(n) if not self.finished else []
            else:
                while len(out) < n and not self.finished:
                    out += self._round()
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
        if self.chained is not None:  # a round still queued: read it before the storage goes back
            self.chained.drain()
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
            vt = p.window.size_window(proposal.raws.tolist(), p.verify_cap, self.cost)  # a host read before verify
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
        if not self.cache.round_graphs_ok:  # the state's commit needs no host read
            return False
        if self.proposer is None:
            return True
        c = self.cache  # the commit of a speculative round the device settled: a length, or done there
        if not (c.host_bookkeeping or c.settles_on_device):
            return False
        return (isinstance(self.proposer, DrafterProposer) and self.proposer.graphs and self.program is not None
                and self.program.verify_cap <= r.width)

    def _anchor_to_host(self) -> None:
        """Graphed rounds carry the anchor as a host int (`last_id`): read the prefill's
        selection once per session."""
        if self.last_id is None:
            assert self.last is not None
            self.last_id = int(self.last.item())
        self.last = None

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
            rows = self._budget(self.program.window.size_window(host[2 * rows:], self.program.verify_cap,  # type: ignore[union-attr]
                                                                self.cost))
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
        """A round's stats (vt rows verified, m drafts accepted) and the carried next window."""
        self.stats.rounds += 1
        self.stats.drafted += vt - 1
        self.stats.accepted += m
        self.stats.accept_hist[m] += 1
        if self.program is not None:
            self.runs = (self.runs[0] + m, self.runs[1] + (m < vt - 1))
            self.vt = self._carried_window(m)

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
