"""Flag checks that run before anything heavy is imported.

Importing torch takes about two seconds; a typo in a flag should not. These checks need no
checkpoint and no torch. Each mirrors a refusal the engine makes again when it resolves the
setting (`engine/api.py` imports torch; the engine's check stays the backstop for Python
callers), with the same `SettingError`, so the message is the engine's and the CLI names the
flag the user typed, or the flag and its variable when the value came from the environment.
`tests/cli/test_fast_refusals_cli.py` keeps the value lists here in step with the engine's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from memra_cli.engine.errors import ConfigError, SettingError
from memra_cli.engine.quant.precision import check_prec  # noqa: F401  (torch-free: the engine's own check)

SPEC_MODES = ("off", "dflash", "dspark", "auto")  # engine.api.SPEC_MODES
DTYPES = ("auto", "float32", "bfloat16")  # engine.api.resolve_dtype
DEVICES = ("auto", "cpu", "cuda")  # engine.api.resolve_device (and cuda:N)


def check_spec(mode: str) -> None:
    """`--spec`: off | dflash | dspark | auto (engine.api.resolve_program)."""
    if mode not in SPEC_MODES:
        raise SettingError("spec", mode, f"expected {'|'.join(SPEC_MODES)}", quote=False)


def check_step_width(value: Optional[str]) -> None:
    """`--step-width` / MEMRA_STEP_WIDTH: a positive integer or `variable` (engine.api.resolve_step_width)."""
    if value is None:
        return
    text = value.strip().lower()
    if text != "variable" and not (text.isdigit() and int(text) >= 1):
        raise SettingError("step_width", value, "expected a positive integer (rows per target step) or 'variable'")


def check_threads(value: Optional[str]) -> None:
    """`--threads` / MEMRA_THREADS: a positive integer (cli/threads.py applies it; no engine setting)."""
    if value is None:
        return
    text = value.strip()
    if not (text.isascii() and text.isdigit() and int(text) >= 1):
        raise SettingError("threads", value, "expected a positive integer (CPU threads per op)")
    cores = os.cpu_count() or 1
    if int(text) > cores:  # more threads than cores only wait for each other
        raise SettingError("threads", value, f"expected at most this machine's {cores} CPU cores")


def check_device(device: str) -> None:
    """`--device`: auto | cpu | cuda | cuda:N (whether CUDA is there is asked once torch loads)."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise SettingError("device", device, "expected auto|cpu|cuda", quote=False)


def check_dtype(dtype: str) -> None:
    """`--dtype`: auto | float32 | bfloat16 (engine.api.resolve_dtype)."""
    if dtype not in DTYPES:
        raise SettingError("dtype", dtype, "expected auto|float32|bfloat16", quote=False)


def check_run_flags(dtype: str, device: str, step_width: Optional[str]) -> None:
    """The flags every command that runs the target takes."""
    check_dtype(dtype)
    check_device(device)
    check_step_width(step_width)


def check_policy_values(harvest: Optional[str], vt: Optional[str], tau: Optional[str], adapt: Optional[bool],
                        verify_cap: Optional[str] = None, vt_cost: Optional[str] = None) -> None:
    """Every policy value and contradiction that needs no checkpoint. Resolving against a
    checkpoint that has every head parses whatever is set (tau included); what depends on the
    checkpoint (a head that is absent, the verify cap's upper bound) is refused at load."""
    from memra_cli.cli.common import policy_settings
    from memra_cli.engine.spec.policy import resolve_receipts

    resolve_receipts(policy_settings(harvest, vt, tau, adapt, vt_cost), strategy_dspark=False, has_confidence_head=True)
    if verify_cap is None or verify_cap == "":
        return
    try:
        cap = int(verify_cap)
    except ValueError:
        raise SettingError("verify_cap", verify_cap, "not an integer") from None
    if cap < 2:
        raise SettingError("verify_cap", verify_cap, "a verify cap is at least 2 (anchor + one draft)")


def check_model_dir(path: Optional[Path], flag: str) -> None:
    """`--target DIR`: a model directory that exists (said before anything else looks for a file in it)."""
    if path is None:
        return
    if not path.exists():
        raise ConfigError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: not a directory (expected a model directory with config.json)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {path}: no config.json there (expected an HF Qwen3 or Qwen3.5 model directory)")


def check_exists(path: Optional[Path], flag: str) -> None:
    """A checkpoint flag (`--draft`): a directory or a .gguf file that exists."""
    if path is not None and not path.exists():
        raise ConfigError(f"{flag} {path}: no such file or directory")
