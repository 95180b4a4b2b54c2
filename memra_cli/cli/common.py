"""Shared CLI plumbing: the error boundary and the policy options every drafter load takes.

A CLI flag and its environment variable are one setting (typer `envvar=`); defaults live here.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

HARVEST_HELP = "Harvest convention: dflash (rows 1..b-1) | dspark (rows 0..b-1). Unset: from the checkpoint census."
VT_HELP = "Verify-window policy: ladder | confidence | confidence-slot. Unset: confidence-slot with an accept-rate head, else ladder."
TAU_HELP = "Confidence threshold in (0,1) for the confidence policies (default 0.5)."
ADAPT_HELP = "Adapt the verify window each round (--no-adapt pins it at the cap; refuses with a confidence policy)."

HarvestOpt = typer.Option(None, "--harvest", envvar="MEMRA_DSPARK_HARVEST", help=HARVEST_HELP, show_envvar=True)
VtOpt = typer.Option(None, "--vt", envvar="MEMRA_DSPARK_VT", help=VT_HELP, show_envvar=True)
TauOpt = typer.Option(None, "--tau", envvar="MEMRA_DSPARK_VT_TAU", help=TAU_HELP, show_envvar=True)
AdaptOpt = typer.Option(None, "--adapt/--no-adapt", envvar="MEMRA_DFLASH_ADAPT", help=ADAPT_HELP, show_envvar=True)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout instead of the report.")
STEP_WIDTH_HELP = ("Rows per target step after the prefill: N (default 16) runs every decode and verify step at "
                   "exactly N rows (padded, or chunked), so a token's arithmetic never depends on how many tokens "
                   "share its step and speculative output equals plain greedy bit for bit, bf16 included | "
                   "variable: each step at its own width (plain decode one row; in bf16 the GEMMs then differ "
                   "between 1 and 16 rows and the output may differ from plain greedy).")
StepWidthOpt = typer.Option(None, "--step-width", envvar="MEMRA_STEP_WIDTH", help=STEP_WIDTH_HELP, show_envvar=True)
CUDA_GRAPHS_HELP = ("Replay each fixed-width target step as a CUDA graph, captured once per cache storage (one "
                    "launch per step instead of hundreds; same kernels, same bits). Default: on with CUDA and a "
                    "fixed --step-width.")
CudaGraphsOpt = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", envvar="MEMRA_CUDA_GRAPHS", help=CUDA_GRAPHS_HELP,
                             show_envvar=True)


def policy_settings(harvest: Optional[str], vt: Optional[str], tau: Optional[str], adapt: Optional[bool]):
    """Flags/env as given -> engine PolicySettings (adapt as the environment's "0"/"1" strings)."""
    from memra_cli.engine.spec.policy import PolicySettings

    adapt_s = None if adapt is None else ("1" if adapt else "0")
    return PolicySettings(harvest=harvest, vt=vt, tau=tau, adapt=adapt_s)


# engine setting -> the flag that carries it (the engine names settings, the CLI names flags)
SETTING_FLAGS = {"device": "--device", "dtype": "--dtype", "step_width": "--step-width",
                 "cuda_graphs": "--cuda-graphs", "spec": "--spec"}
SETTING_FLAGS.update({"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                      "min_p": "--min-p", "seed": "--seed", "acceptance": "--acceptance"})  # cli/sampling.py


def debug_enabled() -> bool:
    return os.environ.get("MEMRA_DEBUG", "") not in ("", "0")


def refusals(fn: F) -> F:
    """Turn known errors into one `error:` line on stderr and a non-zero exit (traceback only
    under MEMRA_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from memra_cli.engine.errors import MemraError, SettingError

        try:
            return fn(*args, **kwargs)
        except MemraError as exc:
            if debug_enabled():
                raise
            flag = SETTING_FLAGS.get(exc.setting) if isinstance(exc, SettingError) else None
            print(f"error: {exc.flag_message(flag) if flag else exc}", file=sys.stderr)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]
