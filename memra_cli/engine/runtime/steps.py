"""The step runner: how a target model's forwards are scheduled, not what they compute.

It owns the scheduling that every model family shares, so model classes only compute:

- the **step width** W: after the prefill, every decode and verify step runs at exactly W rows
  (shorter steps padded by repeating their last id, longer ones in W-row chunks). Every kernel
  then sees the same shapes whether a token is decoded alone or verified with 15 others, and
  since no kernel mixes rows, a token's logits are bit-identical either way: speculative output
  equals plain greedy in bf16 too. Padding rows come after the real ones, so causality hides
  them; their K/V land past `state.length` and are overwritten later, and `state.commit` keeps
  only the real rows (a recurrent state restores the one after the last real row).
- **CUDA graphs**: a fixed-width step has static shapes (`model.static_step`), so one capture per
  state storage and taps tuple replays every later step (runtime/graphs.py).
- **state lifetime**: states come from the shared `StoragePool` (graphs ride on the storage),
  sized with W rows of slack for the padding, and go back on `release`.
- **graphed prefill**: with CUDA graphs, a prompt of one chunk is padded to a bucket of
  `PREFILL_BUCKET` rows and replayed from a graph kept on the storage (runtime/graphs.py
  `PrefillGraph`): one launch instead of a few hundred. Only where padding rows leave no trace
  (a K/V cache; a recurrent state would carry them) and the bucket fits the storage.
- **chunked prefill**: a prompt runs in forwards of at most `prefill_chunk` rows, so its
  transient memory (the `[g*rows, length]` mask, attention scores on paths that materialise
  them, the taps) is bounded by the chunk, not the prompt; each chunk's taps go to a callback
  (the drafter ingests them) and are not kept.
- prompt validation (vocabulary, lengths) against the model's shape facts.

The model (models/base.py `TargetModel`) supplies `new_state`, `forward` (eager, any width) and
`static_step` (fixed width, device positions). A `Sampler` turns the logits into tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.errors import ConfigError, PromptError
from memra_cli.engine.layers.torch_step_ops import ATTN_KEY_BLOCK
from memra_cli.engine.runtime.cuda_graphs import GraphCache
from memra_cli.engine.runtime.pool import StoragePool
from memra_cli.engine.threads import for_rows

STATE_BUCKET = 256  # pooled state lengths are multiples of this (CUDA graphs bind a storage)
PREFILL_CHUNK = 512  # prompt rows per prefill forward: bounds the transient mask, scores and taps
PREFILL_BUCKET = 64  # with CUDA graphs, a one-chunk prompt is padded to a multiple of this and replayed


class StepRunner:
    """Runs one target model's prefill and fixed-width (or variable) steps over session states."""

    def __init__(self, model, step_width: int | None = None, cuda_graphs: bool = False,
                 pool: StoragePool | None = None, prefill_chunk: int = PREFILL_CHUNK):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if step_width is not None and (isinstance(step_width, bool) or not isinstance(step_width, int) or step_width < 1):
            raise ConfigError(f"step_width must be a positive integer or None (variable), got {step_width!r}")
        if cuda_graphs and not model.supports_cuda_graphs:
            why = model.graphs_note
            raise ConfigError(f"cuda_graphs: {why} ({model.cfg.source})")
        if cuda_graphs and (model.device.type != "cuda" or step_width is None):
            raise ConfigError("cuda_graphs needs the target on a CUDA device and a fixed step_width "
                              f"(device {model.device}, step_width {step_width})")
        self.model = model
        self.width = step_width
        self.cuda_graphs = bool(cuda_graphs)
        self.pool = pool if pool is not None else StoragePool()
        self._prefill_pool = None  # one memory pool for every prefill graph (made on first capture)
        if self.cuda_graphs:
            # Graphs read rope tables by address: make them once at their largest, so a later,
            # longer session never replaces a table a graph was captured with.
            self.model.ensure_positions(self.max_rows())

    # ------------------------------------------------------------------- validation

    def check_prompt(self, prompt_ids: Sequence[int], max_new: int) -> None:
        """Refuse an empty prompt, ids outside the vocabulary, or a length past the model's limit."""
        m = self.model
        n, source = len(prompt_ids), m.cfg.source
        if n == 0:
            raise PromptError("the prompt is empty (need at least one token id)")
        for i, tok in enumerate(prompt_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < m.vocab_size:
                raise PromptError(f"prompt token id {tok!r} at index {i} is outside the vocabulary "
                                  f"[0, {m.vocab_size}) of {source}")
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise PromptError(f"max_new must be an integer >= 0, got {max_new!r}")
        total, limit = n + max_new, m.cfg.max_position_embeddings
        if total > limit:
            raise PromptError(f"prompt ({n} tokens) + max_new ({max_new}) = {total} exceeds "
                              f"max_position_embeddings {limit} of {source}")

    # ------------------------------------------------------------------- states

    def _rows(self, max_len: int) -> int:
        rows = max_len + (self.width or 0)  # room for a fixed-width step's padding rows
        if self.cuda_graphs:
            rows = -(-rows // STATE_BUCKET) * STATE_BUCKET
        elif self.width is not None and self.model.device.type == "cpu":
            # the CPU step's attention reads whole key blocks: none is cut by the storage's end
            rows = -(-rows // ATTN_KEY_BLOCK) * ATTN_KEY_BLOCK
        return rows

    def max_rows(self) -> int:
        """The most positions a state of this runner ever spans (the longest session plus
        padding slack): what its rope tables must reach."""
        return self._rows(self.model.cfg.max_position_embeddings)

    def new_state(self, max_len: int):
        """A state for `max_len` positions (prompt + generated), plus slack for padding rows.
        With CUDA graphs it comes from the pool in buckets, so the next session finds a storage
        (and the graphs captured over it)."""
        limit = self.model.cfg.max_position_embeddings
        if not 1 <= max_len <= limit:
            raise PromptError(f"KV cache length {max_len} is outside [1, {limit}] "
                              f"(max_position_embeddings of {self.model.cfg.source})")
        rows = self._rows(max_len)
        self.model.ensure_positions(rows)
        if not self.cuda_graphs:
            return self._fresh_state(rows)
        state = self.pool.acquire((self.pool.owner_token(self.model), "target", rows), lambda: self._fresh_state(rows))
        state.reset()
        return state

    def _fresh_state(self, rows: int):
        """The model's new state of `rows` positions; one that replays graphs inside its own
        methods (`graphed_restores`) gets the cache that captures them."""
        state = self.model.new_state(rows)
        if state.graphed_restores:
            state.attach_graph_cache(GraphCache(self.model.device))
        return state

    def release(self, state) -> None:
        """The session is over: a pooled state (and its graphs) goes back for the next one."""
        self.pool.release(state)

    # ------------------------------------------------------------------- steps

    def prefill(self, ids: torch.Tensor, state, taps: Sequence[int] | None = None, on_taps=None, eager: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt `ids [t]` from position 0, in forwards of at most `prefill_chunk` rows: float32
        logits of the last row `[1, vocab]` (only it goes through lm_head) and the taps. With
        `on_taps(taps [c, n_taps*hidden], start)` each chunk's taps are handed over as they are
        made and None is returned for them (nothing holds the whole prompt's); without it they
        come back whole, `[t, n_taps*hidden]`. `eager`: never a graphed bucket (a caller that
        records what the forwards route, which a replay would not run on the host)."""
        with for_rows(ids.shape[0]):
            return self._prefill(ids, state, taps, on_taps, eager)

    def _prefill(self, ids: torch.Tensor, state, taps: Sequence[int] | None, on_taps, eager: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        state.reset()
        t, chunk = ids.shape[0], self.prefill_chunk
        graph = None if eager else self._prefill_graph(t, state, taps)
        if graph is not None:
            logits, tapped = graph.run(ids)
            if tapped is not None and on_taps is not None:
                on_taps(tapped, 0)
                tapped = None
            return logits, tapped
        kept: list[torch.Tensor] = []
        hidden = None
        for lo in range(0, t, chunk):
            hidden, tapped = self.model.forward(ids[lo : lo + chunk], lo, state, taps)
            if tapped is not None:
                if on_taps is not None:
                    on_taps(tapped, lo)
                else:
                    kept.append(tapped)
        assert hidden is not None, "an empty prompt is refused by check_prompt"
        whole = None if not kept else kept[0] if len(kept) == 1 else torch.cat(kept)
        return self.model.logits(hidden[-1:]), whole

    def prefill_rows(self, t: int, state) -> int | None:
        """The padded rows a graphed prefill of a `t`-token prompt runs over `state`, or None
        when it runs eagerly (graphs off, more than one chunk, a recurrent state, a bucket past
        the storage, or more padding than the model's `padding_rows_limit` for the state)."""
        if not self.cuda_graphs or t > self.prefill_chunk:
            return None
        if not state.host_bookkeeping:  # padding rows would enter the recurrence
            return None
        rows = -(-t // PREFILL_BUCKET) * PREFILL_BUCKET
        limit = self.model.padding_rows_limit(state)  # a ring's span: padding past it would overwrite live keys
        if limit is not None and rows - t > limit:
            return None
        return rows if rows <= state.max_len else None

    def _prefill_graph(self, t: int, state, taps: Sequence[int] | None):
        rows = self.prefill_rows(t, state)
        if rows is None:
            return None
        from memra_cli.engine.runtime.graphs import PrefillGraph

        key = ("prefill", rows, tuple(taps or ()))
        graph = state.graphs.get(key)
        if graph is None:
            if self._prefill_pool is None and self.model.device.type == "cuda":
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = state.graphs[key] = PrefillGraph(self.model, rows, state, key[2], pool=self._prefill_pool)
        return graph

    def step(self, ids: torch.Tensor, start: int, state, taps: Sequence[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows `ids [t]` at positions `start..start+t-1`: float32 logits `[t, vocab]` and taps
        `[t, n_taps*hidden]`, under the step-width rule; `state.length` ends at `start + t`.
        Plain decode is a step of one row; verify is a step of the candidates. On the CPU a step
        runs at the thread count the applied choice gives its rows (`threads.for_rows`)."""
        with for_rows(self.width or ids.shape[0]):
            return self._step(ids, start, state, taps)

    def _step(self, ids: torch.Tensor, start: int, state, taps: Sequence[int] | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.width is None:
            hidden, tapped = self.model.forward(ids, start, state, taps)
            return self.model.logits(hidden), tapped
        if taps:
            self.model.check_taps(taps)
        width, t = self.width, ids.shape[0]
        logits, tapped = [], []
        for lo in range(0, t, width):
            chunk = ids[lo:lo + width]
            n = chunk.shape[0]
            if n < width:
                chunk = torch.cat([chunk, chunk[-1:].expand(width - n)])
            lg, tp = self.fixed_step(chunk, start + lo, state, taps, live=n if n < width else None)
            # keep the real rows (padding ones are dropped); a recurrent state needs to know
            # whether another chunk of this step follows (a rollback may reach back into this one)
            state.commit(start + lo + n, step_continues=lo + width < t)
            logits.append(lg[:n])
            if tp is not None:
                tapped.append(tp[:n])
        if len(logits) == 1:
            return logits[0], (tapped[0] if tapped else None)
        return torch.cat(logits), (torch.cat(tapped) if tapped else None)

    def fixed_step(self, ids: torch.Tensor, start: int, state, taps: Sequence[int] | None = None,
                   live: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step of exactly W rows `ids [W]` at `start..start+W-1`: logits `[W, vocab]`, taps.
        A `start` below `state.length` rolls the state back to it first (the step overwrites from
        there); the rows then stay pending until `state.commit(end)` keeps the real ones. `live`:
        only the first `live` rows are real (None: all), which a recurrent state uses to skip
        the padding rows' recurrence (`state.set_live_rows`); their logits are then not defined.
        Replayed from a CUDA graph when graphs are on (captured on first use per storage and taps;
        outputs are copies, safe to keep), else run eagerly: the same ops either way (`model.static_step`)."""
        width = self.width
        assert width is not None and ids.shape[0] == width
        self.model.check_span(start, width, state)
        if start < state.length:
            state.rollback(start)
        state.set_live_rows(live)
        if self.cuda_graphs:
            from memra_cli.engine.runtime.graphs import StepGraph

            key = ("step", tuple(taps or ()))
            graph = state.graphs.get(key)
            if graph is None:
                graph = state.graphs[key] = StepGraph(self.model, width, state, key[1], start)
            return graph.run(ids, start)
        positions = torch.arange(start, start + width, device=self.model.device)
        if not hasattr(state, "live_keys"):  # a state whose model reads its whole storage
            return self.model.static_step(ids, positions, state, taps)
        state.live_keys = start + width  # host-known here, unlike in a graph body
        try:
            return self.model.static_step(ids, positions, state, taps)
        finally:
            state.live_keys = None
