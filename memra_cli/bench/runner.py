"""`memra bench`, the engine side: arm grammar, loading, interleaved runs, exactness gate, aggregates.

An arm is one decoding program, written `NAME[:key=value,...]` (see `parse_arm`). The bench loads
the target once and each distinct drafter (path, prec) once, warms every arm up on the first K
prompts (not counted), then runs every arm on every prompt, interleaved per prompt with the arm
order rotated by one each prompt (so slow drift — clocks, thermals, caches — spreads over all
arms). Two plain arms always run (greedy, or sampled with the same `SamplingParams` and seed):

- `off`: plain decoding through the engine's own steps (fixed width by default), the
  **exactness reference**: every speculative stream must equal it token for token, at any
  temperature (an arm with `accept=rejection` samples by rejection sampling, lossless in
  distribution only: it is measured, not gated);
- `plain`: the fastest plain decoding the device offers (`Engine.fastest_plain`: one-row steps,
  graphed on CUDA), over the same loaded target, the **speed baseline**: `speedup` is an arm's
  tok/s over plain's, `speedup_vs_off` over off's. Its stream is not gated (its steps are not the
  fixed-width ones); whether it equalled off's is counted, as information.

Speedups are ratios of tok/s within one run. Phase timers are on by default only where they cost
nothing (CPU: perf_counter); on CUDA they synchronize at every phase boundary, so they are opt-in.

Nothing here prints: `cli/bench.py` renders a `BenchResult`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from memra_cli.engine.errors import MemraError, SettingError
from memra_cli.engine.spec.policy import VT_CHOICES, VT_COST_CHOICES, PolicySettings, Receipts
from memra_cli.engine.spec.sampling import ACCEPTANCE_RULES, GREEDY

if TYPE_CHECKING:  # keyed loads torch: imported where a sampler is made
    from memra_cli.engine.spec.keyed import SamplingParams
from memra_cli.engine.stats import DecodeStats

ARM_NAMES = ("off", "plain", "dflash", "dspark", "auto")
PLAIN_MODES = ("off", "plain")  # the arms without a drafter: no acceptance, no tau histogram
from memra_cli.engine.quant.precision import POLICIES as PRECISIONS  # noqa: E402  (one list of names)
DEFAULT_ARMS = ("off", "dflash", "dspark")
EMBEDDED_DRAFTERS = ("dflash", "dspark")
ARM_KEYS = {
    "harvest": "dflash|dspark", "vt": "|".join(VT_CHOICES), "vt_cost": "|".join(VT_COST_CHOICES),
    "tau": "a float in (0,1)",
    "cap": "an integer >= 2", "adapt": "0|1", "markov": "0|1", "emb_scale": "0|1", "prec": "|".join(PRECISIONS),
    "draft": "PATH|dflash|dspark", "accept": "keyed|rejection",
    "vocab": "PATH",  # a draft vocabulary (spec/draft_vocab.py): greedy drafts only from its token ids
}
ARM_GRAMMAR = (
    "NAME[:key=value,...] with NAME off|plain|dflash|dspark|auto and keys "
    + ", ".join(f"{k}={v}" for k, v in ARM_KEYS.items())
)
POLICY_ENV = ("MEMRA_DSPARK_HARVEST", "MEMRA_DSPARK_VT", "MEMRA_DSPARK_VT_COST", "MEMRA_DSPARK_VT_TAU", "MEMRA_DFLASH_ADAPT",
              "MEMRA_DFLASH_VERIFY_T", "MEMRA_DFLASH_MARKOV", "MEMRA_DFLASH_EMB_SCALE")


class BenchError(MemraError):
    """A bench request that cannot run as asked (bad arm, missing drafter, no default pair)."""


# --------------------------------------------------------------------------- arm grammar


@dataclass(frozen=True)
class ArmSpec:
    """One parsed `--arm`. `name` is the spec string as given: the arm's display name."""

    name: str
    mode: str
    harvest: str | None = None
    vt: str | None = None
    vt_cost: str | None = None  # the priced window's cost model (shape|routed)
    tau: str | None = None
    cap: int | None = None
    adapt: bool | None = None
    markov: bool | None = None
    emb_scale: bool | None = None  # the block embedding times the target's embed_scale
    prec: str | None = None
    draft: str | None = None
    accept: str | None = None  # keyed (default) | rejection: the acceptance rule at temperature > 0
    vocab: str | None = None  # a draft vocabulary file (spec/draft_vocab.py)

    @property
    def settings(self) -> PolicySettings:
        adapt = None if self.adapt is None else ("1" if self.adapt else "0")
        return PolicySettings(harvest=self.harvest, vt=self.vt, tau=self.tau, adapt=adapt, vt_cost=self.vt_cost)


def _bad(spec: str, what: str) -> BenchError:
    return BenchError(f"--arm {spec!r}: {what} (grammar: {ARM_GRAMMAR})")


def _key_value(spec: str, key: str, value: str) -> object:
    """Validate one key=value of arm `spec`; returns the parsed value."""
    if key not in ARM_KEYS:
        raise _bad(spec, f"unknown key {key!r}")
    if value == "":
        raise _bad(spec, f"{key}= has no value (expected {ARM_KEYS[key]})")
    choices = {"harvest": ("dflash", "dspark"), "vt": VT_CHOICES, "vt_cost": VT_COST_CHOICES, "prec": PRECISIONS,
               "adapt": ("0", "1"), "markov": ("0", "1"), "emb_scale": ("0", "1"), "accept": ACCEPTANCE_RULES}
    if key in choices:
        if value not in choices[key]:
            raise _bad(spec, f"{key}={value} (expected {ARM_KEYS[key]})")
        return value == "1" if key in ("adapt", "markov", "emb_scale") else value
    if key == "tau":
        try:
            tau = float(value)
        except ValueError:
            raise _bad(spec, f"tau={value} is not a number (expected {ARM_KEYS['tau']})") from None
        if not 0.0 < tau < 1.0:
            raise _bad(spec, f"tau={value} is outside (0,1)")
        return value
    if key == "cap":
        try:
            cap = int(value)
        except ValueError:
            raise _bad(spec, f"cap={value} is not an integer") from None
        if cap < 2:
            raise _bad(spec, f"cap={value}: a verify cap is at least 2 (anchor + one draft)")
        return cap
    return value  # draft: a path or an embedded drafter's name; vocab: a path; both checked when arms load


def parse_arm(text: str) -> ArmSpec:
    """`NAME[:key=value,...]` -> ArmSpec; refuses with a message naming the arm and the bad part."""
    spec = text.strip()
    name, _, rest = spec.partition(":")
    if name not in ARM_NAMES:
        raise _bad(spec, f"unknown arm {name!r} (expected {'|'.join(ARM_NAMES)})")
    if ":" in spec and not rest.strip():
        raise _bad(spec, "':' with no key=value after it")
    values: dict[str, object] = {}
    for item in rest.split(",") if rest else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            raise _bad(spec, f"{item.strip()!r} is not key=value")
        if key in values:
            raise _bad(spec, f"key {key!r} given twice")
        values[key] = _key_value(spec, key, value)
    if name == "off" and values:
        raise _bad(spec, f"the off arm (plain greedy) takes no keys, got {', '.join(values)}")
    if name == "plain" and values:
        raise _bad(spec, f"the plain arm (the fastest plain decoding on the device) takes no keys, got {', '.join(values)}")
    return ArmSpec(spec, name, **values)  # type: ignore[arg-type]


def parse_arms(texts: Sequence[str]) -> list[ArmSpec]:
    """All `--arm`s (defaults when none); names are unique. `off` (the exactness reference) is
    added first when missing, and `plain` (the speed baseline) right after `off` when missing."""
    arms = [parse_arm(t) for t in (texts or DEFAULT_ARMS)]
    seen: set[str] = set()
    for arm in arms:
        if arm.name in seen:
            raise BenchError(f"--arm {arm.name!r} given twice")
        seen.add(arm.name)
    if "off" not in seen:
        arms.insert(0, ArmSpec("off", "off"))
    if "plain" not in seen:
        arms.insert(next(i for i, a in enumerate(arms) if a.name == "off") + 1, ArmSpec("plain", "plain"))
    return arms


# --------------------------------------------------------------------------- inputs


def embedded_pair() -> tuple[Path, dict[str, Path]] | None:
    """`memra_cli.assets.default_pair()` -> (target_dir, {"dflash": path, "dspark": path}), or
    None in a build without the embedded pair."""
    try:
        from memra_cli.assets import default_pair
    except ImportError as exc:
        if exc.name == "memra_cli.assets":  # no assets package, or one without default_pair
            return None
        raise
    target, drafters = default_pair()
    return Path(target), {k: Path(v) for k, v in drafters.items()}


@dataclass(frozen=True)
class Drafters:
    """Where arms find their drafter: `--draft`, else the embedded drafter named like the arm."""

    path: Path | None = None  # --draft
    embedded: dict[str, Path] = field(default_factory=dict)  # only when the target is the embedded one

    def for_arm(self, arm: ArmSpec) -> Path | None:
        if arm.mode in PLAIN_MODES:
            return None
        if arm.draft in EMBEDDED_DRAFTERS:
            if arm.draft not in self.embedded:
                raise BenchError(f"--arm {arm.name!r}: draft={arm.draft} names an embedded drafter, which only goes "
                                 "with the embedded target (omit --target; or pass draft=PATH, e.g. draft=./dflash)")
            return self.embedded[arm.draft]
        if arm.draft:
            return Path(arm.draft)
        if self.path is not None:
            return self.path
        key = arm.mode if arm.mode in EMBEDDED_DRAFTERS else "dspark"
        if key in self.embedded:
            return self.embedded[key]
        raise BenchError(f"--arm {arm.name!r} needs a drafter: pass --draft PATH (or draft=PATH in the arm)")


def resolve_inputs(target: Path | None, draft: Path | None) -> tuple[Path, Drafters, bool]:
    """--target / --draft as given -> (target dir, drafters, whether the embedded pair is used).

    The embedded drafters serve arms only when the target is the embedded one."""
    if target is not None and draft is not None:
        return target, Drafters(draft), False
    try:
        pair = embedded_pair()
    except MemraError:
        if target is None:  # the user relies on the embedded pair: say why it is not there
            raise
        pair = None  # --target given: the embedded pair only matters if it is that target
    if pair is None:
        if target is None:
            raise BenchError("no embedded default model pair in this build: pass --target DIR and --draft PATH")
        return target, Drafters(draft), False
    default_target, embedded = pair
    if target is None or Path(target).resolve() == default_target.resolve():
        return default_target, Drafters(draft, embedded), True
    return target, Drafters(draft), False


# --------------------------------------------------------------------------- loading arms


@dataclass
class Arm:
    """A loaded arm: its spec, the engine that runs it and its resolved program (`api.Arm`)."""

    spec: ArmSpec
    engine: object  # api.Engine (the plain arm's: `Engine.fastest_plain`, over the same target)
    loaded: object  # api.Arm: mode, receipts, program, drafter, warnings
    drafter: Path | None = None
    sampler: object = GREEDY  # every arm of a bench, off included, selects with the same sampler

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def mode(self) -> str:
        """`plain`, `off`, or the program that runs (`auto` resolved)."""
        return "plain" if self.spec.mode == "plain" else self.loaded.mode  # type: ignore[attr-defined]

    @property
    def steps(self) -> str:
        """How this arm's target steps run, in words (`api.describe_steps`)."""
        return self.engine.steps  # type: ignore[attr-defined]

    def session(self, prompt_ids, max_new: int, timed: bool = False):
        return self.engine.session(prompt_ids, max_new, self.loaded, sampler=self.sampler,  # type: ignore[attr-defined]
                                   timed=timed)


_ARM_KEY_OF_SETTING = {"verify_cap": "cap"}  # every other policy setting is its own arm key


def arm_label(setting: str, value: object) -> str:
    """How an arm spells a setting: `vt=confidence`, `cap=9`, `markov=1`; the program is the arm's
    name (`the dflash arm`)."""
    if setting == "spec":
        return f"the {value} arm"
    text = "1" if value is True else "0" if value is False else str(value)
    return f"{_ARM_KEY_OF_SETTING.get(setting, setting)}={text}"


def load_arms(engine, specs: Sequence[ArmSpec], drafters: Drafters, sampling: SamplingParams | None = None) -> list[Arm]:
    """Resolve every arm through the same assembly as `memra generate` (`Engine.arm`); each
    distinct drafter (path, prec) is loaded once and shared (each arm keeps its own program).
    Every arm samples with `sampling` (None: greedy), one seed for all (the gate compares
    streams of one seed); an arm's `accept=` picks its acceptance rule. The `plain` arm runs on
    `engine.fastest_plain()`, made once, over the same loaded target."""
    from memra_cli.engine.spec.keyed import SamplingParams, make_sampler

    sampling = sampling or SamplingParams()
    from memra_cli.engine.api import Arm as LoadedArm, ArmConfig

    loaded: dict[tuple[Path, str | None], object] = {}
    arms = []
    for spec in specs:
        if spec.mode == "plain":
            arms.append(Arm(spec, engine.fastest_plain(), LoadedArm("off"), None, make_sampler(sampling)))
            continue
        path = drafters.for_arm(spec)
        try:
            cfg = ArmConfig(draft=path, mode=spec.mode, settings=spec.settings, markov=spec.markov,
                            verify_cap=spec.cap, prec=spec.prec, emb_scale=spec.emb_scale,
                            draft_vocab=None if spec.vocab is None else Path(spec.vocab))
            key = (Path(path).resolve(), spec.prec) if path is not None else None
            arm = engine.arm(cfg, drafter=loaded.get(key))
            if key is not None and arm.drafter is not None:
                loaded.setdefault(key, arm.drafter)
        except BenchError:
            raise
        except SettingError as exc:  # name the arm's own keys (vt=..., cap=...)
            raise BenchError(f"--arm {spec.name!r}: {exc.render(arm_label)}") from None
        except MemraError as exc:
            raise BenchError(f"--arm {spec.name!r}: {exc}") from None
        if spec.accept == "rejection" and sampling.greedy:
            raise BenchError(f"--arm {spec.name!r}: accept=rejection samples drafts: it needs --temperature > 0")
        params = dataclasses.replace(sampling, acceptance=spec.accept or "keyed")
        arms.append(Arm(spec, engine, arm, path, make_sampler(params)))
    return arms


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Mismatch:
    """A speculative stream that left the `off` stream: first differing index and both tokens
    (None where one stream ended first)."""

    arm: str
    prompt: int
    index: int
    expected: int | None
    got: int | None

    def message(self) -> str:
        return (f"arm {self.arm!r} differs from off on prompt {self.prompt} at token {self.index}: "
                f"off={self.expected}, {self.arm}={self.got}")


def first_difference(ref: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter stream's end); None when equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


@dataclass
class ArmResult:
    """One arm's counters summed over the measured prompts."""

    name: str
    mode: str
    drafter: str | None
    prec: str | None
    receipts: Receipts | None
    warnings: list[str]
    stats: DecodeStats = field(default_factory=DecodeStats)
    wall_s: float = 0.0  # sum over generations, prefill included, device synchronized
    n_prompts: int = 0
    exact: bool | None = True  # None: not gated (plain; rejection sampling: lossless in distribution only)
    acceptance_rule: str | None = None  # the sampler's acceptance sentence
    steps: str | None = None  # how the arm's target steps ran (api.describe_steps)
    same_as_off: int | None = None  # plain only: prompts whose stream equalled off's (information)
    # a priced arm with vt_cost=routed: prompts by the cost model that priced them (a prompt
    # shorter than the cap falls back to shape: its session says why)
    window_costs: dict[str, int] = field(default_factory=dict)

    def add(self, stats: DecodeStats, wall_s: float) -> None:
        s = self.stats
        s.rounds, s.drafted, s.accepted = s.rounds + stats.rounds, s.drafted + stats.drafted, s.accepted + stats.accepted
        s.tokens += stats.tokens
        for phase, v in stats.phase_s.items():
            s.phase_s[phase] += v
        s.accept_hist.update(stats.accept_hist)
        if stats.window_cost is not None:
            model = stats.window_cost["model"]
            self.window_costs[model] = self.window_costs.get(model, 0) + 1
        if stats.expert_reads is not None:
            steps, experts = s.expert_reads or (0, 0)
            s.expert_reads = (steps + stats.expert_reads[0], experts + stats.expert_reads[1])
        self.wall_s += wall_s
        s.wall_s = self.wall_s
        self.n_prompts += 1

    @property
    def tok_per_s(self) -> float | None:
        return self.stats.tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def tau_hist(self) -> dict[str, int]:
        """Rounds by tokens committed in the round (accepted + 1)."""
        return {str(m + 1): n for m, n in sorted(self.stats.accept_hist.items())}

    def moe_counts(self) -> dict | None:
        """On an MoE target: rows verified per round (anchor + drafts), experts run per sparse
        layer per target call (steps and prefill chunks), and per round (summed over the sparse
        layers, the prefill's included); None elsewhere."""
        s = self.stats
        if s.expert_reads is None:
            return None
        steps, experts = s.expert_reads
        rounds = s.rounds if self.mode not in PLAIN_MODES else 0
        return {"rows_per_round": (s.drafted + s.rounds) / rounds if rounds else None,
                "experts_per_layer_step": experts / steps if steps else None,
                "experts_per_round": experts / rounds if rounds else None}

    def phase_ms_per_token(self) -> dict[str, float] | None:
        t = self.stats.tokens
        return {p: 1e3 * v / t for p, v in self.stats.phase_s.items()} if t else None

    def as_json(self, base_tok_per_s: float | None, phase_times: bool, off_tok_per_s: float | None = None) -> dict:
        """`speedup`: tok/s over the speed baseline's (`base_tok_per_s`: the plain arm's);
        `speedup_vs_off`: over the off arm's (`off_tok_per_s`, default the baseline's)."""
        s, tps = self.stats, self.tok_per_s
        off_tok_per_s = base_tok_per_s if off_tok_per_s is None else off_tok_per_s
        decode_s = self.wall_s - s.phase_s["prefill"]
        return {
            "name": self.name, "mode": self.mode, "drafter": self.drafter, "prec": self.prec,
            "steps": self.steps, "n_prompts": self.n_prompts, "tokens": s.tokens, "rounds": s.rounds,
            "drafted": s.drafted, "accepted": s.accepted,
            "tau": s.tau, "acceptance": s.acceptance if self.mode not in PLAIN_MODES else None,
            "tok_per_s": tps, "speedup": tps / base_tok_per_s if tps and base_tok_per_s else None,
            "speedup_vs_off": tps / off_tok_per_s if tps and off_tok_per_s else None,
            "same_as_off": self.same_as_off,
            "wall_s": self.wall_s, "ms_per_token": 1e3 * self.wall_s / s.tokens if s.tokens else None,
            "decode_tok_per_s": s.tokens / decode_s if phase_times and decode_s > 0 else None,
            "phase_ms": self.phase_ms_per_token() if phase_times else None,
            "phase_total_ms": {p: 1e3 * v for p, v in s.phase_s.items()} if phase_times else None,
            "tau_hist": self.tau_hist, "exact": self.exact, "acceptance_rule": self.acceptance_rule,
            "moe": self.moe_counts(),
            "window_costs": dict(self.window_costs) or None,
            "receipts": self.receipts.as_json() if self.receipts else None,
            "receipt_lines": self.receipts.lines() if self.receipts else [],
            "warnings": list(self.warnings),
        }


@dataclass
class BenchResult:
    """Every arm's aggregate, the gate's findings, and what was run (`meta`: prompts, target,
    device, dtype as the caller describes them)."""

    arms: list[ArmResult]
    mismatches: list[Mismatch]
    max_new: int
    warmup: int
    phase_times: bool
    meta: dict = field(default_factory=dict)
    phase_clock: str | None = None  # how phases were timed (None: not timed)
    graph_warmup: bool = False  # every arm primed and ran a round on every prompt before timing

    @property
    def exact(self) -> bool:
        return not self.mismatches

    def arm(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.name == name)

    @property
    def speedup_baseline(self) -> str:
        """The arm `speedup` divides by: `plain` (the fastest plain decoding), or `off` when a
        caller of `run_bench` left plain out."""
        return "plain" if any(a.name == "plain" for a in self.arms) else "off"

    def baselines(self) -> dict:
        """What each baseline was: its role and how its target steps ran."""
        roles = {"off": "exactness reference (every speculative stream must equal its stream); speedup_vs_off",
                 "plain": "speed baseline: the fastest plain decoding on this device; speedup"}
        if self.speedup_baseline == "off":
            roles["off"] = "exactness reference and speed baseline (no plain arm ran)"
        out = {}
        for name in ("plain", "off"):
            if any(a.name == name for a in self.arms):
                out[name] = {"role": roles[name], "steps": self.arm(name).steps}
        if "plain" in out:
            out["plain"]["same_as_off"] = self.arm("plain").same_as_off
        return out

    def as_json(self) -> dict:
        base, off = self.arm(self.speedup_baseline).tok_per_s, self.arm("off").tok_per_s
        return {
            "arms": [a.as_json(base, self.phase_times, off) for a in self.arms],
            "speedup_baseline": self.speedup_baseline, "baselines": self.baselines(),
            "prompts": self.meta.get("prompts"), "max_new": self.max_new, "warmup": self.warmup,
            "graph_warmup": self.graph_warmup,
            "target": self.meta.get("target"), "device": self.meta.get("device"), "dtype": self.meta.get("dtype"),
            "step_width": self.meta.get("step_width"), "cuda_graphs": self.meta.get("cuda_graphs"),
            # greedy rounds graphed whole, and queued one ahead of the host's read (phase timers
            # keep sessions on the per-part path, so neither applies to a phase-timed run)
            "round_graphs": bool(self.meta.get("round_graphs")) and not self.phase_times,
            "pipelined": bool(self.meta.get("pipelined")) and not self.phase_times,
            "sampling": self.meta.get("sampling"),
            "phase_times": self.phase_times, "phase_clock": self.phase_clock if self.phase_times else None,
            "phase_unit": "ms per generated token", "exact": self.exact,
            "mismatches": [dataclasses.asdict(m) for m in self.mismatches],
        }


# --------------------------------------------------------------------------- the run


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_one(arm: Arm, prompt_ids: Sequence[int], max_new: int, timed: bool) -> tuple[list[int], DecodeStats, float]:
    """One timed generation: (tokens, stats, wall seconds, prefill included, device synced)."""
    session = arm.session(prompt_ids, max_new, timed=timed)
    device = arm.engine.device  # type: ignore[attr-defined]
    target = arm.engine.target  # type: ignore[attr-defined]
    before = getattr(target, "expert_reads", None)
    _sync(device)
    t0 = time.perf_counter()
    session.run()
    _sync(device)
    wall = time.perf_counter() - t0
    if before is not None:
        after = target.expert_reads
        session.stats.expert_reads = (after[0] - before[0], after[1] - before[1])
    return list(session.tokens), session.stats, wall


Progress = Callable[[str, int, int], None]  # (stage "graphs"|"warmup"|"measure", done, total)


def uses_graphs(arm: Arm) -> bool:
    """Whether the arm's sessions replay CUDA graphs (captured on first use per storage bucket)."""
    runner = getattr(getattr(arm, "engine", None), "runner", None)
    return bool(getattr(runner, "cuda_graphs", False))


def capture_graphs(arm: Arm, prompt_ids: Sequence[int], max_new: int, timed: bool) -> None:
    """Prime the prompt and run one round, as the timed run will (`timed`: phase timers keep a
    session off whole-round graphs): every graph that run replays (prefill of its bucket, round
    or step graphs, ingest) is captured on the storages the pool will hand it."""
    with arm.session(prompt_ids, max_new, timed=timed) as session:
        session.burst(1)


def rotated(arms: Sequence[Arm], i: int) -> list[Arm]:
    """Prompt i runs the arms starting at arm i mod n (drift spreads over all arms)."""
    k = i % len(arms)
    return list(arms[k:]) + list(arms[:k])


def default_phase_times(device) -> bool:
    """Phase timers by default only where they cost nothing: on CPU the clock is perf_counter
    alone; on CUDA it synchronizes at every phase boundary (five per round), which slows the arms
    it times (plain decoding most per token: one round per token), so there it is opt-in."""
    return getattr(device, "type", str(device)) != "cuda"


def phase_clock_note(device) -> str:
    """How phases are timed on `device`, in words (`phase_clock` in the JSON)."""
    if getattr(device, "type", str(device)) == "cuda":
        return "perf_counter, device synchronized at every phase boundary: slows every arm, plain decoding most"
    return "perf_counter, no device synchronization"


def run_bench(arms: Sequence[Arm], prompts: Sequence[Sequence[int]], max_new: int, *, warmup: int = 1,
              phase_times: bool | None = None, progress: Progress | None = None, meta: dict | None = None) -> BenchResult:
    """Warm up on the first `warmup` prompts (not counted), then run every arm on every prompt,
    interleaved and rotated; gate every speculative stream against `off` (the plain arm's stream
    is compared too, as information, never gated). `phase_times` None: `default_phase_times`.

    With CUDA graphs, every arm first primes every prompt and runs one round (`capture_graphs`),
    untimed: a graph is captured on first use per storage and prompt bucket, tens of
    milliseconds each, and left in the timed pass it lands on whichever arm meets a bucket
    first (docs/tuning.md#bench-capture). A server captures before serving; so does the bench."""
    import torch

    meta = dict(meta or {})
    assert any(a.name == "off" for a in arms), "the off arm is the exactness reference"
    device = arms[0].engine.device  # type: ignore[attr-defined]
    if phase_times is None:
        phase_times = default_phase_times(device)
    results = {a.name: ArmResult(a.name, a.mode, str(a.drafter) if a.drafter else None, a.spec.prec,
                                 a.loaded.receipts, list(a.loaded.warnings),
                                 acceptance_rule=getattr(a.sampler, "acceptance", None), steps=a.steps) for a in arms}
    ungated = {a.name for a in arms if a.mode == "plain" or (getattr(a.sampler, "rejection", False) and a.mode != "off")}
    for name in ungated:
        results[name].exact = None
    plain = [a.name for a in arms if a.mode == "plain"]
    for name in plain:
        results[name].same_as_off = 0
    mismatches: list[Mismatch] = []
    n_warm = min(warmup, len(prompts))
    graph_warmup = any(uses_graphs(a) for a in arms)
    with torch.inference_mode():
        if graph_warmup:
            for i, ids in enumerate(prompts):
                for arm in arms:
                    capture_graphs(arm, ids, max_new, phase_times)
                if progress:
                    progress("graphs", i + 1, len(prompts))
        for i in range(n_warm):
            for arm in rotated(arms, i):
                generate_one(arm, prompts[i], max_new, phase_times)
            if progress:
                progress("warmup", i + 1, n_warm)
        for i, ids in enumerate(prompts):
            streams = {}
            for arm in rotated(arms, i):
                tokens, stats, wall = generate_one(arm, ids, max_new, phase_times)
                streams[arm.name] = tokens
                results[arm.name].add(stats, wall)
            mismatches += _gate({k: v for k, v in streams.items() if k not in ungated}, i)
            for name in plain:  # information: the fast baseline's steps are not the reference's
                results[name].same_as_off += streams[name] == streams["off"]
            if progress:
                progress("measure", i + 1, len(prompts))
    for m in mismatches:
        results[m.arm].exact = False
    meta.setdefault("prompts", {"n": len(prompts)})
    return BenchResult([results[a.name] for a in arms], mismatches, max_new, n_warm, phase_times, meta,
                       phase_clock_note(device) if phase_times else None, graph_warmup)


def _gate(streams: dict[str, list[int]], prompt: int) -> list[Mismatch]:
    ref = streams["off"]
    out = []
    for name, got in streams.items():
        i = first_difference(ref, got)
        if i is not None:
            out.append(Mismatch(name, prompt, i, ref[i] if i < len(ref) else None, got[i] if i < len(got) else None))
    return out


# --------------------------------------------------------------------------- one call for the CLI


@dataclass
class BenchRequest:
    """What `memra bench` was asked (flags as given; defaults live in the CLI)."""

    target: Path | None
    draft: Path | None
    prompts: str
    n: int | None
    max_new: int
    chat: bool
    arms: Sequence[str]
    warmup: int
    dtype: str
    device: str
    phase_times: bool | None = None  # None: on where they cost nothing (CPU), off on CUDA (`default_phase_times`)
    step_width: str | None = None  # --step-width as given (api.resolve_step_width)
    cuda_graphs: bool | None = None  # --cuda-graphs as given (api.resolve_cuda_graphs)
    sampling: SamplingParams | None = None  # None: greedy (temperature 0)
    threads: int | None = None  # --threads as given (None: the engine's policy, engine/threads.py)
    threads_source: str = "--threads"  # how the threads note names a requested count


@dataclass
class Bench:
    """A bench ready to run: target, loaded arms and tokenized prompts."""

    request: BenchRequest
    arms: list[Arm]
    prompt_ids: list[list[int]]
    meta: dict
    embedded: bool
    ignored_env: list[str]

    def run(self, progress: Progress | None = None) -> BenchResult:
        r = self.request
        return run_bench(self.arms, self.prompt_ids, r.max_new, warmup=r.warmup,
                         phase_times=self.phase_times, progress=progress, meta=self.meta)

    @property
    def phase_times(self) -> bool:
        """Whether phases are timed: as asked, else on where the clock costs nothing (CPU)."""
        r = self.request
        return default_phase_times(self.arms[0].engine.device) if r.phase_times is None else r.phase_times  # type: ignore[attr-defined]


def prepare_bench(req: BenchRequest, env: dict[str, str] | None = None) -> Bench:
    """Validate, load the target once and every arm; tokenize and check every prompt first."""
    from memra_cli.engine.api import Engine, EngineConfig, resolve_step_width
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.text import TextCodec

    if req.warmup < 0:
        raise BenchError(f"--warmup {req.warmup}: expected an integer >= 0")
    resolve_step_width(req.step_width)  # a bad value is refused before anything loads
    specs = parse_arms(req.arms)
    prompts = load_prompts(req.prompts, req.n)
    target_dir, drafters, embedded = resolve_inputs(req.target, req.draft)
    for spec in specs:  # every arm's drafter is known before anything heavy loads
        drafters.for_arm(spec)
    codec = TextCodec(Path(target_dir))
    ids = [codec.encode(text, chat=req.chat) for text in prompts.texts]
    engine = Engine.load(EngineConfig(target=Path(target_dir), device=req.device, dtype=req.dtype,
                                      step_width=req.step_width, cuda_graphs=req.cuda_graphs, env=dict(env or {}),
                                      threads=req.threads, threads_source=req.threads_source))
    for i, p in enumerate(ids):
        try:
            engine.check_prompt(p, req.max_new)
        except MemraError as exc:
            raise BenchError(f"prompt {i} of {prompts.name}: {exc}") from None
    from memra_cli.engine.spec.keyed import SamplingParams

    sampling = req.sampling or SamplingParams()
    arms = load_arms(engine, specs, drafters, sampling)
    meta = {
        "prompts": {"set": prompts.name, "source": prompts.source, "n": len(ids), "chat": req.chat,
                    "prompt_tokens": sum(len(p) for p in ids)},
        "target": str(target_dir), "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "step_width": engine.step_width, "cuda_graphs": engine.cuda_graphs, "step_width_note": "; ".join(engine.notes),
        "round_graphs": engine.round_graphs, "pipelined": engine.pipelined,
        "sampling": sampling.as_json(), "sampling_note": sampling.describe(),
    }
    ignored = [k for k in POLICY_ENV if (env or {}).get(k)]
    return Bench(req, arms, ids, meta, embedded, ignored)
