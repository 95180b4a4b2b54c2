"""A draft vocabulary: the drafter picks its drafts from a subset of the target's tokens.

A round reads the target's lm_head twice: in the verify (the target's own step, which must see
every token) and in the draft, where `[n_drafts, hidden] @ lm_head.T` reads the whole head for
15 rows. At a 152k vocabulary and hidden 4096 that second read is 1.2 GB in bf16, the largest
single matrix of the drafter's side of a round (docs/draft-vocab.md). Restricting the drafts to
the tokens that occur most often (the frequency-ranked draft head of FR-Spec, Zhao et al. 2025)
reads only those rows. The target still verifies every draft against its full vocabulary, so
the committed tokens are plain decoding's whatever the subset: a token outside it can only be
committed as the target's own correction, never drafted, which costs acceptance, not exactness.

Mechanics (greedy drafting only; a sampled draft's q must cover the whole vocabulary):

- the subset's lm_head rows are copied once at arm time, `head [N, hidden]` (ids ascending, so an
  argmax tie still goes to the smallest token id, as over the whole vocabulary);
- without the markov head, drafts = `ids[argmax(h @ head.T)]`: one more launch (the gather);
- with it (DSpark), the chain runs over the subset unchanged: `w2' = w2[ids]` (bias columns of
  the subset) and `w1' = [w1[ids]; w1]`, so a pick j (a subset index) gathers `w1[ids[j]]` and
  the anchor, any token t, enters as index `N + t`; the chain's picks map back through `ids`.
  The chain's bias table, where one is built, is `[N + V_in, N]`.

File format (`--draft-vocab FILE`, what `memra draft-vocab` writes): JSON, either a list of
token ids or an object whose "ids" is one (other keys are kept as provenance and ignored here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memra_cli.engine.errors import MemraError


class DraftVocabError(MemraError):
    """A draft vocabulary file that cannot be used (unreadable, empty, ids out of range, repeats)."""


def read_vocab_ids(path: Path, vocab_size: int) -> list[int]:
    """The ascending token ids of a draft-vocabulary file; one-line refusals name the file and the
    first bad value."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftVocabError(f"{path}: no such draft-vocabulary file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"{path}: not a JSON draft vocabulary ({type(e).__name__}: {e})") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list):
        raise DraftVocabError(f"{path}: expected a JSON list of token ids or an object with an \"ids\" list")
    if not ids:
        raise DraftVocabError(f"{path}: the draft vocabulary is empty")
    seen: set[int] = set()
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise DraftVocabError(f"{path}: ids[{i}] = {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise DraftVocabError(f"{path}: ids[{i}] = {t} is outside the target's vocabulary [0, {vocab_size})")
        if t in seen:
            raise DraftVocabError(f"{path}: ids[{i}] = {t} appears twice")
        seen.add(t)
    return sorted(seen)


class DraftVocab:
    """A drafter's vocabulary subset over one target (module docstring). Identity-hashed: a
    `Program` holding it keys graphs by this object.

    ids `[N]` int64 ascending on the target's device; head `[N, hidden]` the target's lm_head rows
    (its dtype); with a markov head, `w1 [N + V_in, r]` and `w2 [N, r]` in the drafter's compute
    dtype."""

    def __init__(self, ids: list[int], target, drafter, markov: bool, source: str):
        weight = target.lm_head_weight
        dev = weight.device
        self.size, self.vocab_size, self.source = len(ids), int(weight.shape[0]), source
        self.ids = torch.tensor(ids, dtype=torch.long, device=dev)
        self.head = weight.index_select(0, self.ids).contiguous()
        self.w1 = self.w2 = None
        if markov:
            w1, w2 = drafter.markov_w1, drafter._markov_w2_values()
            self.w1 = torch.cat([w1.index_select(0, self.ids), w1]).contiguous()
            self.w2 = w2.index_select(0, self.ids).contiguous()

    @property
    def nbytes(self) -> int:
        """Device memory the subset adds (the head copy, and the chain's w1' / w2')."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.head, self.w1, self.w2) if t is not None)

    def line(self, tag: str) -> str:
        """The receipt: how many tokens the drafts may take, from where, and what that means."""
        pct = 100.0 * self.size / self.vocab_size
        return (f"[{tag}] draft-vocab={self.size}/{self.vocab_size} tokens ({pct:.1f}%) from {self.source} "
                f"(drafts only from these; the target verifies every token)")

    def as_json(self) -> dict:
        return {"size": self.size, "vocab_size": self.vocab_size, "source": self.source}

    def drafts(self, drafter, logits: torch.Tensor, last: torch.Tensor, markov: bool, host_loop: bool) -> torch.Tensor:
        """Greedy drafts `[n]` (token ids) from subset logits `[n, N]`: the markov chain over the
        subset (anchor at index N + last) or the argmax, mapped back through `ids`."""
        if markov:
            anchor = last.reshape(1) + self.size
            picks = drafter.step_ops.markov_chain(logits, anchor, self.w1, self.w2, drafter.dtype, host_loop=host_loop)
        else:
            picks = drafter.step_ops.argmax(logits)
        return self.ids.index_select(0, picks)

    def prepare_markov(self, drafter) -> None:
        """Build the subset chain's bias table at load, as `Drafter.prepare_markov` does."""
        if self.w1 is not None:
            drafter.step_ops.prepare_markov(self.w1, self.w2, drafter.dtype)


def rank_tokens(streams, vocab_size: int, top: int) -> tuple[list[int], dict]:
    """The `top` most frequent token ids over `streams` (iterables of ids), ties to the smaller
    id, ascending; and a summary: tokens counted, distinct ids seen, the share of counted tokens
    the subset covers."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    total = 0
    for ids in streams:
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if t.numel():
            counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
            total += int(t.numel())
    # a stable sort of the negated counts: most frequent first, equal counts in id order
    order = torch.sort(-counts, stable=True).indices[:top]
    covered = int(counts[order].sum())
    summary = {"tokens_counted": total, "distinct_seen": int((counts > 0).sum()),
               "coverage": covered / total if total else 0.0}
    return sorted(order.tolist()), summary
