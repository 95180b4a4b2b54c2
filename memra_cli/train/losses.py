"""The drafter loss and its evaluations on the target's own greedy continuations (the training
loop that steps on the loss is job.py's TrainJob, shared by `memra train` and the embedded build).

A batch is B sequences `[prompt ; target greedy continuation]` of length L with A random anchors
each, all drafted at once: queries are the A blocks' b rows, keys are the L ctx rows plus every
block's rows, and the mask lets block a see ctx keys before its anchor and its own b rows (the
block is non-causal, as the drafter runs at inference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memra_cli.train.drafter import TrainDrafter, param_count  # noqa: F401  (param_count: re-exported)
from memra_cli.train.taps import as_tap_source


@dataclass
class DraftSpec:
    kind: str  # "dflash" (mask-fill) | "dspark" (shifted + markov + confidence)
    block: int
    taps: tuple[int, ...]
    mask_id: int
    emb_scale: float = 1.0  # the block embedding's multiplier (1: the target's raw rows; Gemma: √hidden)

    @property
    def first_row(self) -> int:
        return 1 if self.kind == "dflash" else 0

    @property
    def n_drafts(self) -> int:
        return self.block - 1 if self.kind == "dflash" else self.block


def per_row(prompt_len: int | torch.Tensor, n: int) -> torch.Tensor:
    """Prompt lengths `[n]` (long) from one length or a per-row tensor."""
    p = torch.as_tensor(prompt_len).long()
    return p.expand(n).clone() if p.ndim == 0 else p


def sample_anchors(n_seq: int, anchors: int, lo: int | torch.Tensor, hi: int | torch.Tensor,
                   gen: torch.Generator) -> torch.Tensor:
    """`[n_seq, anchors]` anchor positions in [lo, hi] (each one int or `[n_seq]` per row), sorted
    per row."""
    lo, hi = per_row(lo, n_seq), per_row(hi, n_seq)
    span = (hi - lo + 1).clamp(min=1)
    pos = lo[:, None] + (torch.rand((n_seq, anchors), generator=gen) * span[:, None]).long()
    return torch.minimum(pos, hi[:, None]).sort(dim=1).values


def last_anchors(plens: torch.Tensor, L: int, block: int, answer_len: int | None) -> torch.Tensor:
    """`[n]` the last anchor whose block has labels in each row: within the row's L tokens, and
    with `answer_len`, within its first answer_len tokens past its prompt (the bench's stretch)."""
    ends = torch.full_like(plens, L) if answer_len is None else (plens + answer_len).clamp(max=L)
    return ends - 1 - block


def block_batch(ids: torch.Tensor, anchors: torch.Tensor, spec: DraftSpec):
    """Noise ids, positions, labels, prev ids and the attention mask for anchors `[B, A]`.

    Returns noise_ids `[B, A*b]`, blk_pos `[B, A*b]`, labels `[B, A, nd]`, prev `[B, A, nd]`
    (teacher-forced previous token of each draft slot), mask `[B, 1, A*b, L + A*b]`.
    """
    B, L = ids.shape
    A, b = anchors.shape[1], spec.block
    offs = torch.arange(b, device=ids.device)
    blk_pos = (anchors[..., None] + offs).reshape(B, A * b)
    noise = torch.full((B, A, b), spec.mask_id, dtype=torch.long, device=ids.device)
    noise[..., 0] = torch.gather(ids, 1, anchors)
    # Draft slot j (dflash: row j+1 fills anchor+j+1; dspark: row j predicts anchor+j+1) is
    # labelled with the token at anchor+1+j under both conventions; only the rows differ.
    label_pos = anchors[..., None] + 1 + torch.arange(spec.n_drafts, device=ids.device)
    labels = torch.gather(ids, 1, label_pos.reshape(B, -1)).reshape(B, A, spec.n_drafts)
    prev = torch.gather(ids, 1, (label_pos - 1).reshape(B, -1)).reshape(B, A, spec.n_drafts)
    ctx_ok = torch.arange(L, device=ids.device)[None, None, :] < anchors.reshape(B, A, 1)  # [B, A, L]
    ctx_ok = ctx_ok.repeat_interleave(b, dim=1)  # [B, A*b, L]
    blk_id = torch.arange(A, device=ids.device).repeat_interleave(b)
    same = blk_id[:, None] == blk_id[None, :]  # [A*b, A*b]
    mask = torch.cat([ctx_ok, same.expand(B, -1, -1)], dim=2)[:, None]
    return noise.reshape(B, A * b), blk_pos, labels, prev, mask


def draft_logits(drafter: TrainDrafter, target, ids, anchors, spec: DraftSpec, taps: torch.Tensor | None = None):
    """Drafter forward on a batch: (rows' base logits `[B, A, nd, V]`, rows' hidden, labels, prev).
    `taps`: the target's taps of `ids` when the caller has them already."""
    B, L = ids.shape
    source = as_tap_source(target)
    embed, head = source.embed_weight, source.head_weight
    taps = target_taps(target, ids, spec.taps) if taps is None else taps
    noise_ids, blk_pos, labels, prev, mask = block_batch(ids, anchors, spec)
    ctx_pos = torch.arange(L, device=ids.device).expand(B, L)
    noise = F.embedding(noise_ids, embed)
    if spec.emb_scale != 1.0:  # as the engine's proposer multiplies it in (spec/proposer.py)
        noise = noise * spec.emb_scale
    hidden = drafter(taps, noise, ctx_pos, blk_pos, mask)
    A = anchors.shape[1]
    rows = hidden.view(B, A, spec.block, -1)[:, :, spec.first_row : spec.first_row + spec.n_drafts]
    logits = rows @ head.T
    cap = getattr(source, "logit_softcap", None)
    if cap:  # as the target's lm_head caps the drafter's logits at inference (Gemma: cap * tanh(z / cap))
        logits = torch.tanh(logits / cap) * cap
    return logits, rows, labels, prev


def target_taps(target, ids: torch.Tensor, taps) -> torch.Tensor:
    """`[B, L, n_taps*hidden]` taps of `ids` from either kind of target (taps.py)."""
    return as_tap_source(target).tap_batch(ids, tuple(taps))


def markov_bias(drafter: TrainDrafter, prev: torch.Tensor) -> torch.Tensor:
    m = drafter.markov_head
    return m.markov_w2(m.markov_w1(prev))


def slot_decay(spec: DraftSpec, device) -> torch.Tensor:
    """`[nd]` per-slot loss weights exp(-j / (b/2)): a late slot only counts when the earlier ones hit."""
    return torch.exp(-torch.arange(spec.n_drafts, device=device) / (spec.block / 2))


def drafter_loss(drafter: TrainDrafter, target, ids: torch.Tensor, anc: torch.Tensor, taps: torch.Tensor,
                 spec: DraftSpec, decay: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch: ids `[B, L]`, anchors `[B, A]`, the target's taps of ids.
    CE per draft slot weighted by `decay` (DFlash rows 1..b-1 mask-fill; DSpark shifted labels
    plus the markov head's bias, teacher-forced), plus for a confidence head BCE against whether
    the slot's greedy draft hits its label."""
    device = ids.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits, rows, labels, prev = draft_logits(drafter, target, ids, anc, spec, taps)
        if drafter.markov_head is not None:
            logits = logits + markov_bias(drafter, prev)
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    loss = (ce * decay).sum() / (decay.sum() * labels.shape[0] * labels.shape[1])
    if drafter.confidence_head is not None:
        hit = (logits.argmax(-1) == labels).float()
        feats = rows.float()
        if drafter.markov_head is not None:
            feats = torch.cat([feats, drafter.markov_head.markov_w1(prev).float()], -1)
        loss = loss + F.binary_cross_entropy_with_logits(drafter.confidence_head.proj(feats).squeeze(-1), hit)
    return loss


@torch.no_grad()
def _rounds(drafter: TrainDrafter, target, seqs: torch.Tensor, spec: DraftSpec, *, anchors: int,
            prompt_len: int | torch.Tensor, device, batch: int = 32, seed: int = 3, answer_len: int | None = None):
    """Draft every held-out block as inference does (the markov chain feeds on its own choices).
    Yields (hits `[B, A, nd]` bool, confidence raw scores `[B, A, nd]` f32 or None) per batch."""
    gen, L = torch.Generator().manual_seed(seed), seqs.shape[1]
    plens = per_row(prompt_len, seqs.shape[0])
    last = last_anchors(plens, L, spec.block, answer_len)
    for lo in range(0, seqs.shape[0], batch):
        ids = seqs[lo : lo + batch].to(device)
        anc = sample_anchors(ids.shape[0], anchors, plens[lo : lo + batch] - 1, last[lo : lo + batch], gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, rows, labels, _ = draft_logits(drafter, target, ids, anc, spec)
            drafts, prevs = _chain(drafter, logits.float(), torch.gather(ids, 1, anc))
            raw = None
            if drafter.confidence_head is not None:
                feats = rows.float()
                if drafter.markov_head is not None:
                    feats = torch.cat([feats, drafter.markov_head.markov_w1(prevs).float()], -1)
                raw = drafter.confidence_head.proj(feats).squeeze(-1).float()
        yield (drafts == labels), raw


@torch.no_grad()
def evaluate(drafter: TrainDrafter, target, seqs: torch.Tensor, spec: DraftSpec, *, anchors: int,
             prompt_len: int | torch.Tensor, device, batch: int = 32, answer_len: int | None = None) -> dict:
    """Per-slot greedy acceptance on held-out continuations. `p_prefix[k]` = P(first k+1 drafts
    all accepted); `p_slot[k]` = P(draft k right); `p_reached[k]` = P(draft k right | drafts
    before it right), the quantity a per-slot confidence score predicts; `tau_full` = 1 +
    E[accepted prefix] with the whole block verified. With a confidence head, `reliability` is
    its calibration over the reached slots: predicted vs observed acceptance per decile of score.
    `answer_len`: blocks only within each row's first answer_len tokens past its prompt."""
    nd = spec.n_drafts
    prefix_hits, slot_hits, n = torch.zeros(nd, dtype=torch.float64), torch.zeros(nd, dtype=torch.float64), 0
    raws, hits = [], []
    for ok, raw in _rounds(drafter, target, seqs, spec, anchors=anchors, prompt_len=prompt_len, device=device, batch=batch,
                           answer_len=answer_len):
        prefix = ok.long().cumprod(-1)
        prefix_hits += prefix.sum((0, 1)).double().cpu()
        slot_hits += ok.sum((0, 1)).double().cpu()
        n += ok.shape[0] * ok.shape[1]
        if raw is not None:
            reached = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], -1).bool()
            raws.append(raw[reached].cpu())
            hits.append(ok[reached].cpu())
    p_prefix = (prefix_hits / n).tolist()
    reached_n = [n] + (prefix_hits[:-1]).tolist()
    out = {
        "p_prefix": [round(p, 4) for p in p_prefix],
        "p_slot": [round(p, 4) for p in (slot_hits / n).tolist()],
        "p_reached": [round(h / r, 4) if r else None for h, r in zip(prefix_hits.tolist(), reached_n)],
        "tau_full": round(1 + sum(p_prefix), 3),
        "blocks": n,
    }
    if raws:
        out["reliability"] = reliability(torch.cat(raws), torch.cat(hits))
    return out


@torch.no_grad()
def walk_tau(drafter: TrainDrafter, target, seqs: torch.Tensor, spec: DraftSpec, *, prompt_len: int | torch.Tensor,
             device, batch: int = 32, answer_len: int | None = None) -> dict:
    """Acceptance as the bench measures it: rounds walked along each held-out continuation.

    `evaluate`'s `tau_full` averages the accepted prefix over anchors drawn uniformly over the
    positions. The bench instead starts a round where the last one stopped, so a stretch the
    drafter gets right (a loop of the small target) is crossed in a few long rounds and a hard
    stretch costs a round per token: its tau is tokens / rounds, which weighs the hard stretches
    far more. Here each sequence is walked from its last prompt token: draft a block, accept the
    prefix that matches the continuation (the target's greedy tokens; the whole block verified,
    as `adapt=0`), jump past it, until a block no longer fits. Returns `tau_walk` (tokens covered
    / rounds) and `rounds`. `answer_len`: each row is walked only over its first answer_len tokens
    past its prompt (the bench's stretch; a short prompt's row runs on past it)."""
    L, nd = seqs.shape[1], spec.n_drafts
    plens = per_row(prompt_len, seqs.shape[0])
    lasts = last_anchors(plens, L, spec.block, answer_len)  # the last anchor whose block has labels
    rounds, tokens = 0, 0
    for lo in range(0, seqs.shape[0], batch):
        ids = seqs[lo : lo + batch].to(device)
        at = (plens[lo : lo + batch] - 1).to(device)  # each row's anchor: the last committed token
        last = lasts[lo : lo + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            taps = target_taps(target, ids, spec.taps)
            while True:
                live = at <= last
                if not bool(live.any()):
                    break
                anc = torch.minimum(at, last)[:, None]
                logits, _, labels, _ = draft_logits(drafter, target, ids, anc, spec, taps)
                drafts, _ = _chain(drafter, logits.float(), torch.gather(ids, 1, anc))
                accepted = (drafts == labels).long().cumprod(-1).sum(-1)[:, 0]  # [B]
                rounds += int(live.sum())
                tokens += int(((accepted + 1) * live).sum())
                at = torch.where(live, at + accepted + 1, at)
    return {"tau_walk": round(tokens / max(rounds, 1), 3), "rounds": rounds, "max_accept": nd}


def reliability(raw: torch.Tensor, hit: torch.Tensor, bins: int = 10) -> list[dict]:
    """Calibration table: slots bucketed by predicted acceptance sigmoid(raw) into `bins` equal
    bins of [0, 1]; each row `{bin, n, predicted, observed}` (means over the bucket)."""
    p = torch.sigmoid(raw.float())
    idx = (p * bins).long().clamp(max=bins - 1)
    rows = []
    for b in range(bins):
        sel = idx == b
        k = int(sel.sum())
        if k:
            rows.append({"bin": f"{b / bins:.1f}-{(b + 1) / bins:.1f}", "n": k,
                         "predicted": round(float(p[sel].mean()), 4), "observed": round(float(hit[sel].float().mean()), 4)})
    return rows


@torch.no_grad()
def calibrate_confidence(drafter: TrainDrafter, target, seqs: torch.Tensor, spec: DraftSpec, *, anchors: int,
                         prompt_len: int | torch.Tensor, device, answer_len: int | None = None) -> dict:
    """Platt scaling of the confidence head on drafted blocks of `seqs`: fit a, b so that
    sigmoid(a * raw + b) matches acceptance of the slots a round reaches, and fold them into the
    head's weights (the checkpoint keeps its format). Returns {a, b, n, bce_before, bce_after}."""
    raws, hits = [], []
    for ok, raw in _rounds(drafter, target, seqs, spec, anchors=anchors, prompt_len=prompt_len, device=device, seed=5,
                           answer_len=answer_len):
        prefix = ok.long().cumprod(-1)
        reached = torch.cat([torch.ones_like(prefix[..., :1]), prefix[..., :-1]], -1).bool()
        raws.append(raw[reached].cpu())
        hits.append(ok[reached].float().cpu())
    z, y = torch.cat(raws).double(), torch.cat(hits).double()
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y)
        loss.backward()
        return loss

    with torch.enable_grad():
        before = F.binary_cross_entropy_with_logits(z, y).item()
        opt.step(closure)
        after = F.binary_cross_entropy_with_logits(ab[0].detach() * z + ab[1].detach(), y).item()
    a, b = (float(v) for v in ab.detach())
    proj = drafter.confidence_head.proj
    proj.weight.mul_(a)
    proj.bias.mul_(a).add_(b)
    return {"a": round(a, 4), "b": round(b, 4), "n": int(z.numel()), "bce_before": round(before, 4), "bce_after": round(after, 4)}


def _chain(drafter: TrainDrafter, logits: torch.Tensor, anchor: torch.Tensor):
    """Greedy drafts `[B, A, nd]` and each slot's previous token (markov: its own choices)."""
    if drafter.markov_head is None:
        drafts = logits.argmax(-1)
        return drafts, torch.cat([anchor[..., None], drafts[..., :-1]], -1)
    prev, out, prevs = anchor, [], []
    for k in range(logits.shape[2]):
        prevs.append(prev)
        prev = (logits[:, :, k] + markov_bias(drafter, prev).float()).argmax(-1)
        out.append(prev)
    return torch.stack(out, -1), torch.stack(prevs, -1)
