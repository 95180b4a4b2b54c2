"""Harvest convention and verify-window policy: resolution, window sizing, accepted prefix.

The behavioural contract is the reference engine's `DsparkHarvest` / `DsparkVtPolicy` and their unit tests (docs/architecture.md)
(`tests/engine/test_policy.py` pins every case they pin). Settings come from a CLI flag or its
environment variable (one setting: typer `envvar=`); `None` or "" means unset. Unknown values,
a `tau` (the confidence threshold) outside (0, 1) and contradictions refuse with a `SettingError` naming the setting
(`vt='static': ...`); the CLI names the flag or the variable that carried it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from memra_cli.engine.errors import SettingError

HARVEST_ENV = "MEMRA_DSPARK_HARVEST"
VT_ENV = "MEMRA_DSPARK_VT"
VT_COST_ENV = "MEMRA_DSPARK_VT_COST"
TAU_ENV = "MEMRA_DSPARK_VT_TAU"
ADAPT_ENV = "MEMRA_DFLASH_ADAPT"
VERIFY_CAP_ENV = "MEMRA_DFLASH_VERIFY_T"
MARKOV_ENV = "MEMRA_DFLASH_MARKOV"
EMB_SCALE_ENV = "MEMRA_DFLASH_EMB_SCALE"
DEFAULT_THRESHOLD = 0.5  # the confidence windows' threshold when the `tau` setting is unset
VT_CHOICES = ("ladder", "confidence", "confidence-slot", "priced")
VT_COST_CHOICES = ("shape", "routed")  # the priced window's cost model (spec/priced.py)


class Harvest(str, Enum):
    """Which drafter output rows become draft candidates.

    DFLASH (mask-fill, z-lab): row k is trained to fill position anchor+k; drafts = rows 1..b-1.
    DSPARK (shifted, DeepSpec): row k is trained to predict anchor+k+1; drafts = rows 0..b-1.
    Reading a checkpoint through the other convention verifies every slot against a position its
    row was never trained for (the reference engine's postmortem: acceptance collapses).
    """

    DFLASH = "dflash"
    DSPARK = "dspark"

    @property
    def first_row(self) -> int:
        return 1 if self is Harvest.DFLASH else 0

    def n_drafts(self, block_size: int) -> int:
        return block_size - 1 if self is Harvest.DFLASH else block_size

    def trained_offset_of_row(self, row: int) -> int:
        return row if self is Harvest.DFLASH else row + 1

    @classmethod
    def from_name(cls, value: str) -> "Harvest | None":
        try:
            return cls(value)
        except ValueError:
            return None


def _unset(value: str | None) -> bool:
    return value is None or value == ""


def parse_harvest(value: str | None) -> Harvest:
    """Env-only parser (no census): unset -> DFLASH, the historical arm; unknown -> refuse."""
    if _unset(value):
        return Harvest.DFLASH
    harvest = Harvest.from_name(value)  # type: ignore[arg-type]
    if harvest is None:
        raise SettingError(
            "harvest", value, "unknown harvest convention (expected dflash|dspark); a wrong "
            "convention verifies every draft slot against a position its row was not trained for"
        )
    return harvest


def resolve_harvest(value: str | None, strategy_dspark: bool) -> Harvest:
    """Explicit setting wins; unset defers to the checkpoint's training-strategy census."""
    if _unset(value):
        return Harvest.DSPARK if strategy_dspark else Harvest.DFLASH
    return parse_harvest(value)


@dataclass(frozen=True)
class VerifyWindow:
    """A verify-window policy: `ladder`, or a confidence policy with its `threshold` on the slots'
    sigmoid scores (the `tau` setting, `--tau`; receipts write it `{tau=...}` as the reference
    engine does). Not the acceptance length tau of the stats (committed tokens per round)."""

    kind: str  # "ladder" | "confidence" | "confidence-slot" | "priced"
    threshold: float | None = None
    cost: object | None = None  # priced: the target's spec/priced.py StepCost (set at arm time)
    # priced: where the per-slot survival comes from, "confidence" (the head's raws, each round)
    # or "accepted-runs" (spec/priced.py `accepted_runs_survival`: a fit of the session's rounds)
    survival: str = "confidence"
    cost_model: str = "shape"  # priced: "shape" (independent routing) | "routed" (each prompt's measured union)

    @property
    def is_confidence(self) -> bool:
        """Sized each round from the confidence head's raws (the drafter must have the head)."""
        return self.kind != "ladder" and not (self.kind == "priced" and self.survival == "accepted-runs")

    def __str__(self) -> str:
        if self.kind == "ladder":
            return "Ladder"
        if self.kind == "priced":
            c = self.cost
            extra = ("" if self.survival == "confidence" else f",survival={self.survival}") + (
                "" if self.cost_model == "shape" else f",cost={self.cost_model}")
            return f"Priced{{experts={c.num_experts},top_k={c.top_k}{extra}}}" if c is not None else "Priced"
        name = "Confidence" if self.kind == "confidence" else "ConfidenceSlot"
        return f"{name}{{tau={self.threshold!r}}}"

    def size_window(self, raws: Sequence[float], cap: int, cost=None) -> int | None:
        """This round's window from pre-sigmoid slot scores; None when it is carried between
        rounds (`next_window`). `cost`: a session's own StepCost (the routed model), else the arm's."""
        if not self.is_confidence:
            return None
        assert self.threshold is not None
        if self.kind == "confidence":
            return confidence_vt(raws, self.threshold, cap)
        if self.kind == "priced":
            from memra_cli.engine.spec.priced import priced_vt, survival_from_raws

            return priced_vt(survival_from_raws(raws), cost or self.cost, cap)  # type: ignore[arg-type]
        return slot_confidence_vt(raws, self.threshold, cap)

    def next_window(self, accepted: int, cap: int, cost=None, runs: tuple[int, int] = (0, 0)) -> int:
        """The carried window after a round that accepted `accepted` drafts: the ladder's
        `clamp(m + 2, 3, cap)`, or the priced window over the survival fitted to the session's
        `runs` so far (drafts accepted, rounds that rejected one). The first round's is
        `next_window(cap - 2, cap)` (the ladder opens at the cap; no runs yet). Confidence windows
        carry the ladder's (unused: they size each round from the raws)."""
        if self.kind == "priced" and self.survival == "accepted-runs":
            from memra_cli.engine.spec.priced import accepted_runs_survival, priced_vt

            return priced_vt(accepted_runs_survival(*runs, cap - 1), cost or self.cost, cap)  # type: ignore[arg-type]
        return ladder_next(accepted, cap)


LADDER = VerifyWindow("ladder")


_ADAPT_ON = ("1", "true", "yes", "on")
_ADAPT_OFF = ("0", "false", "no", "off")


def adapt_on(adapt: str | None) -> bool:
    """Whether the window adapts per round (validates the value)."""
    return not _adapt_off(adapt)


def _adapt_off(adapt: str | None) -> bool:
    """`MEMRA_DFLASH_ADAPT`: 0/false/no/off pins the window; unset or 1/true/yes/on adapts."""
    if _unset(adapt) or adapt.lower() in _ADAPT_ON:  # type: ignore[union-attr]
        return False
    if adapt.lower() in _ADAPT_OFF:  # type: ignore[union-attr]
        return True
    raise SettingError("adapt", adapt, "expected 0 or 1")


def _parse_threshold(tau: str | None) -> float:
    """The `tau` setting as the confidence threshold (unset: `DEFAULT_THRESHOLD`)."""
    if _unset(tau):
        return DEFAULT_THRESHOLD
    try:
        value = float(tau)  # type: ignore[arg-type]
    except ValueError:
        raise SettingError("tau", tau, "not a number (expected a threshold in (0,1))") from None
    if not (0.0 < value < 1.0) or math.isnan(value):
        raise SettingError("tau", tau, "confidence threshold must be in (0,1)")
    return value


def _parse_vt_cost(vt: str | None, vt_cost: str | None) -> str:
    """The priced window's cost model: unset -> shape; unknown, or set for another window -> refuse."""
    if _unset(vt_cost):
        return "shape"
    if vt_cost not in VT_COST_CHOICES:
        raise SettingError("vt_cost", vt_cost, f"unknown step-cost model (expected {'|'.join(VT_COST_CHOICES)})")
    if vt != "priced":
        raise SettingError("vt_cost", vt_cost, "{vt_cost} prices the priced window only; set {vt=priced}",
                           settings={"vt": vt})
    return vt_cost


def parse_verify_window(vt: str | None, tau: str | None, adapt: str | None, vt_cost: str | None = None) -> VerifyWindow:
    """Env-only parser (no head census): unset -> ladder; unknown or contradictory -> refuse."""
    adapt_off = _adapt_off(adapt)
    cost_model = _parse_vt_cost(vt, vt_cost)
    if _unset(vt) or vt == "ladder":
        return LADDER
    if vt not in ("confidence", "confidence-slot", "priced"):
        raise SettingError("vt", vt, f"unknown verify-window policy (expected {'|'.join(VT_CHOICES)})")
    if adapt_off:
        raise SettingError(
            "vt", vt, "{vt} together with {adapt} is contradictory (a pinned fixed window vs "
            "a per-round confidence window); drop one", settings={"adapt": adapt},
        )
    return VerifyWindow(vt, _parse_threshold(tau), cost_model=cost_model)  # type: ignore[arg-type]


def resolve_verify_window(
    vt: str | None, tau: str | None, adapt: str | None, has_confidence_head: bool, vt_cost: str | None = None
) -> VerifyWindow:
    """Explicit setting wins; unset -> confidence-slot at the `tau` threshold when the checkpoint
    has an accept-rate head and adapt is not 0, else the ladder. A `tau` that is set is always validated
    (the reference engine ignores it on head-less checkpoints; we never let a bad value pass silently)."""
    if not _unset(tau):
        _parse_threshold(tau)
    _parse_vt_cost(vt, vt_cost)
    if _unset(vt):
        if _adapt_off(adapt) or not has_confidence_head:
            return LADDER
        return parse_verify_window("confidence-slot", tau, adapt)
    return parse_verify_window(vt, tau, adapt, vt_cost)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= -700 else 0.0


def confidence_vt(raws: Sequence[float], threshold: float, cap: int) -> int:
    """Survival window: keep leading slots while prod(sigmoid) >= threshold; 1 + kept in [2, cap]."""
    survival, kept = 1.0, 0
    for raw in raws:
        survival *= _sigmoid(raw)
        if survival < threshold:
            break
        kept += 1
    return min(max(1 + kept, 2), max(cap, 2))


def slot_confidence_vt(raws: Sequence[float], threshold: float, cap: int) -> int:
    """Per-slot window: keep leading slots while each sigmoid >= threshold; 1 + kept in [2, cap]."""
    kept = 0
    for raw in raws:
        if _sigmoid(raw) < threshold:
            break
        kept += 1
    return min(max(1 + kept, 2), max(cap, 2))


def ladder_next(accepted: int, cap: int) -> int:
    """The reactive ladder: next round verifies one past this round's accepted run."""
    return min(max(accepted + 2, 3), cap)


def default_verify_cap(n_drafts: int) -> int:
    return n_drafts + 1


def parse_verify_cap(value: str | int | None, n_drafts: int) -> int:
    """`MEMRA_DFLASH_VERIFY_T` / `--verify-cap`: an integer in [2, n_drafts+1]; unset -> n_drafts+1."""
    if value is None or value == "":
        return default_verify_cap(n_drafts)
    try:
        cap = int(value)
    except ValueError:
        raise SettingError("verify_cap", value, "not an integer") from None
    if not 2 <= cap <= n_drafts + 1:
        raise SettingError("verify_cap", value, f"verify cap must be in [2, {n_drafts + 1}] "
                           f"(anchor + at most {n_drafts} drafts)")
    return cap


@dataclass(frozen=True)
class PolicySettings:
    """Raw settings as given (flag or env), before resolution against a checkpoint."""

    harvest: str | None = None
    vt: str | None = None
    tau: str | None = None
    adapt: str | None = None
    vt_cost: str | None = None  # the priced window's cost model

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "PolicySettings":
        return cls(env.get(HARVEST_ENV), env.get(VT_ENV), env.get(TAU_ENV), env.get(ADAPT_ENV), env.get(VT_COST_ENV))


@dataclass(frozen=True)
class BlockEmbedding:
    """How an arm's drafter embeds its block: the target's raw embedding rows (the default, as
    the reference engine) or those rows times the target's `embed_scale` (Gemma's √hidden). A
    z-lab checkpoint does not record which its drafter was trained with (docs/formats.md)."""

    scaled: bool
    scale: float  # the multiplier applied (1.0 when raw), rounded to the model dtype
    set: bool  # the `emb_scale` setting was given (flag or MEMRA_DFLASH_EMB_SCALE)
    recorded: str | None = None  # the drafter's format fixes it (why), rather than the setting

    def line(self, tag: str) -> str:
        if self.recorded:
            return f"[{tag}] block-embedding=scaled x{self.scale:g} (the target's embed_scale; {self.recorded})"
        src = "set" if self.set else "unset: the reference engine's default"
        what = f"scaled x{self.scale:g} (the target's embed_scale)" if self.scaled else "raw (the target's embedding rows)"
        return f"[{tag}] block-embedding={what} ({EMB_SCALE_ENV} {src})"

    def as_json(self) -> dict:
        out = {"scaled": self.scaled, "scale": self.scale, "set": self.set}
        return out if self.recorded is None else {**out, "recorded": self.recorded}


def resolve_block_embedding(setting: bool | None, target_scale: float, recorded: str | None = None) -> BlockEmbedding:
    """The `emb_scale` setting against a target: scaled by `target_scale` (already rounded to the
    model dtype) when set on, raw otherwise. `recorded`: the drafter's format fixes a scaled
    embedding (why, in words); the setting may then only agree."""
    if recorded is not None:
        if setting is False:
            raise SettingError("emb_scale", False, f"this drafter's block embedding is scaled ({recorded})",
                               quote=False)
        return BlockEmbedding(True, target_scale, setting is not None, recorded)
    scaled = bool(setting)
    return BlockEmbedding(scaled, target_scale if scaled else 1.0, setting is not None)


@dataclass(frozen=True)
class Receipts:
    """The resolved program, named at load, and why."""

    harvest: Harvest
    harvest_set: bool
    strategy_dspark: bool
    window: VerifyWindow
    window_set: bool
    has_confidence_head: bool
    cost_set: bool = False  # the priced window's cost model was given (`vt_cost`)
    window_note: str | None = None  # e.g. why a program overrode the resolved window
    program: str | None = None  # the program that runs ("dflash" | "dspark"); None: what auto would pick
    embedding: BlockEmbedding | None = None  # an arm's block embedding (None where no target is loaded)
    vocab: object | None = None  # an arm's DraftVocab (spec/draft_vocab.py), when its drafts take a subset

    @property
    def tag(self) -> str:
        """The receipts' prefix: the program they describe (a census or a quantize names the one
        `--spec auto` would run: dspark for a DSpark-class checkpoint, else dflash)."""
        return self.program or ("dspark" if self.strategy_dspark else "dflash")

    def lines(self) -> list[str]:
        h_src = "set" if self.harvest_set else "unset"
        # without the head the window is the ladder, or the priced one fitted to the accepted runs
        head = "present" if self.has_confidence_head else "ABSENT" if self.window.kind == "priced" else "ABSENT -> ladder"
        w_src = "set" if self.window_set else "unset"
        note = f", {self.window_note}" if self.window_note else ""
        return [
            f"[{self.tag}] harvest={self.harvest.value} (checkpoint census "
            f"strategy_dspark={str(self.strategy_dspark).lower()}, {HARVEST_ENV} {h_src})",
            f"[{self.tag}] verify-window={self.window} (accept-rate head {head}, {VT_ENV} {w_src}{note})",
        ] + ([self.embedding.line(self.tag)] if self.embedding is not None else []) \
          + ([self.vocab.line(self.tag)] if self.vocab is not None else [])

    def as_json(self) -> dict:
        out = {
            "harvest": self.harvest.value,
            "verify_window": {"policy": self.window.kind, "tau": self.window.threshold},
        }
        if self.window.kind == "priced":
            out["verify_window"].update(survival=self.window.survival, cost_model=self.window.cost_model)
        if self.embedding is not None:
            out["block_embedding"] = self.embedding.as_json()
        if self.vocab is not None:
            out["draft_vocab"] = self.vocab.as_json()
        return out


def resolve_receipts(settings: PolicySettings, strategy_dspark: bool, has_confidence_head: bool) -> Receipts:
    """Resolve both settings against a checkpoint's census; refuses as the reference engine does."""
    return Receipts(
        harvest=resolve_harvest(settings.harvest, strategy_dspark),
        harvest_set=not _unset(settings.harvest),
        strategy_dspark=strategy_dspark,
        window=resolve_verify_window(settings.vt, settings.tau, settings.adapt, has_confidence_head, settings.vt_cost),
        window_set=not _unset(settings.vt),
        has_confidence_head=has_confidence_head,
        cost_set=not _unset(settings.vt_cost),
    )
