"""What a graphed round computes (runtime/round_graphs.py captures it; spec/chained.py runs it).

Both bodies read their inputs from one long vector (shared by a `RoundChain`'s graphs) and
return one packed vector, so a round is at most one host-to-device copy, one replay and one read;
each also writes the next round's inputs, so a round can be queued before the previous is read.

Speculative round, inputs `[t_start, d_start, last, vt, budget]` (equal starts in a session; the
capture runs at the first round's target rows and in the draft cache's slack; the priced window
fitted to the accepted runs also carries `[kept, rejected]`), output `[cand (W), sel (W), raws (n_drafts, under a window sized from
them), vt, m]` as float64 (ids < 2^53 are exact):

    drafts, raws = the static proposal of the block [last, MASK...] at d_start (draft graphs' body)
    cand = [last, drafts][:W]       (padded by repeating its last id when the block is shorter)
    logits, taps = target.static_step(cand at t_start..t_start+W-1)
    sel = argmax(logits)            (greedy: target.step_ops.argmax)
    drafter.static_ingest(taps, all W rows at d_start)
    vt, m, next inputs = settle_round(...)   (the window, the accepted prefix, the next round)

The verify covers W rows whatever the window, and the window only decides how many rows count,
exactly as `Session._round` does with fixed-width steps (a row's logits do not depend on the
rows after it). The window is known before the verify (the ladder's and the priced window
fitted to the accepted runs are inputs; one sized from the drafter's raws is sized then by the
settlement's own op run on a copy of the inputs: the same window, bit for bit), so the rows past
it are padding, which a recurrent state skips in its recurrence and an MoE target routes to no
expert (the step's live rows, `live_rows_from`): the rows inside the window are the same bits
either way. The ingest takes all W rows: the rows past the
accepted prefix land at positions the next round's block overwrites before any query reads them
(the padding argument of draft_graphs.IngestGraph), so the drafter's cache holds what an ingest
of the kept rows alone would. The host then sets both lengths to `start + m + 1`.

Plain step, inputs `[t_start, last]`, output `[sel]` (long): the fixed-width step of `last`
padded to W by repetition (as the runner pads), then the argmax of its first row, which is also
written into `inputs[1]`: the next round's anchor, so the next replay needs no host value but
its start.
"""

from __future__ import annotations

from typing import Sequence

import torch

from memra_cli.engine.spec.proposer import Program, static_proposal


def greedy_step(target, ids: torch.Tensor, positions: torch.Tensor, cache, taps) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed-width step's argmax picks `[W]` and taps: a family's `static_step_picks` where it
    has one (the lm_head and its argmax one step op), else `static_step(widen=False)` then the
    step ops' argmax: the model-dtype logits' argmax is the float32 copy's (an exact widening)."""
    fused = getattr(target, "static_step_picks", None)
    if fused is not None:
        sel, _, tapped = fused(ids, positions, cache, taps)
        return sel, tapped
    logits, tapped = target.static_step(ids, positions, cache, taps, widen=False)
    return target.step_ops.argmax(logits), tapped


def _window_rows(program: Program, width: int, device: torch.device) -> torch.Tensor | None:
    """The tensor a round writes its window into before the verify (`_round_core`), or None where
    the window is always the whole step (a fixed ladder as wide as the step). No row past the
    window can be accepted or picked, so those rows are padding, which a recurrent state skips
    and an MoE target routes to no expert (`live_rows_from`)."""
    kind = settle_kind(program.window)
    if kind != "ladder" or program.adapt or program.verify_cap < width:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return None


def _round_core(drafter, target, program: Program, kv, cache, taps: Sequence[int], width: int, want_raws: bool,
                live: torch.Tensor | None = None, presize=None):
    """`core(inputs) -> (cand [W], sel [W], raws [nd] or None)`: draft, verify and ingest; with
    `live` (`_window_rows`), the verify's live rows are the round's window: `inputs[3]` capped by
    the budget `inputs[4]` (the ladder's, the priced window fitted to the runs), or, with
    `presize(cand, raws, inputs) -> int32 [1]`, the window sized from the drafts' raws."""
    dev = target.device
    cfg = drafter.cfg
    mask_ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=dev)  # [0]: the anchor's
    taps = tuple(taps)
    b = cfg.block_size

    def core(inputs: torch.Tensor):
        d_start, last = inputs[1], inputs[2:3]
        # the verify's positions and the block's (for the proposal and the ingest of the step's
        # rows) in one add
        verify_at, at = drafter.round_positions(inputs[0:2], b, width)
        heads = static_proposal(drafter, target, program, kv, last, mask_ids, d_start, want_raws, at=at,
                                want_chain=True)
        drafts, raws, cand = heads.drafts, heads.raws, heads.chain  # cand = [last, drafts]
        if cand.shape[0] >= width:
            cand = cand[:width]
        else:
            cand = torch.cat([cand, cand[-1:].expand(width - cand.shape[0])])
        if live is None:
            sel, tapped = greedy_step(target, cand, verify_at, cache, taps)
        else:
            if presize is None:
                live.copy_(torch.minimum(inputs[3], inputs[4]).clamp(min=1).reshape(1))
            else:
                live.copy_(presize(cand, raws, inputs))
            with cache.live_rows_from(live):
                sel, tapped = greedy_step(target, cand, verify_at, cache, taps)
        drafter.static_ingest(kv, tapped, d_start, at.span[: tapped.shape[0]])  # the span covers max(b, W) rows
        return cand, sel, raws

    return core


def settle_kind(window) -> str:
    """The device settle's kind for a verify window (memra_kernels.settle_ref `KINDS`)."""
    if window.kind == "priced":
        return "priced" if window.is_confidence else "priced-runs"
    return window.kind


def speculative_round_chained(drafter, target, program: Program, kv, cache, taps: Sequence[int], width: int,
                              want_raws: bool, cost_table: torch.Tensor | None = None):
    """The speculative round's body over one target state and one draft cache (see module): it
    settles the round on the device and writes the next round's inputs
    (runtime/round_graphs.py `RoundChain`; spec/chained.py).

    Inputs `[t_start, d_start, last, vt, budget]` (`vt`: the ladder's window; `budget`: tokens
    the stream may still commit). As `Session._round` does on the host: the window (the ladder's, or
    sized from the raws), capped by the budget (at least 1); m = accepted prefix inside it;
    then the next inputs `[t_start + m + 1, d_start + m + 1, sel[m], ladder_next(m) or the cap,
    budget - m - 1]` (the priced window's next vt over its fitted survival, and its runs).
    `cost_table` (float64 `[cap]`, a priced window's bytes of 1..cap rows) is read at every
    replay: the caller writes a session's table into it before its rounds. Output `[cand (W),
    sel (W), raws (nd, under a window sized from them), vt, m]` float64: the host commits the m
    the device used. The settlement is the step op
    `settle_round` (memra_kernels.settle_ref; one launch with the kernels: memra_kernels.settle).

    A target state that rolls back on the device (`settles_on_device`: the hybrid's recurrent
    state, either rollback mode) is restored here too: the settlement also writes the ring rows to
    re-run (`state.round_params`) and `state.restore_round()` re-runs them from the step's base,
    so the round needs no host rollback between it and the next."""
    ops, window = target.step_ops, program.window
    kind = settle_kind(window)
    threshold = torch.tensor([window.threshold if window.is_confidence else 0.0], dtype=torch.float64,
                             device=target.device)
    # a dense KV cache's step costs the same at any live count and ignores it (`live_rows_from`):
    # no live rows to write before its verify (the raws' window is sized after it, the ladder's
    # is the settlement's), where a recurrent state or an MoE target skips its padding rows
    skips_padding = target.moe is not None or not cache.host_bookkeeping
    live = _window_rows(program, width, target.device) if skips_padding else None

    def presize(cand: torch.Tensor, raws: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The window the settlement will size from `raws`, before the verify: the same op on the
        same values (a copy of the inputs; the verdict rows stand in for the unknown picks, which
        the window does not read), so the same window, bit for bit. Its packed `vt`, int32 `[1]`."""
        out = ops.settle_round(cand, cand, raws, inputs.clone(), threshold, kind=kind, cap=program.verify_cap,
                               adapt=program.adapt, cost=cost_table)
        return out[-2:-1].to(torch.int32)

    core = _round_core(drafter, target, program, kv, cache, taps, width, want_raws, live,
                       presize if window.is_confidence else None)
    on_device = cache.settles_on_device
    restore = dict(restore=cache.round_params, ring=cache.ring) if on_device else {}

    def body(inputs: torch.Tensor) -> torch.Tensor:
        cand, sel, raws = core(inputs)
        out = ops.settle_round(cand, sel, raws if window.is_confidence else None, inputs, threshold,
                               kind=kind, cap=program.verify_cap, adapt=program.adapt, cost=cost_table, **restore)
        if on_device:
            cache.restore_round(live)
        return out

    return body


def plain_step(target, cache, width: int):
    """The plain decode step (see module) without the anchor write: a one-off replay's body."""
    rows = torch.arange(width, device=target.device)

    def body(inputs: torch.Tensor) -> torch.Tensor:
        t_start, last = inputs[0], inputs[1:2]
        with cache.reading_rows(1):  # only row 0's pick is read: an MoE step routes that row alone
            sel, _ = greedy_step(target, last.expand(width).contiguous(), rows + t_start, cache, None)
        return sel[:1]

    return body


def plain_step_chained(target, cache, width: int):
    """The plain round's body (see module): `plain_step` whose selection also becomes the next
    round's anchor (`inputs[1]`)."""
    step = plain_step(target, cache, width)

    def body(inputs: torch.Tensor) -> torch.Tensor:
        sel = step(inputs)
        inputs[1:2].copy_(sel.reshape(1))  # after the step read its anchor: stream order
        return sel

    return body
