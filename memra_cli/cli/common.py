"""Shared CLI plumbing: the error boundary and the policy options every drafter load takes.

A CLI flag and its environment variable are one setting (typer `envvar=`); defaults live here.
`SETTINGS` is the one table of them, keyed by the engine's name for the setting. The engine
names settings (`vt='fastest': ...`); the refusal boundary names them the way the user gave
them: the flag as typed (`--vt fastest: ...`), or the flag and the variable when the value came
from the environment (`--vt / MEMRA_DSPARK_VT=fastest (from the environment): ...`).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Setting:
    """One setting as the CLI carries it: its flag (None: environment only), its environment
    variable (None: flag only), and a boolean flag's negative form. The command parameter that
    carries it has the setting's name."""

    name: str
    flag: Optional[str]
    env: Optional[str]
    off: Optional[str] = None


SETTINGS = {s.name: s for s in (
    Setting("harvest", "--harvest", "MEMRA_DSPARK_HARVEST"),
    Setting("vt", "--vt", "MEMRA_DSPARK_VT"),
    Setting("vt_cost", "--vt-cost", "MEMRA_DSPARK_VT_COST"),
    Setting("tau", "--tau", "MEMRA_DSPARK_VT_TAU"),
    Setting("adapt", "--adapt", "MEMRA_DFLASH_ADAPT", off="--no-adapt"),
    Setting("verify_cap", "--verify-cap", "MEMRA_DFLASH_VERIFY_T"),
    Setting("markov", "--markov", "MEMRA_DFLASH_MARKOV", off="--no-markov"),
    Setting("emb_scale", "--emb-scale", "MEMRA_DFLASH_EMB_SCALE", off="--no-emb-scale"),
    Setting("prec", "--prec", "MEMRA_DFLASH_PREC"),
    Setting("step_width", "--step-width", "MEMRA_STEP_WIDTH"),
    Setting("cuda_graphs", "--cuda-graphs", "MEMRA_CUDA_GRAPHS", off="--no-cuda-graphs"),
    Setting("threads", "--threads", "MEMRA_THREADS"),  # cli/threads.py
    Setting("device", "--device", None),
    Setting("dtype", "--dtype", None),
    Setting("spec", "--spec", None),
    Setting("kernels", None, "MEMRA_KERNELS"),
    Setting("draft_graphs", None, "MEMRA_DRAFT_GRAPHS"),
    Setting("round_graphs", None, "MEMRA_ROUND_GRAPHS"),
    Setting("pipeline", None, "MEMRA_PIPELINE"),
    Setting("pdl", None, "MEMRA_PDL"),
    # sampling (cli/sampling.py): flags only
    Setting("temperature", "--temperature", None),
    Setting("top_k", "--top-k", None),
    Setting("top_p", "--top-p", None),
    Setting("min_p", "--min-p", None),
    Setting("seed", "--seed", None),
    Setting("acceptance", "--acceptance", None),
)}
_TRUE = ("1", "true", "yes", "on", "t", "y")


def click_module():
    """The click that typer runs on (typer >= 0.29 vendors its own copy as `typer._click`)."""
    try:
        from typer import _click as click
        from typer._click import exceptions, globals  # noqa: F401  (loads the submodules)
    except ImportError:
        import click
    return click


def current_context():
    """The running command's click context, or None outside a command."""
    return click_module().globals.get_current_context(silent=True)


def from_environment(param: str, ctx=None) -> bool:
    """Whether parameter `param` of the running command took its value from its environment variable."""
    ctx = ctx or current_context()
    source = ctx.get_parameter_source(param) if ctx is not None else None
    return source is not None and source.name == "ENVIRONMENT"


def _is_on(value: object) -> bool:
    return value is True or str(value).strip().lower() in _TRUE


def setting_label(name: str, value: object, ctx=None) -> str:
    """How the user gave setting `name`: `--vt fastest`, `--no-adapt`, or with the variable when
    the value came from the environment: `--vt / MEMRA_DSPARK_VT=fastest (from the environment)`.
    A setting the CLI has no flag or variable for is named as the engine names it."""
    s = SETTINGS.get(name)
    if s is None:
        return f"{name}={value!r}"
    text = "1" if value is True else "0" if value is False else str(value)
    if s.flag is None:  # a variable only: its name says where the value came from
        return f"{s.env}={os.environ.get(s.env, text)}"
    flag = (s.flag if _is_on(value) else s.off) if s.off else s.flag
    if s.env and from_environment(s.name, ctx):
        return f"{flag} / {s.env}={os.environ.get(s.env, text)} (from the environment)"
    return flag if s.off else f"{flag} {text}"


_BOOL_EXPECTED = "expected 1 or 0 (or true/false, yes/no, on/off)"


def usage_error_line(exc) -> str:
    """A click usage error (bad value, unknown option or command, missing argument) as one line:
    a bad environment value names the flag and the variable, like a SettingError does."""
    message = " ".join(exc.format_message().split())
    param, ctx = getattr(exc, "param", None), getattr(exc, "ctx", None)
    envvar = getattr(param, "envvar", None)
    if param is not None and isinstance(envvar, str) and from_environment(param.name, ctx):
        detail = _BOOL_EXPECTED if getattr(param, "is_bool_flag", False) else getattr(exc, "message", message)
        return f"{param.opts[0]} / {envvar}={os.environ.get(envvar, '')} (from the environment): {detail}"
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return message.rstrip(".") + hint


def at_least(minimum: int):
    """An option callback refusing an integer below `minimum` in memra's one-line form (typer's
    own `min=` check draws a boxed usage error)."""
    from memra_cli.engine.errors import ConfigError

    def check(param: typer.CallbackParam, value: Optional[int]) -> Optional[int]:
        if value is not None and value < minimum:
            raise ConfigError(f"{param.opts[0]} {value}: expected an integer >= {minimum}")
        return value

    return check


def describe(exc: Exception, ctx=None) -> str:
    """An error's one line, every setting it names written the way the user gave it."""
    from memra_cli.engine.errors import SettingError

    if isinstance(exc, SettingError):
        return exc.render(lambda name, value: setting_label(name, value, ctx), front_end=True)
    return str(exc)


HARVEST_HELP = "Harvest convention: dflash (rows 1..b-1) | dspark (rows 0..b-1). Unset: from the checkpoint census."
VT_HELP = "Verify-window policy: ladder | confidence | confidence-slot | priced (expert-priced on an MoE target; confidence-slot on a dense one). Unset: confidence-slot with an accept-rate head, else ladder."
VT_COST_HELP = ("The priced window's step-cost model: shape (the expert union of independently routed rows, from "
                "the target's shape) | routed (each prompt's expert union of vt consecutive tokens, measured from "
                "its prefill's routing). Unset: shape. Only with --vt priced.")
TAU_HELP = "Confidence threshold in (0,1) for the confidence policies (default 0.5)."
ADAPT_HELP = "Adapt the verify window each round (--no-adapt pins it at the cap; refuses with a confidence policy)."

HarvestOpt = typer.Option(None, "--harvest", envvar=SETTINGS["harvest"].env, help=HARVEST_HELP, show_envvar=True)
VtOpt = typer.Option(None, "--vt", envvar=SETTINGS["vt"].env, help=VT_HELP, show_envvar=True)
VtCostOpt = typer.Option(None, "--vt-cost", envvar=SETTINGS["vt_cost"].env, help=VT_COST_HELP, show_envvar=True)
TauOpt = typer.Option(None, "--tau", envvar=SETTINGS["tau"].env, help=TAU_HELP, show_envvar=True)
AdaptOpt = typer.Option(None, "--adapt/--no-adapt", envvar=SETTINGS["adapt"].env, help=ADAPT_HELP, show_envvar=True)
EMB_SCALE_HELP = ("The drafter's block embedding: the target's embedding rows times the target's embed_scale "
                  "(Gemma: sqrt(hidden); 1 for Qwen3 / LLaMA) with --emb-scale, the raw rows with --no-emb-scale "
                  "(default: raw, as the reference engine; a z-lab checkpoint does not record which it was trained with).")
EmbScaleOpt = typer.Option(None, "--emb-scale/--no-emb-scale", envvar=SETTINGS["emb_scale"].env, help=EMB_SCALE_HELP,
                           show_envvar=True)
# The options every command that runs a target with a drafter shares (generate, serve).
DtypeOpt = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16.")
DeviceOpt = typer.Option("auto", "--device", help="auto | cpu | cuda.")
VerifyCapOpt = typer.Option(None, "--verify-cap", envvar="MEMRA_DFLASH_VERIFY_T", show_envvar=True,
                            help="Most candidates verified per round (anchor + drafts); default n_drafts+1.")
MarkovOpt = typer.Option(None, "--markov/--no-markov", envvar="MEMRA_DFLASH_MARKOV", show_envvar=True,
                         help="Markov chain over the drafts (dspark program; default: when the checkpoint has a markov head).")
PREC_HELP = ("Drafter weight precision, applied at load to a safetensors drafter: f32 | bf16 | q8 | mixed | fc | q4 "
             "(q8_0 / q4_0 with the same encoder as `memra quantize`). Unset: weights as stored, in --dtype. "
             "A .gguf drafter carries its own policy (--prec may only repeat it).")
DrafterPrecOpt = typer.Option(None, "--prec", envvar="MEMRA_DFLASH_PREC", show_envvar=True, help=PREC_HELP)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout instead of the report.")
STEP_WIDTH_HELP = ("Rows per target step after the prefill: N (default 16) runs every decode and verify step at "
                   "exactly N rows (padded, or chunked), so a token's arithmetic never depends on how many tokens "
                   "share its step and speculative output equals plain greedy bit for bit, bf16 included | "
                   "variable: each step at its own width (plain decode one row; in bf16 the GEMMs then differ "
                   "between 1 and 16 rows and the output may differ from plain greedy).")
StepWidthOpt = typer.Option(None, "--step-width", envvar=SETTINGS["step_width"].env, help=STEP_WIDTH_HELP, show_envvar=True)
CUDA_GRAPHS_HELP = ("Replay each fixed-width target step as a CUDA graph, captured once per cache storage (one "
                    "launch per step instead of hundreds; same kernels, same bits). Default: on with CUDA and a "
                    "fixed --step-width.")
CudaGraphsOpt = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", envvar=SETTINGS["cuda_graphs"].env, help=CUDA_GRAPHS_HELP,
                             show_envvar=True)
DraftVocabOpt = typer.Option(None, "--draft-vocab", help=(
    "A draft vocabulary: a JSON list of token ids (or an object with an \"ids\" list; `memra draft-vocab` writes "
    "one). The drafts are greedy picks among these tokens only, so the draft reads only their lm_head rows; the "
    "target still verifies every token, so the output is unchanged and only acceptance can drop. Greedy only."))


def policy_settings(harvest: Optional[str], vt: Optional[str], tau: Optional[str], adapt: Optional[bool],
                    vt_cost: Optional[str] = None):
    """Flags/env as given -> engine PolicySettings (adapt as the environment's "0"/"1" strings)."""
    from memra_cli.engine.spec.policy import PolicySettings

    adapt_s = None if adapt is None else ("1" if adapt else "0")
    return PolicySettings(harvest=harvest, vt=vt, tau=tau, adapt=adapt_s, vt_cost=vt_cost)


def debug_enabled() -> bool:
    return os.environ.get("MEMRA_DEBUG", "") not in ("", "0")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is, so that every cleanup runs (a temporary
    output file is removed) exactly as it does for Ctrl-C. A BaseException, like
    KeyboardInterrupt: no `except Exception` swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


CAUGHT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_received: list[int] = []  # signals that arrived during the running command, first first


def _raise_for(signum: int, frame: Any) -> None:
    """Record the signal, then raise where the program is: KeyboardInterrupt for SIGINT (as
    Python does), Terminated for the others. The record matters because native code (a
    safetensors read, say) can turn the exception raised inside it into an error of its own;
    whatever comes out, the command ends as the signal asked. A second SIGTERM / SIGHUP gets the
    default action: whoever sends it twice means it. Inside `signals_held()` (a temporary file
    being created) the signal is deferred to the block's end instead."""
    from memra_cli.engine.files import defer_signal

    if defer_signal(signum):
        return
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    raise Terminated(signum)


@contextmanager
def signals_as_exceptions():
    """For the duration of a command, SIGINT / SIGTERM / SIGHUP unwind it through its cleanups
    (SIGTERM's and SIGHUP's default action kills the process at once and leaves a half-written
    temporary file behind)."""
    _received.clear()
    previous = {}
    try:
        for sig in CAUGHT_SIGNALS:
            previous[sig] = signal.signal(sig, _raise_for)
    except ValueError:  # not the main thread (an embedding program): leave its handlers alone
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_if_signalled() -> None:
    """At a safe point (between tensors, rounds, prompts): end the command if a signal arrived
    and its exception was swallowed on the way (native code can clear it)."""
    if _received:
        signum = _received[0]
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def report_signal(signum: int) -> int:
    """The one line for a caught signal, and the shell's exit status for it (128 + signal)."""
    try:
        if signum == signal.SIGINT:
            print("error: interrupted", file=sys.stderr)
        else:
            print(f"error: terminated ({signal.Signals(signum).name})", file=sys.stderr)
    except OSError:  # SIGHUP: the terminal may be gone
        pass
    return 128 + signum


CLOSED_PIPE_EXIT = 128 + getattr(signal, "SIGPIPE", 13)  # what a shell reports for a process SIGPIPE ended


def closed_pipe() -> int:
    """The reader of stdout went away (`memra bench | head -1`): say nothing (there is no one to
    say it to, and stderr is not the reader), point stdout at /dev/null so the interpreter's
    last flush does not fail again, and end with the conventional code."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (an embedding program's stream)
        pass
    return CLOSED_PIPE_EXIT


def _is_closed_pipe(exc: BaseException) -> bool:
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE)


def flush_stdout(code: int) -> int:
    """Flush stdout at the command's end: a reader that left after its last line gets the
    closed-pipe ending rather than Python's 'Exception ignored' at exit."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError) as exc:
        if not _is_closed_pipe(exc):
            raise
        return closed_pipe()
    return code


def _ending(exc: BaseException) -> Optional[int]:
    """The exit code of an exception that ends a command with one line (printed here), or None
    for one that goes on (a bug keeps its traceback; typer.Exit its code)."""
    from memra_cli.engine.errors import MemraError

    if _received:  # whatever the signal's exception became on its way out
        return report_signal(_received[0])
    if isinstance(exc, Terminated):
        return report_signal(exc.signum)
    if isinstance(exc, KeyboardInterrupt):
        return report_signal(signal.SIGINT)
    if _is_closed_pipe(exc):
        return closed_pipe()
    if isinstance(exc, MemraError) and not debug_enabled():
        print(f"error: {describe(exc)}", file=sys.stderr)
        return exc.exit_code
    return None


def refusals(fn: F) -> F:
    """Turn known errors into one `error:` line on stderr and a non-zero exit (traceback only
    under MEMRA_DEBUG=1); a signal ends the command as `error: interrupted` (130) or
    `error: terminated (SIGTERM)` (143), after the cleanups ran."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            code = _ending(exc)
            if code is None:
                raise
            raise typer.Exit(code=code) from None

    return wrapper  # type: ignore[return-value]
