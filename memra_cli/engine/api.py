"""The one assembly: from settings to a loaded engine, and from an engine to sessions.

    engine = Engine.load(EngineConfig(target=DIR, device="auto", step_width=None, ...))
    arm = engine.arm(ArmConfig(draft=CKPT, mode="auto", settings=PolicySettings(...)))
    with engine.session(prompt_ids, max_new, arm) as s:
        for tokens in iter(lambda: s.burst(1), []): ...

`generate`, `bench` and `parity` build through here and nothing else; a server would too.
`Engine.load` resolves device, dtype, step width and CUDA graphs, loads the target through the
model registry and puts a step runner and one storage pool around it. `engine.arm` resolves a
speculative program against a drafter's census (receipts), checks the pair, loads the drafter at
its precision and keeps it for every session of that arm. Every mismatch between a drafter and
its target is refused with a message that names both sides. Errors name settings
(`step_width`, `device`, ...); the CLI names its flags.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from memra_cli.engine.formats.census import Census, take_census
from memra_cli.engine.formats.checkpoint import open_checkpoint
from memra_cli.engine.formats.names import MARKOV_W1, MARKOV_W2, OWN_EMBED, OWN_LM_HEAD
from memra_cli.engine.spec.draft_vocab import DraftVocab, read_vocab_ids
from memra_cli.engine.errors import ConfigError, MemraError, PolicyError, SettingError
from memra_cli.engine.spec.policy import (
    LADDER, VT_COST_ENV, PolicySettings, Receipts, VerifyWindow, adapt_on, parse_verify_cap,
    resolve_block_embedding, resolve_receipts,
)
from memra_cli.engine.layers.step_ops import select_step_ops
from memra_cli.engine.models.base import target_family
from memra_cli.engine.quant.precision import POLICIES as PRECISIONS, check_prec  # noqa: F401  (PRECISIONS: the CLI checks compare against it)
from memra_cli.engine.runtime.pool import DEFAULT_IDLE_BUDGET, StoragePool
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.engine.spec.proposer import DrafterProposer, Program, SpecError
from memra_cli.engine.spec.sampling import GREEDY, Sampler
from memra_cli.engine.spec.session import Session
from memra_cli.engine.threads import ThreadChoice, checkpoint_params, needs_size, thread_choice

log = logging.getLogger(__name__)
SPEC_MODES = ("off", "dflash", "dspark", "auto")


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; `cuda` without CUDA refuses."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SettingError("device", device, "expected auto|cpu|cuda", quote=False)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SettingError("device", device, "CUDA is not available on this machine", quote=False)
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise SettingError("dtype", dtype, "expected auto|float32|bfloat16", quote=False)
    return table[dtype]


DEFAULT_STEP_WIDTH = 16  # the block size of every published DFlash / DSpark drafter


def resolve_step_width(value: str | None) -> tuple[int | None, str]:
    """`--step-width` / MEMRA_STEP_WIDTH -> (rows per target step or None, what was applied).

    `N` (default 16): every decode and verify step runs at N rows (runtime/steps.py), so
    speculative output equals plain greedy bit for bit in any dtype; `variable`: each step at its
    own width (plain decode one row), exact only as far as the kernels happen to be."""
    if value is None:
        return DEFAULT_STEP_WIDTH, f"target steps: {DEFAULT_STEP_WIDTH} rows (default; --step-width)"
    text = value.strip().lower()
    if text == "variable":
        return None, "target steps: variable width (--step-width variable; bf16 output may differ from plain greedy)"
    if not text.isdigit() or int(text) < 1:
        raise SettingError("step_width", value, "expected a positive integer (rows per target step) or 'variable'")
    return int(text), f"target steps: {int(text)} rows (--step-width)"


def check_width_fits(width: int | None, target_dir: Path) -> None:
    """A fixed step width of at most the target's positions (config.json's
    max_position_embeddings, top level or `text_config`): a step cannot hold more rows than the
    model has positions, and each row costs a logits row of the vocabulary."""
    if width is None:
        return
    from memra_cli.engine.formats.config import read_json_object

    raw = read_json_object(target_dir / "config.json")
    scope = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    positions = scope.get("max_position_embeddings")
    if isinstance(positions, int) and width > positions:
        raise SettingError("step_width", str(width), f"expected at most the target's max_position_embeddings ({positions})")


def describe_steps(width: int | None, graphs: bool, plain_only: bool = False) -> str:
    """How a runner's target steps run, in words: `fixed 16-row steps, CUDA graphs on`,
    `one-row steps, CUDA graphs on`, `variable-width steps, eager`; an engine that only decodes
    plainly (`plain_only`) steps one row at a time at variable width: `one-row steps (variable
    width), eager`."""
    rows = ("one-row steps (variable width)" if width is None and plain_only else "variable-width steps"
            if width is None else "one-row steps" if width == 1 else f"fixed {width}-row steps")
    return f"{rows}, {'CUDA graphs on' if graphs else 'eager'}"


DRAFT_GRAPHS_ENV = "MEMRA_DRAFT_GRAPHS"
ROUND_GRAPHS_ENV = "MEMRA_ROUND_GRAPHS"


def _switch(env: dict[str, str] | None, name: str) -> str:
    """A 0/1 environment switch's value: "" (unset), "0" or "1"; anything else refuses."""
    raw = (env or {}).get(name, "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={raw!r}: expected 0 or 1")
    return raw


def _default_on_switch(env: dict[str, str] | None, name: str, possible: bool, needs: str, on_note: str,
                       off_note: str) -> tuple[bool, str | None]:
    """A switch on by default wherever it is `possible`: (on, the note to show, or None when it is
    not possible). `name=1` where it is not refuses, saying what it `needs`."""
    raw = _switch(env, name)
    if raw == "1" and not possible:
        raise ConfigError(f"{name}=1 needs {needs}")
    if not possible:
        return False, None
    on = raw != "0"
    return on, on_note if on else off_note


def resolve_round_graphs(graphs: bool, env: dict[str, str] | None = None) -> tuple[bool, str | None]:
    """Whole greedy rounds (and plain steps) as one CUDA graph each (runtime/round_graphs.py):
    on whenever the target's steps are graphed; MEMRA_ROUND_GRAPHS=0 keeps the per-part graphs.
    Returns (on, the note to show, or None when graphs are off)."""
    return _default_on_switch(
        env, ROUND_GRAPHS_ENV, graphs, "the target's CUDA graphs on",
        "greedy rounds graphed whole (default with CUDA graphs; MEMRA_ROUND_GRAPHS=0 graphs their parts)",
        "greedy rounds graphed by parts (MEMRA_ROUND_GRAPHS=0)")


PIPELINE_ENV = "MEMRA_PIPELINE"


def resolve_pipeline(round_graphs: bool, env: dict[str, str] | None = None) -> tuple[bool, str | None]:
    """Graphed rounds queued one ahead of the host's read (spec/chained.py
    `ChainedRounds`): on with whole-round graphs; MEMRA_PIPELINE=0 reads each round before
    queueing the next. The same graphs run in the same order either way (the same tokens); only
    the host's reads move. Returns (on, the note to show, or None)."""
    return _default_on_switch(
        env, PIPELINE_ENV, round_graphs, f"whole-round graphs (CUDA graphs on, {ROUND_GRAPHS_ENV} not 0)",
        "rounds queued one ahead of the host (default; MEMRA_PIPELINE=0 reads each round first)",
        "rounds read one by one (MEMRA_PIPELINE=0)")


def resolve_cuda_graphs(flag: bool | None, device: torch.device, width: int | None,
                        env: dict[str, str] | None = None, family: Any = None) -> tuple[bool, bool, str]:
    """`--cuda-graphs/--no-cuda-graphs` (MEMRA_CUDA_GRAPHS) -> (target steps graphed, drafter
    rounds graphed, what was applied). Unset: on exactly when the target runs fixed-width steps on
    CUDA (a graph replays fixed shapes) and its model `family` (class) can be captured; a family
    that cannot (`supports_cuda_graphs` false) runs eagerly, says why, and refuses the flag.
    Drafter rounds are graphed whenever the target's steps are (MEMRA_DRAFT_GRAPHS=0 runs them
    eagerly; the gain is in docs/tuning.md#drafter-graphs)."""
    possible = device.type == "cuda" and width is not None
    draft_env = _switch(env, DRAFT_GRAPHS_ENV)
    if family is not None and not family.supports_cuda_graphs:
        why = family.graphs_note
        if flag:
            raise SettingError("cuda_graphs", True, why, quote=False)
        if draft_env == "1":
            raise ConfigError(f"{DRAFT_GRAPHS_ENV}=1 needs the target's CUDA graphs on ({why})")
        return False, False, f"CUDA graphs off ({why}; eager steps)"
    if flag is None:
        why = "on CUDA with fixed-width steps" if possible else (
            "not on CUDA" if device.type != "cuda" else "variable-width steps")
        on, note = possible, f"CUDA graphs {'on' if possible else 'off'} (default: {why}; --cuda-graphs)"
    else:
        if flag and not possible:
            state = f"(device {device}, step width {'variable' if width is None else width})"
            raise SettingError("cuda_graphs", True, f"needs a CUDA device and a fixed step_width {state}", quote=False,
                               flag_text=f"{{cuda_graphs}} needs --device cuda and a fixed --step-width {state}")
        on, note = flag, f"CUDA graphs {'on' if flag else 'off'} (--cuda-graphs)"
    if draft_env == "1" and not on:
        raise ConfigError(f"{DRAFT_GRAPHS_ENV}=1 needs the target's CUDA graphs on ({note})")
    drafter = on and draft_env != "0"
    if on:
        note += (", drafter rounds graphed (default with the target's graphs; MEMRA_DRAFT_GRAPHS=0 runs them eagerly)"
                 if drafter else ", drafter rounds eager (MEMRA_DRAFT_GRAPHS=0)")
    return on, drafter, note


def resolve_program(mode: str, census: Census, settings: PolicySettings, markov: bool | None,
                    verify_cap: str | int | None, step_cost=None) -> tuple[Program, Receipts, str]:
    """The spec mode (`auto` resolved) -> Program + receipts. `dflash` = parallel drafting
    only (markov off, ladder window); `dspark` = the census-keyed DSpark program. `step_cost`
    (spec/priced.py, the target's) prices the `priced` window; None or flat: a dense target."""
    if mode not in SPEC_MODES:
        raise SettingError("spec", mode, f"expected {'|'.join(SPEC_MODES)}", quote=False)
    if mode == "auto":
        mode = "dspark" if census.strategy_dspark else "dflash"
    receipts = dataclasses.replace(resolve_receipts(settings, census.strategy_dspark, census.confidence is not None),
                                   program=mode)  # the receipts are tagged with the program that runs
    window = receipts.window
    if window.kind == "priced" and (mode == "dflash" or census.confidence is None):
        # no confidence raws to price from: a fit of the session's accepted runs prices the window
        window = dataclasses.replace(window, survival="accepted-runs", threshold=None)
        receipts = dataclasses.replace(receipts, window=window)
    if mode == "dflash":
        if receipts.window_set and window.is_confidence:
            raise SettingError("vt", settings.vt, "{vt} with {spec}: the dflash program runs the ladder window; use {spec=dspark}",
                               settings={"spec": mode})
        if markov:
            raise SettingError("markov", True, "{markov} with {spec}: the dflash program drafts in parallel (markov off); "
                               "use {spec=dspark}", settings={"spec": mode})
        if window.is_confidence:
            receipts = dataclasses.replace(receipts, window=LADDER, window_note="--spec dflash -> ladder")
        window, markov_on = (window if window.kind == "priced" else LADDER), False
    else:
        if markov and census.markov is None:
            raise SettingError("markov", True, f"{census.path} has no markov head")
        markov_on = census.markov is not None if markov is None else markov
        if window.is_confidence and census.confidence is None:
            raise SpecError(f"verify-window {window} needs a checkpoint with an accept-rate head (confidence_head.* absent in {census.path})")
    if window.kind == "priced":
        window, receipts = _resolve_priced(window, receipts, census, step_cost)
    b = census.config.block_size
    cap = parse_verify_cap(verify_cap, receipts.harvest.n_drafts(b))
    program = Program(receipts.harvest, window, markov_on, cap, adapt_on(settings.adapt), b)
    return program, receipts, mode


def _resolve_priced(window, receipts: Receipts, census: Census, step_cost):
    """The expert-priced window over this target: priced by its step cost, or on a flat cost (a
    dense target, where every verified row is free) the window the other policies already give:
    confidence-slot at the same threshold, or the ladder where no accept-rate head prices it (said
    in the receipts). The note says where the survival comes from and which cost model prices it."""
    runs = window.survival == "accepted-runs"
    if step_cost is None or step_cost.is_flat:
        flat = LADDER if runs else VerifyWindow("confidence-slot", window.threshold)
        unused = f"; {VT_COST_ENV} has nothing to price" if receipts.cost_set else ""
        note = f"priced -> {flat.kind} (flat step cost: a dense target's verify rows are free{unused})"
        return flat, dataclasses.replace(receipts, window=flat, window_note=note)
    priced = dataclasses.replace(window, cost=step_cost)
    if not runs:
        survival = "survival from the accept-rate head"
    else:
        why = "no accept-rate head" if census.confidence is None else "the dflash program reads no accept-rate head"
        survival = f"survival fitted to the session's accepted runs ({why})"
    src = f"{VT_COST_ENV} {'set' if receipts.cost_set else 'unset'}"
    bound = f"cost(1)={step_cost.bytes(1) / 1e9:.3g} GB, cost(16)={step_cost.bytes(16) / 1e9:.3g} GB of weights"
    cost = (f"cost=shape ({src}): independent routing, {bound}" if window.cost_model == "shape" else
            f"cost=routed ({src}): each prompt's expert union measured from its prefill's routing, "
            f"independent routing would give {bound}")
    return priced, dataclasses.replace(receipts, window=priced, window_note=f"{survival}, {cost}")


def check_pair(target, census: Census) -> list[str]:
    """Refuse a drafter that cannot condition on this target (headers only: before any weight
    loads). Returns warnings for what runs but deserves a word."""
    cfg, tcfg = census.config, target.cfg
    if cfg.backbone == "gemma4" and getattr(tcfg, "model_type", None) not in GEMMA4_TARGET_TYPES:
        raise ConfigError(f"a Gemma 4 DSpark drafter ({cfg.source}) drafts for a Gemma 4 target, not model_type "
                          f"{getattr(tcfg, 'model_type', None)!r} ({tcfg.source})")
    if cfg.hidden_size != tcfg.hidden_size:
        raise ConfigError(
            f"drafter hidden_size {cfg.hidden_size} ({cfg.source}) != target hidden_size "
            f"{tcfg.hidden_size} ({tcfg.source})"
        )
    if not 0 <= cfg.mask_token_id < tcfg.vocab_size:
        raise ConfigError(f"drafter mask_token_id {cfg.mask_token_id} ({cfg.source}) is outside the target vocabulary [0, {tcfg.vocab_size})")
    for tap in cfg.target_layer_ids:
        if not -1 <= tap < tcfg.num_hidden_layers:
            raise ConfigError(
                f"drafter target_layer_id {tap} ({cfg.source}) is outside the {tcfg.num_hidden_layers}-layer "
                f"target [-1, {tcfg.num_hidden_layers - 1}]"
            )
    # Every vocabulary-indexed table must index the target's tokens: the drafts go through the
    # target's lm_head, and a markov table of another size would index past its rows mid-stream.
    for info in census.tensors:
        if info.name in VOCAB_TABLES and info.shape[0] != tcfg.vocab_size:
            raise ConfigError(
                f"drafter tensor '{info.name}' has {info.shape[0]} vocabulary rows ({census.path}) but the "
                f"target's vocabulary is {tcfg.vocab_size} ({tcfg.source}): a drafter must share its target's vocabulary"
            )
    warnings = []
    if cfg.backbone == "gemma4" and cfg.gemma4.final_logit_softcapping != tcfg.final_logit_softcapping:
        warnings.append(f"drafter final_logit_softcapping {cfg.gemma4.final_logit_softcapping} differs from the "
                        f"target's {tcfg.final_logit_softcapping}; the drafts go through the target's lm_head (its cap)")
    last = tcfg.num_hidden_layers - 1
    if last in cfg.target_layer_ids:
        warnings.append(
            f"drafter taps the target's last layer ({last}); memra's tap is that layer's raw output (as DeepSpec's "
            "training cache records it), not the final-normed hidden_states[-1] transformers reports there: a drafter "
            "trained on the latter will accept less")
    return warnings


VOCAB_TABLES = (OWN_EMBED, OWN_LM_HEAD, MARKOV_W1, MARKOV_W2)
GEMMA4_TARGET_TYPES = ("gemma4", "gemma4_text")


def own_table_warnings(drafter, target) -> list[str]:
    """DeepSpec exports carry copies of the target's embed_tokens / lm_head; the engine uses the
    target's. Say so by name when the copies differ (the drafter was trained on another target)."""
    out = []
    for name, own, theirs in (("embed_tokens.weight", drafter.own_embed, target.embed_weight),
                              ("lm_head.weight", drafter.own_lm_head, target.lm_head_weight)):
        if own is None:
            continue
        if own.shape != theirs.shape or not torch.equal(own.to(theirs.device, theirs.dtype), theirs):
            out.append(f"drafter tensor '{name}' differs from the target's; memra uses the target's")
    return out


# --------------------------------------------------------------------------- drafter precision


def drafter_precision(prec: str | None, draft: Path | None):
    """The `prec` setting for a drafter load -> (Drafter.load weight_fn or None, the precision to
    report or None, where it came from). A GGUF drafter is already quantized: it loads as written,
    and `prec` may only repeat its policy."""
    from memra_cli.engine.quant.precision import weight_fn_for

    check_prec(prec)
    if draft is None:
        return None, None, None
    if Path(draft).suffix == ".gguf":
        return None, gguf_policy(prec, Path(draft)), "GGUF policy"
    return (weight_fn_for(prec), prec, "prec setting") if prec is not None else (None, None, None)


def gguf_policy(prec: str | None, path: Path) -> str:
    """The policy a GGUF drafter was written under, which it loads as: `prec` may only repeat
    it (one refusal for every command that loads a drafter)."""
    from memra_cli.engine.formats.gguf import open_gguf

    written = open_gguf(path).policy
    if prec is not None and prec != written:
        raise SettingError("prec", prec, f"{path} is a GGUF written under policy {written} and loads as "
                           "written (drop the setting, or quantize the source again)")
    return written


def resolve_precision(prec: str | None, dtype: str, device: Any) -> tuple[str, Any, Any]:
    """(policy, torch dtype, weight_fn) for a drafter judged alone (parity): unset `prec`
    follows the dtype (f32 / bf16)."""
    check_prec(prec)
    if prec in ("f32", "bf16"):
        want = torch.float32 if prec == "f32" else torch.bfloat16
        if dtype != "auto" and resolve_dtype(dtype, device) != want:
            raise SettingError("prec", prec, "{prec} with {dtype} is contradictory (drop one)", settings={"dtype": dtype})
        return prec, want, None
    dt = resolve_dtype(dtype, device)
    if prec is None:
        return ("f32" if dt == torch.float32 else "bf16"), dt, None
    from memra_cli.engine.quant.precision import weight_fn_for

    return prec, dt, weight_fn_for(prec)



def load_drafter(census: Census, *, prec: str | None, dtype: str, device: str):
    """A drafter alone, for `parity`: (drafter, precision policy, torch dtype, device). A GGUF is
    judged under the policy it was written with."""
    dev = resolve_device(device)
    if census.checkpoint_format == "gguf":
        prec = gguf_policy(prec, Path(census.path))
    policy, dt, weight_fn = resolve_precision(prec, dtype, dev)
    return drafter_class(census).load(census.path, dtype=dt, device=dev, census=census, weight_fn=weight_fn), policy, dt, dev


def drafter_class(census: Census):
    """The drafter model of a census: Gemma 4 layers (DeepSpec's Gemma4DSparkModel) or Qwen3 ones."""
    if census.config.backbone == "gemma4":
        from memra_cli.engine.models.drafter_gemma4 import Gemma4Drafter

        return Gemma4Drafter
    from memra_cli.engine.models.drafter import Drafter

    return Drafter


# --------------------------------------------------------------------------- the engine


def _threads_for(cfg: "EngineConfig", dev: torch.device):
    """(the target's checkpoint, opened once here when the thread policy reads its size, else None;
    the thread choice). A checkpoint that does not open leaves the size unknown: the load refuses
    it next, in its own words."""
    ckpt, params = None, None
    if needs_size(cfg.threads, dev.type, cfg.env):
        try:
            ckpt = open_checkpoint(Path(cfg.target))
            params = checkpoint_params(ckpt)
        except MemraError:
            ckpt = None
    return ckpt, thread_choice(cfg.threads, dev.type, params, source=cfg.threads_source, env=cfg.env)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how the target runs (raw setting values, as a user gives them)."""

    target: Path
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | bfloat16
    step_width: str | None = None  # "N" | "variable"; None: the default (16)
    cuda_graphs: bool | None = None  # None: on with CUDA and a fixed step width
    env: dict = field(default_factory=dict)  # MEMRA_DRAFT_GRAPHS, MEMRA_KERNELS, as read from the environment
    kernels: bool | None = None  # fused Triton step ops; None: on with CUDA (MEMRA_KERNELS=0 turns them off)
    pool_idle_bytes: int | None = DEFAULT_IDLE_BUDGET
    threads: int | None = None  # CPU threads per op as requested; None: the policy decides (engine/threads.py)
    threads_source: str = "--threads"  # how the threads note names a requested count (the front end's flag or variable)


@dataclass(frozen=True)
class ArmConfig:
    """A speculative program request: a drafter and the policy settings that shape its rounds."""

    draft: Path | None = None
    mode: str = "auto"  # off | dflash | dspark | auto
    settings: PolicySettings = field(default_factory=PolicySettings)
    markov: bool | None = None
    verify_cap: str | int | None = None
    prec: str | None = None
    emb_scale: bool | None = None  # block embedding times the target's embed_scale (None/False: raw)
    draft_vocab: Path | None = None  # a JSON of token ids the drafts are restricted to (spec/draft_vocab.py)


@dataclass
class Arm:
    """A resolved, loaded program: receipts, the drafter, what each session needs. `mode` is
    `off` for plain decoding (then everything else is empty)."""

    mode: str
    receipts: Receipts | None = None
    program: Program | None = None
    drafter: object = None
    taps: tuple[int, ...] = ()
    census: Census | None = None
    precision: str | None = None  # the drafter's weight precision, when one was applied
    precision_source: str | None = None
    warnings: list[str] = field(default_factory=list)
    load_ms: float | None = None  # drafter load and one-time set-up (the markov bias table), outside any session


class Engine:
    """A loaded target with its step runner and storage pool; makes arms and sessions."""

    def __init__(self, target, runner: StepRunner, device: torch.device, dtype: torch.dtype,
                 notes: list[str], draft_graphs: bool, round_graphs: bool = False, pipelined: bool | None = None):
        self.target, self.runner = target, runner
        self.device, self.dtype = device, dtype
        self.notes = notes  # what was applied (step width, graphs), for receipts / --json
        self.draft_graphs = draft_graphs
        self.round_graphs = round_graphs  # whole greedy rounds as one graph (spec/session.py)
        # rounds queued one ahead of the host (spec/chained.py)
        self.pipelined = round_graphs if pipelined is None else pipelined
        self.plain_only = False  # made by `fastest_plain`: only plain (one-row) decoding runs here
        # the CPU thread policy's choice for this target on this device; a front end applies it
        self.threads = ThreadChoice(None, None)

    @property
    def pool(self) -> StoragePool:
        return self.runner.pool

    @property
    def step_width(self) -> int | None:
        return self.runner.width

    @property
    def cuda_graphs(self) -> bool:
        return self.runner.cuda_graphs

    @classmethod
    def load(cls, cfg: EngineConfig) -> "Engine":
        width, width_note = resolve_step_width(cfg.step_width)
        dev = resolve_device(cfg.device)
        dt = resolve_dtype(cfg.dtype, dev)
        family = target_family(Path(cfg.target))  # config.json only: graphs are settled before any weight loads
        check_width_fits(width, Path(cfg.target))
        graphs, draft_graphs, graphs_note = resolve_cuda_graphs(cfg.cuda_graphs, dev, width, cfg.env, family)
        round_graphs, round_note = resolve_round_graphs(graphs, cfg.env)
        pipelined, pipe_note = resolve_pipeline(round_graphs, cfg.env)
        for note in (round_note, pipe_note):
            if note:
                graphs_note += f", {note}"
        ops, ops_note = select_step_ops(dev, cfg.kernels, cfg.env)
        if family.step_ops_used and ops.name != "torch":  # a family that takes only some of the seam's ops
            ops_note += f"; this target uses only {family.step_ops_used}"
        ckpt, threads = _threads_for(cfg, dev)
        target = family.from_dir(Path(cfg.target), dtype=dt, device=dev, checkpoint=ckpt)
        target.step_ops = ops
        runner = StepRunner(target, width, graphs, StoragePool(cfg.pool_idle_bytes))
        engine = cls(target, runner, dev, dt, [width_note, graphs_note, ops_note], draft_graphs, round_graphs, pipelined)
        engine.threads = threads
        return engine

    @classmethod
    def from_model(cls, model, *, step_width: int | None = None, cuda_graphs: bool = False,
                   draft_graphs: bool = False, pool: StoragePool | None = None,
                   round_graphs: bool = False) -> "Engine":
        """An engine around an already-loaded model (tests, benchmarks, a server that loads
        weights itself). Settings are typed here: `step_width` an int or None (variable)."""
        if draft_graphs and not cuda_graphs:
            raise SettingError("draft_graphs", True, "needs the target's CUDA graphs on", quote=False)
        runner = StepRunner(model, step_width, cuda_graphs, pool)
        notes = [f"target steps: {step_width if step_width else 'variable'} rows", f"CUDA graphs {'on' if cuda_graphs else 'off'}"]
        if round_graphs and not cuda_graphs:
            raise SettingError("round_graphs", True, "needs the target's CUDA graphs on", quote=False)
        return cls(model, runner, model.device, model.dtype, notes, draft_graphs, round_graphs)

    @property
    def steps(self) -> str:
        """How this engine's target steps run, in words (`describe_steps`)."""
        return describe_steps(self.step_width, self.cuda_graphs, self.plain_only)

    def fastest_plain(self) -> "Engine":
        """An engine for the fastest plain decoding this device offers, over the same loaded
        target (no second load, same step ops): for a bench's speed baseline, not for exactness.

        - CUDA, a family that can be captured: one-row steps replayed as CUDA graphs (a plain
          step is one row, and a graph makes the launch-bound step one launch);
        - otherwise (CPU; a family that cannot be captured): variable-width eager steps, one row
          per plain step. On the 2-core dev CPU that ran faster than a fixed one-row step, whose
          torch attention covers the whole storage under a mask, and than 16 rows.

        Its steps are not the fixed-width ones, so in bf16 its stream may differ from this
        engine's. It has its own storage pool: a state's graphs are keyed by storage and taps,
        not by width, so two runners of different widths must not share storages."""
        graphs = self.device.type == "cuda" and self.target.supports_cuda_graphs
        if graphs:  # rope tables at their largest for both runners before the new one captures
            self.target.ensure_positions(self.runner.max_rows())
        plain = Engine.from_model(self.target, step_width=1 if graphs else None, cuda_graphs=graphs,
                                  pool=StoragePool(self.pool.idle_budget), round_graphs=graphs and self.round_graphs)
        plain.pipelined = plain.round_graphs and self.pipelined
        plain.plain_only = True
        return plain

    def check_prompt(self, prompt_ids: Sequence[int], max_new: int) -> None:
        self.runner.check_prompt(list(prompt_ids), max_new)

    def resolve(self, arm: ArmConfig) -> tuple[str, Census | None, Program | None, Receipts | None, list[str]]:
        """Headers only: the mode (`auto` resolved), census, program, receipts of an arm and the
        pair check's warnings (the pair is refused here, before any weight loads)."""
        mode = arm.mode
        if mode not in SPEC_MODES:
            raise SettingError("spec", mode, f"expected {'|'.join(SPEC_MODES)}", quote=False)
        if mode == "off" or (mode == "auto" and arm.draft is None):
            return "off", None, None, None, []
        if arm.draft is None:
            raise PolicyError(f"--spec {mode} needs a drafter (--draft)")
        census = take_census(Path(arm.draft))
        from memra_cli.engine.spec.priced import step_cost_of

        program, receipts, mode = resolve_program(mode, census, arm.settings, arm.markov, arm.verify_cap,
                                                  step_cost_of(self.target))
        warnings = check_pair(self.target, census)
        program, receipts = self._block_embedding(arm.emb_scale, program, receipts, census)
        return mode, census, program, receipts, warnings

    def _block_embedding(self, setting: bool | None, program: Program, receipts: Receipts,
                         census: Census) -> tuple[Program, Receipts]:
        """The arm's `emb_scale` resolved against the loaded target: its `embed_scale` rounded to
        the model dtype (the multiplier a scaling family's own embedding applies), or raw. A Gemma
        4 DSpark drafter's format fixes it: its own embedding is the √hidden-scaled one."""
        scale = float(torch.tensor(self.target.embed_scale, dtype=self.dtype))
        recorded = "Gemma4DSparkModel's own embedding is scaled" if census.config.backbone == "gemma4" else None
        embedding = resolve_block_embedding(setting, scale, recorded)
        return (dataclasses.replace(program, emb_scale=embedding.scale),
                dataclasses.replace(receipts, embedding=embedding))

    def arm(self, arm: ArmConfig, drafter=None) -> Arm:
        """Resolve and check an arm, then load its drafter (unless `drafter` is given: one
        loaded drafter may serve several arms of a bench)."""
        mode, census, program, receipts, pair_warnings = self.resolve(arm)
        if mode == "off":
            return Arm("off")
        warnings = list(census.warnings) + pair_warnings
        vocab_ids = None if arm.draft_vocab is None else \
            read_vocab_ids(arm.draft_vocab, int(self.target.lm_head_weight.shape[0]))  # refused before any load
        weight_fn, precision, source = drafter_precision(arm.prec, arm.draft)
        started = time.perf_counter()
        if drafter is None:
            drafter = drafter_class(census).load(Path(arm.draft), self.dtype, self.device, census=census,
                                                 weight_fn=weight_fn)
        # the drafter runs the fused ops its target runs (Triton kernels on CUDA by default)
        drafter.step_ops = self.target.step_ops
        if vocab_ids is not None:  # the subset's head rows (and chain weights) are copied once, here
            vocab = DraftVocab(vocab_ids, self.target, drafter, program.markov, str(arm.draft_vocab))
            program = dataclasses.replace(program, vocab=vocab)
            receipts = dataclasses.replace(receipts, vocab=vocab)
        if program.markov:  # the chain's bias table belongs to loading, not to the first round
            if program.vocab is not None:
                program.vocab.prepare_markov(drafter)
            else:
                drafter.prepare_markov()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        load_ms = 1e3 * (time.perf_counter() - started)
        warnings += own_table_warnings(drafter, self.target)
        warnings += [f"drafter tensor '{d.name}' {d.why}" for d in getattr(weight_fn, "kept", [])]
        DrafterProposer(drafter, self.target, program)  # refuses a program the drafter cannot run
        return Arm(mode, receipts, program, drafter, tuple(census.config.target_layer_ids), census,
                   precision, source, warnings, load_ms)

    def session(self, prompt_ids: Sequence[int], max_new: int, arm: Arm | None = None, *,
                sampler: Sampler = GREEDY, timed: bool = False, eos_ids: Sequence[int] | None = None) -> Session:
        """An unprimed Session for one prompt (plain decoding without an arm). Each session gets
        its own proposer and draft cache: sessions of one engine may run interleaved."""
        eos = self.target.cfg.eos_token_ids if eos_ids is None else tuple(eos_ids)
        if arm is None or arm.mode == "off":
            return Session(self.runner, prompt_ids, max_new, eos_ids=eos, sampler=sampler, timed=timed,
                           round_graphs=self.round_graphs, pipelined=self.pipelined)
        proposer = DrafterProposer(arm.drafter, self.target, arm.program, graphs=self.draft_graphs, pool=self.pool,
                                   sampler=sampler)
        return Session(self.runner, prompt_ids, max_new, proposer=proposer, program=arm.program, taps=arm.taps,
                       eos_ids=eos, sampler=sampler, timed=timed, round_graphs=self.round_graphs,
                       pipelined=self.pipelined)
