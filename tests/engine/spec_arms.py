"""Speculative arms over a tiny target, for the family tests: a DSpark drafter whose planted heads
make some drafts right and some wrong, and the check that every arm's stream is plain greedy's.

The planted markov head (rank V: w1 = I, w2[v, u] = 30 for each of the target's greedy bigrams
u -> v on the prompts, a quarter dropped) drafts the target's own continuation where it knows
the bigram, and the confidence head scores +3 / -3 on whether the previous token has a planted
successor: a verify then keeps some drafts and rejects others, so both paths of the round run.
"""

from __future__ import annotations

import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.tiny.draft import make_tiny_draft


def planted_head(target, prompts, new: int, vocab: int, hidden: int, drop: float = 0.25) -> dict:
    """The DSpark export's markov and confidence tensors planted as the module docstring says."""
    rng, succ = torch.Generator().manual_seed(11), {}
    for ids in prompts:
        seq = ids[-1:] + greedy_reference(StepRunner(target, 16), ids, new + 16)
        succ.update(zip(seq, seq[1:]))
    keep = {u: v for u, v in succ.items() if torch.rand(1, generator=rng).item() >= drop}
    w2 = torch.zeros(vocab, vocab)
    for u, v in keep.items():
        w2[v, u] = 30.0
    conf = torch.cat([torch.zeros(hidden), torch.full((vocab,), -3.0)])
    conf[hidden + torch.tensor(sorted(keep))] = 3.0
    return {"markov_head.markov_w1.weight": torch.eye(vocab), "markov_head.markov_w2.weight": w2,
            "confidence_head.proj.weight": conf[None, :], "confidence_head.proj.bias": torch.zeros(1)}


def make_drafts(root, target, prompts, new: int, taps: tuple[int, ...], vocab: int = 512) -> dict:
    """A z-lab DFlash drafter and a DSpark drafter with the planted heads, tapping `taps`."""
    n, h = target.n_layers, target.hidden_size
    return {"dflash": make_tiny_draft(root / "zlab", "zlab", target_layer_ids=taps, num_target_layers=n),
            "dspark": make_tiny_draft(root / "spark", "deepspec", target_layer_ids=taps, num_target_layers=n,
                                      markov_rank=vocab, confidence="markov",
                                      extra_tensors=planted_head(target, prompts, new, vocab, h))}


def assert_arm_equals_plain(target, drafts: dict, mode: str, vt: str, prompts, new: int) -> None:
    """The arm's stream is plain greedy's at 16-row steps on every prompt; a DSpark arm (the
    planted heads) both keeps and rejects drafts."""
    engine = Engine.from_model(target, step_width=16)
    arm = engine.arm(ArmConfig(draft=drafts[mode], mode=mode, settings=PolicySettings(vt=vt)))
    accepted = drafted = 0
    for ids in prompts:
        session = engine.session(ids, new, arm, eos_ids=())
        assert session.run() == greedy_reference(StepRunner(target, 16), ids, new)
        accepted, drafted = accepted + session.stats.accepted, drafted + session.stats.drafted
    if mode == "dspark":
        assert 0 < accepted < drafted, (accepted, drafted)


GROUPINGS = ([1] * 24, [24], [16, 8], [5, 7, 1, 11], [3] * 8)


def assert_groupings_equal(target, vocab: int = 512) -> None:
    """At 16-row fixed steps, teacher-forcing 24 tokens after a 37-token prompt in runner steps
    of any grouping gives every token the logits of one row at a time, bit for bit: a token's
    routing and experts do not depend on which rows share its step."""
    runner = StepRunner(target, 16)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab - 1, (37,), generator=g).to(target.device)
    cont = torch.randint(0, vocab - 1, (24,), generator=g).to(target.device)
    runs = []
    for groups in GROUPINGS:
        state = runner.new_state(64)
        runner.prefill(prompt, state)
        out, at = [], 0
        for n in groups:
            out.append(runner.step(cont[at:at + n], state.length, state)[0])
            at += n
        runs.append(torch.cat(out))
    for groups, logits in zip(GROUPINGS[1:], runs[1:]):
        assert torch.equal(logits, runs[0]), f"grouping {groups}: logits differ from one row at a time"


def assert_session_equals_plain(target, draft, prompts, new: int, mode: str = "dflash") -> None:
    """An arm of `mode` with `draft` over the target at 16-row steps: plain greedy's stream."""
    engine = Engine.from_model(target, step_width=16)
    arm = engine.arm(ArmConfig(draft=draft, mode=mode))
    for ids in prompts:
        with engine.session(ids, new, arm, eos_ids=()) as session:
            assert session.run() == greedy_reference(engine.runner, ids, new)
