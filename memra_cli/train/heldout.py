"""The final evaluation: the exported drafter on held-out prompts through the engine's own round
loop (the session `generate` and `bench` run), with the exactness gate: each prompt's
speculative tokens must equal its plain greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch


def _decode(engine, ids: Sequence[int], max_new: int, arm=None) -> tuple[list[int], dict]:
    with engine.session(list(ids), max_new, arm) as s:
        s.prime()
        while not s.finished:
            s.burst(64)
    return list(s.tokens), s.stats.as_json()


@torch.inference_mode()
def heldout_tau(engine, drafter_dir: Path, kind: str, prompts: Sequence[Sequence[int]], max_new: int,
                emb_scale: bool | None = None) -> dict:
    """tau (committed tokens / rounds over every held-out prompt), per-prompt tau and whether
    every speculative stream equals plain decoding (`exact`; `mismatch` names the first that
    does not). `emb_scale`: the block embedding the drafter was trained with (the arm's setting)."""
    from memra_cli.engine.api import ArmConfig

    arm = engine.arm(ArmConfig(draft=drafter_dir, mode=kind, emb_scale=emb_scale))
    tokens = rounds = 0
    per_prompt, mismatch = [], None
    for i, ids in enumerate(prompts):
        plain, _ = _decode(engine, ids, max_new)
        spec, stats = _decode(engine, ids, max_new, arm)
        if spec != plain and mismatch is None:
            first = next((k for k, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
            mismatch = {"prompt": i, "position": first}
        tokens, rounds = tokens + stats["tokens"], rounds + stats["rounds"]
        per_prompt.append(stats["tau"])
    return {"prompts": len(prompts), "max_new": max_new, "tau": round(tokens / max(rounds, 1), 4),
            "tau_per_prompt": per_prompt, "exact": mismatch is None, "mismatch": mismatch,
            "program": arm.mode, "block_embedding": arm.receipts.embedding.as_json(), "warnings": list(arm.warnings)}
