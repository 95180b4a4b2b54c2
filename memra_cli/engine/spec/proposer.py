"""Proposers: what the round asks of a drafter, and the real one (DFlash / DSpark forward over
its KV cache, harvest, the target's lm_head, the markov chain, the confidence head).

`Program` is what a speculative session runs, fully resolved (receipts name it). A proposer is
made per session; its draft KV cache comes from the runtime's pool (with its CUDA graphs, when
drafter rounds are graphed) and goes back on `release`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from memra_cli.engine.errors import MemraError
from memra_cli.engine.models.drafter import BlockPositions, BlockTokens, DraftCapacityError, Drafter
from memra_cli.engine.runtime.pool import StoragePool
from memra_cli.engine.spec.draft_vocab import DraftVocab
from memra_cli.engine.spec.policy import Harvest, VerifyWindow
from memra_cli.engine.runtime.steps import PREFILL_BUCKET
from memra_cli.engine.spec.sampling import GREEDY, Sampler
from memra_cli.engine.threads import for_rows

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
    emb_scale: float = 1.0  # the block embedding's multiplier (1.0: the target's raw rows)
    vocab: DraftVocab | None = None  # drafts from a subset of the target's tokens (spec/draft_vocab.py)

    @property
    def n_drafts(self) -> int:
        return self.harvest.n_drafts(self.block_size)


@dataclass
class Proposal:
    drafts: torch.Tensor  # [nd] long, on the device
    raws: torch.Tensor | None = None  # [nd] float32 pre-sigmoid confidence, when asked for
    probs: torch.Tensor | None = None  # [nd, vocab] float64 draft distribution q, for rejection sampling


class Proposer(Protocol):
    """What the round needs from a drafter (the real one, or a test oracle)."""

    def reset(self, capacity: int) -> None: ...
    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None: ...
    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal: ...
    def release(self) -> None: ...  # the session is over (pooled caches go back)


class DrafterProposer:
    """The real proposer: drafter forward over its KV cache, harvest, target lm_head, markov."""

    def __init__(self, drafter: Drafter, target, program: Program, *, graphs: bool = False,
                 pool: StoragePool | None = None, sampler: Sampler = GREEDY):
        if program.window.is_confidence and not drafter.has_confidence:
            raise SpecError(
                f"verify-window {program.window} needs a checkpoint with an accept-rate head "
                f"(confidence_head.* absent in {drafter.census.path})"
            )
        if program.vocab is not None and not sampler.greedy:
            raise SpecError(f"a draft vocabulary ({program.vocab.size} of {program.vocab.vocab_size} tokens) drafts "
                            "greedily only: sampled drafting needs the whole vocabulary's q; drop --draft-vocab or "
                            "sample at temperature 0")
        if graphs and pool is None:
            raise ValueError("graphed drafter rounds need a pool (their graphs live on pooled storages)")
        self.drafter, self.target, self.program = drafter, target, program
        self.sampler = sampler  # greedy: argmax drafts; a sampler with `drafting`: its drafts (spec/keyed.py)
        cfg = drafter.cfg
        self.block_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=target.device)
        self.graphs, self.pool = graphs, pool  # drafter rounds as CUDA graphs (runtime/draft_graphs.py)
        self.kv = None

    def reset(self, capacity: int) -> None:
        self.release()
        if not self.graphs:
            self.kv = self.drafter.new_cache(capacity)
            return
        cap = -(-capacity // 256) * 256  # buckets, so later sessions find a storage and its graphs
        self.kv = self.pool.acquire((self.pool.owner_token(self.drafter), "draft", cap),
                                   lambda: self.drafter.new_cache(cap))
        self.kv.length = 0

    def release(self) -> None:
        """The session is over: a pooled draft cache (and its graphs) goes to the next one."""
        if self.kv is not None and self.pool is not None:
            self.pool.release(self.kv)

    def ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed rows. Graphed, the rows go at `kv.length..` (`positions` unread: a
        Session always ingests contiguously): after the prompt at most a block of rows, one
        replay; the prompt itself (one window) padded to a bucket, one replay. On the CPU at the
        thread count its rows get (`threads.for_rows`)."""
        with for_rows(taps.shape[0]):
            self._ingest(taps, positions)

    def _ingest(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        t, b = taps.shape[0], self.program.block_size
        if self.graphs and self.kv.length > 0 and t <= b:
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
        if self.graphs and self.kv.length == 0 and t <= PRIME_CHUNK:
            from memra_cli.engine.runtime.draft_graphs import IngestGraph

            rows = -(-t // PREFILL_BUCKET) * PREFILL_BUCKET  # the prefill's bucket: one replay
            if rows <= self.kv.cap:
                key = ("prompt-ingest", rows, taps.shape[1])
                graph = self.kv.graphs.get(key)
                if graph is None:
                    graph = self.kv.graphs[key] = IngestGraph(self.drafter, self.kv, taps.shape[1], rows, 0)
                graph.run(taps, 0)
                self.kv.length = t
                return
        for lo in range(0, t, PRIME_CHUNK):
            self.drafter.ingest(self.kv, taps[lo : lo + PRIME_CHUNK], positions[lo : lo + PRIME_CHUNK])

    def propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal:
        """The drafter's block from the last committed token at `start`: its drafts (and raws, q).
        On the CPU at the thread count a block of rows gets (`threads.for_rows`)."""
        with for_rows(self.program.block_size):
            return self._propose(last, start, want_raws)

    def _propose(self, last: torch.Tensor, start: int, want_raws: bool) -> Proposal:
        keeps_q = self.sampler.rejection
        if self.graphs and not keeps_q:  # (rejection sampling's q is not graphed: eager rounds)
            from memra_cli.engine.runtime.draft_graphs import ProposeGraph

            assert self.kv.length == start, (self.kv.length, start)  # row index == position
            # one drafter (and its storages) serves several arms, and sessions of several samplers
            key = ("propose", self.program, want_raws, self.sampler.params)
            graph = self.kv.graphs.get(key)
            if graph is None:
                body = functools.partial(static_proposal, sampler=self.sampler)
                graph = self.kv.graphs[key] = ProposeGraph(body, self.drafter, self.target, self.program,
                                                            self.kv, want_raws)
            return Proposal(*graph.run(last, start))
        b = self.program.block_size
        self.block_ids[0] = last[0]
        noise = block_embedding(self.target, self.program, self.block_ids)
        positions = torch.arange(start, start + b, device=self.target.device)
        hidden = self.drafter.forward_round(self.kv, noise, positions).hidden_out
        heads = draft_heads(self.drafter, self.target, self.program, hidden, last, want_raws, self.sampler,
                            positions[0], host_loop=True)
        return Proposal(heads.drafts, heads.raws, heads.probs)


def block_embedding(target, p: Program, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's block input `[b, hidden]`: the target's embedding rows of `ids [b]`, times
    `p.emb_scale` when the arm resolved a scaled embedding (a model-dtype multiply by the scale
    already rounded to that dtype, as a scaling family's own embedding does)."""
    noise = target.embed(ids)
    return noise if p.emb_scale == 1.0 else noise * p.emb_scale


class Heads(NamedTuple):
    """What `draft_heads` gives: drafts `[nd]` long, confidence raws `[nd]` float32 (when asked
    for), the draft distribution q `[nd, vocab]` (when the sampler keeps it), and the candidates
    `[1 + nd]` = [last, drafts] (when the raws or the caller asked for them: the raws' previous
    tokens are its first nd, so one concatenation serves both)."""

    drafts: torch.Tensor
    raws: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    chain: torch.Tensor | None = None


def draft_heads(drafter: Drafter, target, p: Program, hidden, last: torch.Tensor,
                want_raws: bool, sampler: Sampler = GREEDY, start: torch.Tensor | None = None,
                host_loop: bool = False, want_chain: bool = False) -> Heads:
    """Block hidden `[b, hidden]` (or its `PendingNorm`: `draft_rows`) -> drafts `[n_drafts]`
    (harvested rows through the target's lm_head, then the markov chain or argmax), when asked
    confidence raws `[n_drafts]`, and the drafts' distribution q when the sampler keeps it.
    Greedy drafts are argmax; a sampler with `drafting` (temperature > 0) picks draft k with the
    noise keyed to position `start + k` (0-d device tensor), the target row that judges it.
    `host_loop`: the caller is eager, never a graph body, so the chain may loop on the host (CPU;
    step_ops `markov_chain`).
    `want_chain`: also the candidates [last, drafts] (`Heads.chain`)."""
    rows = draft_rows(hidden, p.harvest.first_row, p.n_drafts)
    drafting, chain, raws = None, None, None
    with_anchor = want_raws or want_chain  # the candidates [last, drafts] are wanted
    if p.vocab is not None:  # greedy only (DrafterProposer refuses a sampler): the subset's rows
        drafts = p.vocab.drafts(drafter, target.lm_head(rows, p.vocab.head), last, p.markov, host_loop)
    else:
        # Greedy drafts (the markov chain or argmax) read the lm_head's model-dtype output as it
        # is: widening it to float32 is exact and changes no maximum, so the float32 copy of the
        # logits ([n_drafts, vocab], 9 MB at a 152k vocabulary) is never written or read again.
        logits = target.lm_head(rows) if sampler.greedy else target.logits(rows)
        if not sampler.greedy:
            drafting = sampler.drafting(start + torch.arange(p.n_drafts, device=logits.device), logits.shape[-1])
        if drafting is None and p.markov and want_raws:  # the chain scores its slots (one launch, kernels)
            chain, raws = drafter.markov_chain_confidence(logits, last, rows, host_loop=host_loop)
            drafts = chain[1:]
        elif drafting is None and p.markov:  # the greedy chain writes the anchor in its own launch
            picks = drafter.markov_chain(logits, last, host_loop=host_loop, with_anchor=with_anchor)
            drafts, chain = (picks[1:], picks) if with_anchor else (picks, None)
        elif drafting is None:
            drafts = drafter.step_ops.argmax(logits)
        else:
            drafts = drafter.markov_chain(logits, last, drafting.pick) if p.markov else drafting.pick_rows(logits)
    if with_anchor and chain is None:
        chain = torch.cat([last.reshape(1), drafts])
    if want_raws and raws is None:
        raws = drafter.confidence_raw(rows, chain[:-1])  # each slot's previous token
    return Heads(drafts, raws, drafting.probs if drafting is not None else None, chain)


def static_proposal(drafter: Drafter, target, p: Program, kv, last: torch.Tensor, mask_ids: torch.Tensor,
                    start: torch.Tensor, want_raws: bool, sampler: Sampler = GREEDY, at: BlockPositions | None = None,
                    want_chain: bool = False) -> Heads:
    """`propose` with static shapes (the body of a ProposeGraph): `last [1]`, the block's ids
    `mask_ids [b]` (the mask token's; element 0 stands for `last`), `start` a 0-d device tensor
    -> `Heads`: drafts `[n_drafts]`, raws `[n_drafts]` or None, and with `want_chain` the
    candidates [last, drafts]. `at`: the block's `Drafter.block_positions(start, b)` when the
    caller made them. Reads only its arguments and long-lived weights: nothing of any session."""
    # the draft logits' lm_head rows may take the drafter's final norm (greedy: the logits read as
    # they are; a sampler's drafting reads them through `target.logits`, which takes it too)
    heads = target.lm_head_weight if p.vocab is None else p.vocab.head
    hidden = drafter.static_round(kv, static_block(drafter, target, p, last, mask_ids), start, at, heads=heads)
    return draft_heads(drafter, target, p, hidden, last, want_raws, sampler, start, want_chain=want_chain)


def draft_rows(hidden, first: int, n: int):
    """Rows `first..first+n-1` of a block's final-normed hidden: a tensor's, or a `PendingNorm`'s
    (a drafter's final norm left to its heads: `Drafter.static_round`), its rows and their sums of
    squares."""
    if isinstance(hidden, torch.Tensor):
        return hidden[first : first + n]
    return hidden._replace(rows=hidden.rows[first : first + n], sumsq=hidden.sumsq[first : first + n])


def static_block(drafter: Drafter, target, p: Program, last: torch.Tensor, mask_ids: torch.Tensor):
    """A static round's block input: its `BlockTokens` where the drafter embeds and norms the
    block in one launch (a plain embedding of the drafter's dtype: no `emb_scale`), else the rows
    `block_embedding` makes of [last, mask ids...] (a concatenation, then the gather)."""
    if drafter.fuses_block_embedding and p.emb_scale == 1.0 and target.embed_weight.dtype == drafter.dtype:
        return BlockTokens(target.embed_weight, mask_ids, last)
    return block_embedding(target, p, torch.cat([last.reshape(1), mask_ids[1:]]))
