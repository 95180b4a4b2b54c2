"""The speculative round loop for dense targets, and the resumable `Session` around it.

One round (DESIGN.md § Data flow):

    block = [last, MASK x (b-1)] at positions start..start+b-1
    proposer.propose(...)   -> drafts [nd] (+ confidence raws [nd] under a confidence policy)
    vt from the window policy (ladder carried, or sized from the raws), capped, within budget
    target.verify([last, drafts[:vt-1]]) with taps -> vam [vt], taps [vt, n_taps*hidden]
    m = accepted prefix; commit last + drafts[:m]; next = vam[m]
    rollback: truncate the target KV to start + m + 1
    proposer.ingest(taps[:m+1]) at positions start..start+m; last = next

Exactness is structural: the target's verify argmax decides every committed token. Tensors stay
on the device; a ladder round reads the host once (drafts and argmaxes together), a confidence
round twice (the raws size the window before verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from memra_cli.engine.models.drafter import Drafter
from memra_cli.engine.errors import MemraError
from memra_cli.engine.spec.policy import Harvest, VerifyWindow, accept_prefix, ladder_next
from memra_cli.engine.stats import DecodeStats, PhaseClock

PRIME_CHUNK = 256  # prompt taps are ingested in row windows to bound transient memory


class SpecError(MemraError):
    """A speculative request that cannot run as asked (e.g. a confidence policy without a head)."""


@dataclass(frozen=True)
class Program:
    """What a speculative session runs, fully resolved (receipts name it)."""

    harvest: Harvest
    window: VerifyWindow
    markov: bool
    verify_cap: int
    adapt: bool
    block_size: int

    @property
    def n_drafts(self) -> int:
        return self.harvest.n_drafts(self.block_size)


@dataclass
class Proposal:
    drafts: torch.Tensor  # [nd] long, on the device
    raws: torch.Tensor | None = None  # [nd] float32 pre-sigmoid confidence, when asked for


class Proposer(Protocol):
    """What the round needs from a drafter (the real one, or a test oracle)."""

    def reset(self, capacity: int) -> None: ...
    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None: ...
    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal: ...
    def release(self) -> None: ...  # the session is over (pooled caches go back)


class DrafterProposer:
    """The real proposer: drafter forward over its KV cache, harvest, target lm_head, markov."""

    def __init__(self, drafter: Drafter, target, program: Program):
        if program.window.is_confidence and not drafter.has_confidence:
            raise SpecError(
                f"verify-window {program.window} needs a checkpoint with an accept-rate head "
                f"(confidence_head.* absent in {drafter.census.path})"
            )
        self.drafter, self.target, self.program = drafter, target, program
        cfg = drafter.cfg
        self.block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=target.device)
        # the round's drafter side graphed too, when the target says so (draft_graphs.py)
        self.graphs = bool(getattr(target, "draft_graphs", False))
        self.kv = drafter.new_cache(1)

    def reset(self, capacity: int) -> None:
        self.kv = self.drafter.new_cache(capacity, pooled=self.graphs)

    def release(self) -> None:
        """The session is over: a pooled draft cache (and its graphs) goes to the next one."""
        self.kv.release()

    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed rows. Graphed (after the prompt, at most a block of rows), the rows
        go at `kv.length..` (`positions` unread: a Session always ingests contiguously)."""
        t, b = taps.shape[0], self.program.block_size
        if self.graphs and self.kv.length > 0 and t <= b:
            from memra_cli.engine.models.drafter import DraftCapacityError
            from memra_cli.engine.runtime.draft_graphs import IngestGraph

            if self.kv.length + t > self.kv.cap:
                raise DraftCapacityError(f"draft KV cache full: {self.kv.length} + {t} rows > capacity {self.kv.cap}")
            key = ("ingest", taps.shape[1])
            graph = self.kv.graphs.get(key)
            if graph is None:
                graph = self.kv.graphs[key] = IngestGraph(self.drafter, self.kv, taps.shape[1])
            graph.run(taps, self.kv.length)
            self.kv.length += t
            return
        for lo in range(0, t, PRIME_CHUNK):
            self.drafter.ingest(self.kv, taps[lo : lo + PRIME_CHUNK], positions[lo : lo + PRIME_CHUNK])

    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal:
        if self.graphs:
            from memra_cli.engine.runtime.draft_graphs import ProposeGraph

            assert self.kv.length == start, (self.kv.length, start)  # row index == position
            key = ("propose", self.program, want_raws)  # drafters (and their pools) are shared by arms
            graph = self.kv.graphs.get(key)
            if graph is None:
                graph = self.kv.graphs[key] = ProposeGraph(self, self.kv, want_raws)
            return Proposal(*graph.run(last, start))
        b = self.program.block_size
        self.block_ids[0] = last[0]
        noise = self.target.embed(self.block_ids)
        positions = torch.arange(start, start + b, device=self.target.device)
        hidden = self.drafter.forward_round(self.kv, noise, positions).hidden_out
        return Proposal(*self._drafts(hidden, last, want_raws))

    def _drafts(self, hidden: torch.Tensor, last: torch.Tensor,
                want_raws: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block hidden `[b, hidden]` -> drafts `[n_drafts]` (harvested rows through the target's
        lm_head, then the markov chain or argmax) and, when asked, confidence raws `[n_drafts]`."""
        p = self.program
        rows = hidden[p.harvest.first_row : p.harvest.first_row + p.n_drafts]
        logits = self.target.logits(rows)
        drafts = self.drafter.markov_chain(logits, last) if p.markov else torch.argmax(logits, dim=-1)
        raws = None
        if want_raws:
            raws = self.drafter.confidence_raw(rows, torch.cat([last.reshape(1), drafts[:-1]]))
        return drafts, raws

    def static_proposal(self, kv, last: torch.Tensor, tail: torch.Tensor, start: torch.Tensor,
                        want_raws: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`propose` with static shapes (the body of a ProposeGraph): `last [1]`, the block's
        mask ids `tail [b-1]`, `start` a 0-d device tensor -> drafts `[n_drafts]` and raws
        `[n_drafts]` or None. Reads only its arguments and long-lived weights."""
        noise = self.target.embed(torch.cat([last.reshape(1), tail]))
        return self._drafts(self.drafter.static_round(kv, noise, start), last, want_raws)


class Session:
    """A resumable greedy decode: `prime()` once, then `burst(n)` until `finished`.

    With `proposer=None` it is plain greedy through the same target path (one row per round).
    """

    def __init__(self, target, prompt_ids: Sequence[int], max_new: int, *, proposer: Proposer | None = None,
                 program: Program | None = None, taps: Sequence[int] = (), eos_ids: Sequence[int] = (),
                 timed: bool = False):
        target.check_prompt(list(prompt_ids), max_new)
        self.target, self.proposer, self.program = target, proposer, program
        self.prompt, self.max_new, self.eos = list(prompt_ids), max_new, set(eos_ids)
        self.taps = tuple(taps) if proposer is not None else ()
        block = program.block_size if program else 1
        self.capacity = len(self.prompt) + max_new + block + 1
        self.cache = target.new_cache(min(self.capacity, target.cfg.max_position_embeddings))
        self.stats = DecodeStats()
        self.clock = PhaseClock(self.stats, target.device, timed)
        self.tokens: list[int] = []
        self.finished = max_new == 0
        self.vt = program.verify_cap if program else 1
        self.last: torch.Tensor | None = None
        self._t0 = 0.0
        self._released = False  # caches handed back (once, when the stream ends)

    @property
    def position(self) -> int:
        """Committed length of the target context (prompt + generated tokens whose K/V are in)."""
        return self.cache.length

    def prime(self) -> None:
        """Prefill the prompt (taps armed for a proposer) and the drafter's context."""
        import time

        self._t0 = time.perf_counter()
        self.clock.start()
        ids = torch.tensor(self.prompt, dtype=torch.long, device=self.target.device)
        self.last, taps = self.target.prefill(ids, self.cache, self.taps or None)
        if self.proposer is not None:
            self.proposer.reset(self.capacity)
            self.proposer.ingest(taps, torch.arange(len(self.prompt), device=self.target.device))
        self.clock.lap("prefill")

    def burst(self, n: int) -> list[int]:
        """Run rounds until at least `n` new tokens are committed or the stream ends."""
        import time

        if self.last is None:
            self.prime()
        out: list[int] = []
        while len(out) < n and not self.finished:
            out += self._round()
        if self.finished and not self._released:  # pooled storages (CUDA graphs) go to the next session
            self._released = True
            self.cache.release()
            if self.proposer is not None:
                self.proposer.release()
        self.stats.wall_s = time.perf_counter() - self._t0
        self.stats.tokens = len(self.tokens)
        return out

    def run(self) -> list[int]:
        while not self.finished:
            self.burst(1 << 30)
        return self.tokens

    # ------------------------------------------------------------------- one round

    def _window(self, proposal: Proposal) -> int:
        p = self.program
        assert p is not None
        vt = self.vt
        if p.window.is_confidence:
            assert proposal.raws is not None
            vt = p.window.size_window(proposal.raws.tolist(), p.verify_cap)  # host read 1 of 2
        return max(1, min(vt, self.max_new - len(self.tokens)))  # never verify past the budget

    def _round(self) -> list[int]:
        start, last = self.cache.length, self.last
        assert last is not None
        self.clock.start()
        if self.proposer is None:
            cand, vt, drafts = last, 1, None
        else:
            want = self.program.window.is_confidence  # type: ignore[union-attr]
            proposal = self.proposer.propose(last, start, want)
            drafts = proposal.drafts
            vt = self._window(proposal)
            cand = torch.cat([last.reshape(1), drafts[: vt - 1]])
        self.clock.lap("draft")
        vam, taps = self.target.verify(cand, start, self.cache, self.taps or None)
        host = torch.cat([cand, vam]).tolist()  # the round's one (ladder) host read
        cand_h, vam_h = host[:vt], host[vt:]
        self.clock.lap("verify")
        m = accept_prefix(cand_h, vam_h, vt) if vt > 1 else 0
        committed = self._commit(cand_h, m)
        self.cache.truncate(start + m + 1)
        self.clock.lap("rollback")
        if self.proposer is not None and not self.finished:
            self.proposer.ingest(taps[: m + 1], torch.arange(start, start + m + 1, device=self.target.device))
        self.clock.lap("ingest")
        self.last = vam[m : m + 1]
        self.stats.rounds += 1
        self.stats.drafted += vt - 1
        self.stats.accepted += m
        self.stats.accept_hist[m] += 1
        if self.program is not None:
            self.vt = ladder_next(m, self.program.verify_cap) if self.program.adapt else self.program.verify_cap
        return committed

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
