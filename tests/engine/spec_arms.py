"""The MoE family tests' shared setup (test_qwen3_moe.py, test_qwen3_5_moe.py, test_gemma4_moe.py):
prompts, transformers' routes and greedy streams, checkpoint variants for the refusals,
speculative arms over a tiny target, and graphed sessions on the CPU stand-in of a capture.

Speculative arms: a DSpark drafter whose planted heads make some drafts right and some wrong. The
planted markov head (rank V: w1 = I, w2[v, u] = 30 for each of the target's greedy bigrams
u -> v on the prompts, a quarter dropped) drafts the target's own continuation where it knows
the bigram, and the confidence head scores +3 / -3 on whether the previous token has a planted
successor: a verify then keeps some drafts and rejects others, so both paths of the round run.
"""

from __future__ import annotations

import copy
import json

import torch
from safetensors.torch import load_file, save_file

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.spec.round_bodies import greedy_step
from memra_cli.tiny.draft import make_tiny_draft

from host_reads import NoHostReads


def prompt(n: int, seed: int, top: int) -> list[int]:
    """`n` random token ids below `top` (the tiny vocab's special tokens sit above it)."""
    return torch.randint(0, top, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------- routes and transformers


class RouteRecorder:
    """Wraps a family's routing function `real(x, ...) -> (weights, ids [t, k])`: keeps the ids of
    every call (`calls`) and of every 16-row call as lists (`steps`)."""

    def __init__(self, real):
        self.steps, self.calls, self.real = [], [], real

    def __call__(self, x, *args):
        weights, ids = self.real(x, *args)
        self.calls.append(ids)
        if x.shape[0] == 16:
            self.steps.append(ids.tolist())
        return weights, ids


@torch.no_grad()
def hf_logits_and_routes(hf, ids: list[int], router_class: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits `[t, V]` and, per layer in order, the expert ids `[t, k]` its router
    (modules of class `router_class`) picked: their third output, in descending probability."""
    routes = []
    hooks = [m.register_forward_hook(lambda mod, args, out: routes.append(out[2]))
             for m in hf.modules() if type(m).__name__ == router_class]
    try:
        logits = hf(input_ids=torch.tensor([ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, routes


@torch.no_grad()
def hf_greedy(hf, ids: list[int], new: int, vocab: int, pad: int = 0) -> list[int]:
    """transformers' greedy `generate` of exactly `new` tokens (EOS set to the never-produced id
    `vocab`; sampling filters off)."""
    x = torch.tensor([ids])
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id, gc.pad_token_id = vocab, pad
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens, gc.max_length = False, new, None, None
    gc.top_k = gc.top_p = None
    return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)[0, len(ids):].tolist()


def assert_steps_share_and_split(steps: list, num_experts: int) -> None:
    """Among the recorded 16-row steps' live rows (a padding row's ids are all `num_experts`: no
    expert), some rows of a step share an expert and some share none: the logits were checked
    over both kinds of step."""
    live = [[set(row) for row in step if max(row) < num_experts] for step in steps]
    pairs = [(a, b) for rows in live for i, a in enumerate(rows) for b in rows[i + 1:]]
    assert any(a & b for a, b in pairs) and any(not a & b for a, b in pairs)


def write_variant(src, dst, config: dict | None = None, drop: str | None = None, reshape: str | None = None):
    """A copy of the checkpoint `src` at `dst` with `config` keys set, tensor `drop` missing, or
    tensor `reshape` one row short."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][:-1].contiguous()
    save_file(state, str(dst / "model.safetensors"))
    return dst


# --------------------------------------------------------------------------- speculative arms


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
    head = planted_head(target, prompts, new, vocab, h)
    markov_only = {k: v for k, v in head.items() if k.startswith("markov_head.")}
    return {"dflash": make_tiny_draft(root / "zlab", "zlab", target_layer_ids=taps, num_target_layers=n),
            "dspark": make_tiny_draft(root / "spark", "deepspec", target_layer_ids=taps, num_target_layers=n,
                                      markov_rank=vocab, confidence="markov", extra_tensors=head),
            # the planted markov head without a confidence head (the priced window fits its survival)
            "headless": make_tiny_draft(root / "headless", "deepspec", target_layer_ids=taps, num_target_layers=n,
                                        markov_rank=vocab, extra_tensors=markov_only)}


def assert_arm_equals_plain(target, drafts: dict, mode: str, vt: str, prompts, new: int) -> None:
    """The arm's stream is plain greedy's at 16-row steps on every prompt; a DSpark arm (the
    planted heads) both keeps and rejects drafts. `vt="priced-routed"`: the priced window on each
    prompt's measured expert union (`vt_cost=routed`)."""
    engine = Engine.from_model(target, step_width=16)
    settings = PolicySettings(vt="priced", vt_cost="routed") if vt == "priced-routed" else PolicySettings(vt=vt)
    program = "dflash" if mode == "dflash" else "dspark"  # `headless`: a DSpark drafter without its confidence head
    arm = engine.arm(ArmConfig(draft=drafts[mode], mode=program, settings=settings))
    accepted = drafted = 0
    for ids in prompts:
        session = engine.session(ids, new, arm, eos_ids=())
        assert session.run() == greedy_reference(StepRunner(target, 16), ids, new)
        accepted, drafted = accepted + session.stats.accepted, drafted + session.stats.drafted
        assert (session.stats.window_cost is not None) == (vt == "priced-routed")
    if mode != "dflash":  # the planted heads: some drafts kept, some rejected
        assert 0 < accepted < drafted, (accepted, drafted)


GROUPINGS = ([1] * 24, [24], [16, 8], [5, 7, 1, 11], [3] * 8)


def assert_groupings_equal(target, vocab: int = 512, recorded: RouteRecorder | None = None) -> None:
    """At 16-row fixed steps, teacher-forcing 24 tokens after a 37-token prompt in runner steps
    of any grouping gives every token the logits of one row at a time, bit for bit: a token's
    routing and experts do not depend on which rows share its step. `recorded`: the family's
    routing function, wrapped (and patched in by the caller): its steps' live rows both share
    and split experts."""
    runner = StepRunner(target, 16)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab - 1, (37,), generator=g).to(target.device)
    cont = torch.randint(0, vocab - 1, (24,), generator=g).to(target.device)
    runs = []
    for groups in GROUPINGS:
        state = runner.new_state(64)
        runner.prefill(prompt_ids, state)
        out, at = [], 0
        for n in groups:
            out.append(runner.step(cont[at:at + n], state.length, state)[0])
            at += n
        runs.append(torch.cat(out))
    for groups, logits in zip(GROUPINGS[1:], runs[1:]):
        assert torch.equal(logits, runs[0]), f"grouping {groups}: logits differ from one row at a time"
    if recorded is not None:
        assert_steps_share_and_split(recorded.steps, target.moe.num_experts)


def assert_padding_rows_run_no_experts(target, vocab: int, width: int = 16, steps: int = 3) -> None:
    """A fixed step's padding rows read no experts: plain decoding at `width`-row steps (one live
    row, the rest padding) counts exactly top-k experts per sparse-layer call (what its one row
    routes to), and a live row's logits are the same bits with 1 and with `width` live rows."""
    runner = StepRunner(target, width)
    ids = torch.tensor(prompt(7, seed=21, top=vocab - 8), device=target.device)
    state = runner.new_state(ids.shape[0] + steps + width)
    logits, _ = runner.prefill(ids, state)
    before = target.expert_reads
    for _ in range(steps):
        logits, _ = runner.step(logits[-1:].argmax(-1), state.length, state)
    calls, experts = (b - a for a, b in zip(before, target.expert_reads))
    assert calls == steps * len(target.moe.sparse_layers), calls
    assert experts == calls * target.moe.top_k, f"{experts} experts in {calls} one-live-row calls"
    rows = torch.tensor(prompt(width, seed=22, top=vocab - 8), device=target.device)
    # a greedy round's step (the family's `static_step_picks` where it has one) masks them too
    state.set_live_rows(1)
    before = target.expert_reads
    greedy_step(target, rows, torch.arange(state.length, state.length + width, device=target.device), state, None)
    calls, experts = (b - a for a, b in zip(before, target.expert_reads))
    assert experts == calls * target.moe.top_k, f"{experts} experts in {calls} one-live-row greedy-step calls"
    one = runner.fixed_step(rows, state.length, state, live=1)[0]
    every = runner.fixed_step(rows, state.length, state)[0]
    assert torch.equal(one[0], every[0]), "a live row's logits depend on how many rows are live"


def assert_session_equals_plain(target, draft, prompts, new: int, mode: str = "dflash", graphs: bool = False) -> None:
    """An arm of `mode` with `draft` over the target at 16-row steps: plain greedy's stream over
    eager steps. `graphs`: the session's target steps and drafter rounds as CUDA graphs."""
    engine = Engine.from_model(target, step_width=16, cuda_graphs=graphs, draft_graphs=graphs)
    arm = engine.arm(ArmConfig(draft=draft, mode=mode))
    for ids in prompts:
        with engine.session(ids, new, arm, eos_ids=()) as session:
            assert session.run() == greedy_reference(StepRunner(target, 16), ids, new)


# --------------------------------------------------------------------------- graphs, stood in for on the CPU


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def eager_capture(monkeypatch) -> list:
    """`cuda_graphs.capture` swapped for an eager stand-in (test_step_width.py's): replay reruns
    the body and copies its results into the first run's outputs; both runs refuse host reads of
    device values (`NoHostReads`), as a capture does, and the MoE twin sees a capture under way
    (`moe_ref.capturing`: it runs every expert, as on CUDA). Returns the list of captured bodies."""
    from memra_cli.engine.runtime import cuda_graphs
    from memra_kernels import moe_ref

    captures, inside = [], [False]
    real_capturing = moe_ref.capturing

    def run(fn):
        inside[0] = True
        try:
            with NoHostReads():
                return fn()
        finally:
            inside[0] = False

    def capture(fn, device, pool=None):
        out = run(fn)

        class Replay:
            def replay(self):
                for mine, new in zip(_tensors(out), _tensors(run(fn))):
                    mine.copy_(new)

        captures.append(fn)
        return Replay(), out

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(moe_ref, "capturing", lambda x: inside[0] or real_capturing(x))
    return captures


def graphed_on_cpu(model, width: int, round_graphs: bool) -> Engine:
    """What `Engine.from_model(model, step_width=width, cuda_graphs=True, draft_graphs=True)`
    builds on CUDA (a runner refuses graphs off CUDA, so they are switched on after construction)."""
    runner = StepRunner(model, width)
    runner.cuda_graphs = True
    model.ensure_positions(runner._rows(model.cfg.max_position_embeddings))
    return Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                  round_graphs=round_graphs)


def assert_graphed_session_equals_plain(model, draft, prompt_ids: list[int], new: int, width: int,
                                        round_graphs: bool, captures: list) -> None:
    """With `eager_capture` on: a DFlash session over `model` with graphed prefill, steps (or
    whole rounds) and drafter graphs equals plain greedy over eager steps, reads nothing on the
    host in any captured body, and its replays count the experts they run."""
    assert type(model).supports_cuda_graphs
    plain = greedy_reference(StepRunner(model, width), prompt_ids, new)
    engine = graphed_on_cpu(model, width, round_graphs)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    before = model.expert_reads
    with engine.session(prompt_ids, new, arm, eos_ids=()) as session:
        assert session.run() == plain
        keys = {k[0] for k in session.cache.graphs}
    assert ("spec-chain" if round_graphs else "step") in keys, keys  # what was captured
    assert captures
    after = model.expert_reads
    assert after[0] > before[0] and after[1] >= 2 * (after[0] - before[0])  # top-2 or more a call


def assert_graphed_prefill_padding_reads_no_experts(model, vocab: int, t: int = 3) -> None:
    """With `eager_capture` on: a graphed prefill of a `t`-token prompt runs its bucket's rows,
    and its padding rows route to no expert (runtime/graphs.py `PrefillGraph`, models/experts.py
    `padded_forward`): the experts it counts are the eager prefill's of the same ids."""
    ids = torch.tensor(prompt(t, seed=23, top=vocab - 8), device=model.device)
    runner = graphed_on_cpu(model, 16, False).runner
    state = runner.new_state(t + 32)
    assert runner.prefill_rows(t, state) > t  # a bucket with padding rows
    runner.prefill(ids, state)  # the capture (the stand-in's capture run counts, as no real warm-up does)
    counts = []
    for eager in (True, False):
        before = model.expert_reads
        runner.prefill(ids, state, eager=eager)
        counts.append(tuple(b - a for a, b in zip(before, model.expert_reads)))
    assert any(k[0] == "prefill" for k in state.graphs)
    assert counts[1] == counts[0], f"graphed prefill counted {counts[1]}, the eager one {counts[0]}"
