"""Bad flags are refused before torch is imported (a typo answers in a fraction of a second,
not after torch's two-second import): each case runs in a fresh interpreter that reports
whether torch was loaded when the command exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DSPARK = str(ROOT / "memra_cli" / "assets" / "dspark")

RUNNER = """
import json, sys
from memra_cli.cli.app import app
out = []
for args in json.loads(sys.argv[1]):
    try:
        app(args, prog_name="memra")
    except SystemExit as e:
        out.append([e.code, "torch" in sys.modules])
print(json.dumps(out))
"""


def _run_each(cases: list[list[str]], cwd: Path) -> tuple[list, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's memra_cli, whatever is installed
    r = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


CASES = [
    ["generate", "--vt", "fastest", "--prompt", "x"],
    ["generate", "--tau", "2", "--prompt", "x"],
    ["generate", "--verify-cap", "x", "--prompt", "x"],
    ["generate", "--spec", "fast", "--prompt", "x"],
    ["generate", "--dtype", "float16", "--prompt", "x"],
    ["generate", "--device", "tpu", "--prompt", "x"],
    ["generate", "--step-width", "0", "--prompt", "x"],
    ["generate", "--prec", "q5", "--prompt", "x"],
    ["generate", "--threads", "0", "--prompt", "x"],
    ["generate", "--prompt-ids", "1,x"],
    ["generate", "--prompt", "x", "--prompt-ids", "1"],
    ["bench", "--arm", "bogus"],
    ["bench", "--arm", "dspark:tau=2"],
    ["bench", "--prompts", "nope.jsonl"],
    ["bench", "--dtype", "float16"],
    ["bench", "--threads", "many"],
    ["quantize", DSPARK, "--policy", "q5", "--out", "x.gguf"],
    ["parity", DSPARK, "--prec", "q5", "--make-oracle", "x.npz"],
    ["parity", DSPARK, "--device", "tpu", "o.npz"],
]


def test_bad_flags_are_refused_before_torch_loads(tmp_path):
    results, stderr = _run_each(CASES, tmp_path)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(CASES), stderr
    for args, (code, torch_loaded), line in zip(CASES, results, errors):
        assert code == 2, (args, line)
        assert not torch_loaded, (args, line)
    assert list(tmp_path.iterdir()) == []  # nothing written on the way out


def test_the_early_checks_refuse_what_the_engine_refuses_in_the_same_words():
    """cli/checks.py mirrors the engine's checks (engine/api.py imports torch): the same values
    pass or fail, with the same message."""
    import pytest

    from memra_cli.cli import checks
    from memra_cli.engine import api
    from memra_cli.engine.errors import SettingError
    from memra_cli.engine.quant.precision import POLICIES

    def outcome(fn, *args):
        try:
            fn(*args)
        except SettingError as exc:
            return str(exc)
        return None

    assert checks.SPEC_MODES == api.SPEC_MODES
    assert checks.check_prec is api.check_prec and set(POLICIES) == set(api.PRECISIONS)
    for value in ["16", "1", "variable", " Variable ", "0", "-3", "x", "", "1.5"]:
        assert outcome(checks.check_step_width, value) == outcome(api.resolve_step_width, value), value
    for value in ["auto", "cpu", "tpu", "gpu", "CUDA"]:
        assert outcome(checks.check_device, value) == outcome(api.resolve_device, value), value
    for value in ["auto", "float32", "bfloat16", "float16", "fp32"]:
        assert outcome(checks.check_dtype, value) == outcome(api.resolve_dtype, value, api.torch.device("cpu")), value
    for value in ["auto", "off", "fast", "DFLASH"]:  # (dflash and dspark go on to ask for a drafter)
        engine = outcome(api.Engine.resolve, type("E", (), {"target": None})(), api.ArmConfig(mode=value))
        assert outcome(checks.check_spec, value) == engine, value
    with pytest.raises(SettingError, match="prec='q5'"):
        checks.check_prec("q5")


def test_quantize_and_parity_refuse_a_bad_flag_before_numpy_loads_too(tmp_path):
    """Their flag checks come before the census and the GGUF / oracle modules (numpy)."""
    probe = RUNNER.replace('"torch" in sys.modules', '"numpy" in sys.modules or "torch" in sys.modules')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["quantize", DSPARK, "--policy", "q5", "--out", "x.gguf"],
                 ["parity", DSPARK, "--prec", "q5", "--make-oracle", "x.npz"],
                 ["parity", DSPARK, "--device", "tpu", "o.npz"]):
        r = subprocess.run([sys.executable, "-c", probe, json.dumps([args])], capture_output=True, text=True,
                           cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == [[2, False]], (args, r.stderr)
    assert list(tmp_path.iterdir()) == []
