"""From user settings to a ready `Session`: resolve the program, load and check the pair.

`prepare` is the one entry `memra generate` calls; `memra bench` uses its parts (`resolve_spec`,
`load_setup`, `Setup.session`) to load each arm once and make a Session per prompt. Every
mismatch between a drafter and its target is refused with a message that names both sides.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from memra_cli.engine.formats.census import Census, take_census
from memra_cli.engine.errors import ConfigError, MemraError, PolicyError
from memra_cli.engine.spec.policy import (
    LADDER, MARKOV_ENV, VT_ENV, PolicySettings, Receipts, adapt_on, parse_verify_cap, resolve_receipts,
)
from memra_cli.engine.spec.session import DrafterProposer, Program, Session, SpecError

log = logging.getLogger(__name__)
SPEC_MODES = ("off", "dflash", "dspark", "auto")


class DeviceError(MemraError):
    """A device or dtype that this machine cannot provide."""


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; `cuda` without CUDA refuses."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise DeviceError(f"--device {device}: expected auto|cpu|cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise DeviceError(f"--dtype {dtype}: expected auto|float32|bfloat16")
    return table[dtype]


DEFAULT_STEP_WIDTH = 16  # the block size of every published DFlash / DSpark drafter


def resolve_step_width(value: str | None) -> tuple[int | None, str]:
    """`--step-width` / MEMRA_STEP_WIDTH -> (rows per target step or None, what was applied).

    `N` (default 16): every decode and verify step runs at N rows (Qwen3Target.step_logits), so
    speculative output equals plain greedy bit for bit in any dtype; `variable`: each step at its
    own width (plain decode one row), exact only as far as the kernels happen to be."""
    if value is None:
        return DEFAULT_STEP_WIDTH, f"target steps: {DEFAULT_STEP_WIDTH} rows (default; --step-width)"
    text = value.strip().lower()
    if text == "variable":
        return None, "target steps: variable width (--step-width variable; bf16 output may differ from plain greedy)"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--step-width {value!r}: expected a positive integer (rows per target step) or 'variable'")
    return int(text), f"target steps: {int(text)} rows (--step-width)"


DRAFT_GRAPHS_ENV = "MEMRA_DRAFT_GRAPHS"


def resolve_cuda_graphs(flag: bool | None, device: torch.device, width: int | None,
                        env: dict[str, str] | None = None) -> tuple[bool, bool, str]:
    """`--cuda-graphs/--no-cuda-graphs` (MEMRA_CUDA_GRAPHS) -> (target steps graphed, drafter
    rounds graphed, what was applied). Unset: on exactly when the target runs fixed-width steps on
    CUDA (a graph replays fixed shapes). Drafter rounds are graphed only with MEMRA_DRAFT_GRAPHS=1
    (experimental: docs/perf.md)."""
    possible = device.type == "cuda" and width is not None
    draft_env = (env or {}).get(DRAFT_GRAPHS_ENV, "")
    if draft_env not in ("", "0", "1"):
        raise ConfigError(f"{DRAFT_GRAPHS_ENV}={draft_env!r}: expected 0 or 1")
    if flag is None:
        why = "on CUDA with fixed-width steps" if possible else (
            "not on CUDA" if device.type != "cuda" else "variable-width steps")
        on, note = possible, f"CUDA graphs {'on' if possible else 'off'} (default: {why}; --cuda-graphs)"
    else:
        if flag and not possible:
            raise ConfigError(f"--cuda-graphs needs --device cuda and a fixed --step-width (device {device}, "
                              f"step width {'variable' if width is None else width})")
        on, note = flag, f"CUDA graphs {'on' if flag else 'off'} (--cuda-graphs)"
    if draft_env == "1" and not on:
        raise ConfigError(f"{DRAFT_GRAPHS_ENV}=1 needs the target's CUDA graphs on ({note})")
    drafter = on and draft_env == "1"
    if on:
        note += ", drafter rounds graphed (MEMRA_DRAFT_GRAPHS=1, experimental)" if drafter else \
            ", drafter rounds eager (MEMRA_DRAFT_GRAPHS=1 graphs them, experimental)"
    return on, drafter, note


def resolve_program(mode: str, census: Census, settings: PolicySettings, markov: bool | None,
                    verify_cap: str | int | None) -> tuple[Program, Receipts, str]:
    """The spec mode (`auto` resolved) -> Program + receipts. `dflash` = parallel drafting
    only (markov off, ladder window); `dspark` = the census-keyed DSpark program."""
    if mode not in SPEC_MODES:
        raise PolicyError(f"--spec {mode}: expected {'|'.join(SPEC_MODES)}")
    if mode == "auto":
        mode = "dspark" if census.strategy_dspark else "dflash"
    receipts = resolve_receipts(settings, census.strategy_dspark, census.confidence is not None)
    window = receipts.window
    if mode == "dflash":
        if receipts.window_set and window.is_confidence:
            raise PolicyError(f"{VT_ENV}={settings.vt} with --spec dflash: the dflash program runs the ladder window; use --spec dspark")
        if markov:
            raise PolicyError(f"{MARKOV_ENV}=1 with --spec dflash: the dflash program drafts in parallel (markov off); use --spec dspark")
        if window.is_confidence:
            receipts = dataclasses.replace(receipts, window=LADDER, window_note="--spec dflash -> ladder")
        window, markov_on = LADDER, False
    else:
        if markov and census.markov is None:
            raise PolicyError(f"{MARKOV_ENV}=1: {census.path} has no markov head")
        markov_on = census.markov is not None if markov is None else markov
        if window.is_confidence and census.confidence is None:
            raise SpecError(f"verify-window {window} needs a checkpoint with an accept-rate head (confidence_head.* absent in {census.path})")
    b = census.config.block_size
    cap = parse_verify_cap(verify_cap, receipts.harvest.n_drafts(b))
    program = Program(receipts.harvest, window, markov_on, cap, adapt_on(settings.adapt), b)
    return program, receipts, mode


def check_pair(target, census: Census) -> None:
    """Refuse a drafter that cannot condition on this target."""
    cfg, tcfg = census.config, target.cfg
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


def own_table_warnings(drafter, target) -> list[str]:
    """DeepSpec exports carry copies of the target's embed_tokens / lm_head; the engine uses the
    target's. Say so by name when the copies differ (the drafter was trained on another target)."""
    out = []
    for name, own, theirs in (("embed_tokens.weight", drafter.own_embed, target.embed_weight),
                              ("lm_head.weight", drafter.own_lm_head, target.lm_head_weight)):
        if own is None:
            continue
        if own.shape != theirs.shape or not torch.equal(own.float().cpu(), theirs.float().cpu()):
            out.append(f"drafter tensor '{name}' differs from the target's; memra uses the target's")
    return out


@dataclass(frozen=True)
class Resolved:
    """A speculative request resolved against its drafter's census (headers only, nothing loaded)."""

    draft_path: Path
    census: Census
    program: Program
    receipts: Receipts
    mode: str  # "dflash" | "dspark" (auto resolved)


def resolve_spec(target, *, draft_path: Path | None, mode: str, settings: PolicySettings,
                 markov: bool | None = None, verify_cap: str | int | None = None) -> Resolved | None:
    """Mode + settings + drafter census -> the program, checked against the target.

    None means plain greedy (`off`, or `auto` without a drafter)."""
    if mode not in SPEC_MODES:
        raise PolicyError(f"--spec {mode}: expected {'|'.join(SPEC_MODES)}")
    if mode == "off" or (mode == "auto" and draft_path is None):
        return None
    if draft_path is None:
        raise PolicyError(f"--spec {mode} needs a drafter (--draft)")
    census = take_census(Path(draft_path))
    program, receipts, mode = resolve_program(mode, census, settings, markov, verify_cap)
    check_pair(target, census)
    return Resolved(Path(draft_path), census, program, receipts, mode)


def default_drafter_loader(target, weight_fn=None):
    """(path, census) -> Drafter in the target's dtype, on its device."""
    from memra_cli.engine.models.drafter import Drafter

    return lambda path, c: Drafter.load(path, target.dtype, target.device, census=c, weight_fn=weight_fn)


@dataclass
class Setup:
    """A loaded, checked decoding setup; `session()` makes one Session per prompt from it
    without reloading the drafter. Each session gets its own proposer (and so its own draft
    cache): sessions from one Setup may run interleaved."""

    target: object
    mode: str
    eos_ids: tuple[int, ...]
    receipts: Receipts | None = None
    warnings: list[str] = field(default_factory=list)
    program: Program | None = None
    proposer: DrafterProposer | None = None
    taps: tuple[int, ...] = ()

    def session(self, prompt_ids: Sequence[int], max_new: int, *, timed: bool = False) -> Session:
        proposer = None
        if self.proposer is not None:
            proposer = DrafterProposer(self.proposer.drafter, self.target, self.proposer.program)
        return Session(self.target, prompt_ids, max_new, proposer=proposer, program=self.program,
                       taps=self.taps, eos_ids=self.eos_ids, timed=timed)


def load_setup(target, resolved: Resolved | None, *, drafter_loader=None,
               eos_ids: Sequence[int] | None = None) -> Setup:
    """Load the drafter of a resolved request (or nothing, for plain greedy) and build its proposer."""
    eos = target.cfg.eos_token_ids if eos_ids is None else tuple(eos_ids)
    if resolved is None:
        return Setup(target, "off", tuple(eos))
    load = drafter_loader or default_drafter_loader(target)
    drafter = load(resolved.draft_path, resolved.census)
    warnings = list(resolved.census.warnings) + own_table_warnings(drafter, target)
    proposer = DrafterProposer(drafter, target, resolved.program)
    return Setup(target, resolved.mode, tuple(eos), resolved.receipts, warnings, resolved.program,
                 proposer, tuple(resolved.census.config.target_layer_ids))


@dataclass
class Prepared:
    session: Session
    receipts: Receipts | None
    mode: str
    warnings: list[str]


def prepare(target, prompt_ids: Sequence[int], max_new: int, *, draft_path: Path | None, mode: str,
            settings: PolicySettings, markov: bool | None = None, verify_cap: str | int | None = None,
            timed: bool = False, drafter_loader=None, eos_ids: Sequence[int] | None = None) -> Prepared:
    """Resolve, load and check; returns an unprimed Session (plain when mode is off).

    Order of refusals: program and pair first, then the prompt, then the (slow) drafter load."""
    resolved = resolve_spec(target, draft_path=draft_path, mode=mode, settings=settings,
                            markov=markov, verify_cap=verify_cap)
    target.check_prompt(list(prompt_ids), max_new)
    setup = load_setup(target, resolved, drafter_loader=drafter_loader, eos_ids=eos_ids)
    return Prepared(setup.session(prompt_ids, max_new, timed=timed), setup.receipts, setup.mode, setup.warnings)
