"""A setting's error names it the way the user gave it: the flag typed, or the flag and its
environment variable when the value came from the environment (one table: common.SETTINGS).
The engine names settings (`vt='fastest'`), never flags or variables."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.cli.common import SETTINGS
from memra_cli.engine.errors import SettingError
from memra_cli.engine.spec import policy
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("settings")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dspark = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    dflash = make_tiny_draft(root / "dflash", "zlab")
    return target, dspark, dflash


# (flags typed, the same setting from the environment, what the message says after the label)
CASES = {
    "vt": (["--vt", "fastest"], {"MEMRA_DSPARK_VT": "fastest"}, "--vt fastest", "--vt / MEMRA_DSPARK_VT=fastest",
           ": unknown verify-window policy (expected ladder|confidence|confidence-slot|priced)"),
    "vt-cost": (["--vt", "priced", "--vt-cost", "measured"], {"MEMRA_DSPARK_VT_COST": "measured"}, "--vt-cost measured",
                "--vt-cost / MEMRA_DSPARK_VT_COST=measured", ": unknown step-cost model (expected shape|routed)"),
    "tau": (["--tau", "1.5"], {"MEMRA_DSPARK_VT_TAU": "1.5"}, "--tau 1.5", "--tau / MEMRA_DSPARK_VT_TAU=1.5",
            ": confidence threshold must be in (0,1)"),
    "harvest": (["--harvest", "shifted"], {"MEMRA_DSPARK_HARVEST": "shifted"}, "--harvest shifted",
                "--harvest / MEMRA_DSPARK_HARVEST=shifted", ": unknown harvest convention (expected dflash|dspark)"),
    "verify-cap": (["--verify-cap", "99"], {"MEMRA_DFLASH_VERIFY_T": "99"}, "--verify-cap 99",
                   "--verify-cap / MEMRA_DFLASH_VERIFY_T=99", ": verify cap must be in [2, 9]"),
    "markov": (["--markov", "--spec", "dflash"], {"MEMRA_DFLASH_MARKOV": "1"}, "--markov",
               "--markov / MEMRA_DFLASH_MARKOV=1", " with --spec dflash: the dflash program drafts in parallel"),
    "step-width": (["--step-width", "0"], {"MEMRA_STEP_WIDTH": "0"}, "--step-width 0",
                   "--step-width / MEMRA_STEP_WIDTH=0", ": expected a positive integer (rows per target step) or 'variable'"),
    "prec": (["--prec", "q5"], {"MEMRA_DFLASH_PREC": "q5"}, "--prec q5", "--prec / MEMRA_DFLASH_PREC=q5",
             ": unknown precision policy (expected f32|bf16|q8|mixed|fc|q4)"),
    "threads": (["--threads", "0"], {"MEMRA_THREADS": "0"}, "--threads 0", "--threads / MEMRA_THREADS=0",
                ": expected a positive integer (CPU threads per op)"),
}


def _error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_typed_flag_is_named_as_typed_and_an_env_value_names_both(pair, case):
    target, dspark, _ = pair
    typed, env, flag_label, env_label, rest = CASES[case]
    base = ["generate", "--target", str(target), "--draft", str(dspark), "--prompt-ids", "1,2,3", "--max-new", "2"]
    r = runner.invoke(app, base + typed)
    assert _error(r).startswith(f"error: {flag_label}{rest}"), r.stderr
    r = runner.invoke(app, base + (["--spec", "dflash"] if case == "markov" else []), env=env)
    assert _error(r).startswith(f"error: {env_label} (from the environment){rest}"), r.stderr


def test_a_contradiction_names_both_flags_and_census_names_them_too(pair):
    target, dspark, dflash = pair
    r = runner.invoke(app, ["census", str(dspark), "--vt", "confidence", "--no-adapt"])
    assert _error(r) == ("error: --vt confidence together with --no-adapt is contradictory (a pinned fixed window vs "
                         "a per-round confidence window); drop one")
    r = runner.invoke(app, ["census", str(dspark), "--vt", "confidence"], env={"MEMRA_DFLASH_ADAPT": "0"})
    assert _error(r).startswith("error: --vt confidence together with --no-adapt / MEMRA_DFLASH_ADAPT=0 (from the environment)")
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(dflash), "--spec", "dspark", "--markov",
                            "--prompt-ids", "1"])
    assert _error(r) == f"error: --markov: {dflash} has no markov head"


def test_the_settings_table_matches_every_command_and_the_engine():
    """Every option with an environment variable, and every flag the engine names a setting for,
    is in SETTINGS under its own flag and variable."""
    seen = set()
    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            if param.name not in SETTINGS:
                assert not getattr(param, "envvar", None), (name, param.name)
                continue
            s = SETTINGS[param.name]
            assert (s.flag, s.env) == (param.opts[0], param.envvar or None), (name, param.name)
            assert s.off == (param.secondary_opts[0] if param.secondary_opts else None)
            seen.add(param.name)
    flagged = {name for name, s in SETTINGS.items() if s.flag is not None}
    assert seen == flagged
    for name, env in (("harvest", policy.HARVEST_ENV), ("vt", policy.VT_ENV), ("tau", policy.TAU_ENV),
                      ("adapt", policy.ADAPT_ENV), ("verify_cap", policy.VERIFY_CAP_ENV),
                      ("markov", policy.MARKOV_ENV), ("vt_cost", policy.VT_COST_ENV)):
        assert SETTINGS[name].env == env


def test_the_engine_names_settings_and_the_cli_names_flags():
    with pytest.raises(SettingError) as e:
        policy.parse_verify_window("confidence", None, "0")
    assert str(e.value) == ("vt='confidence' together with adapt='0' is contradictory (a pinned fixed window vs "
                            "a per-round confidence window); drop one")
    assert "MEMRA_" not in str(e.value) and "--" not in str(e.value)
    assert e.value.flag_message("--vt") == ("--vt confidence together with adapt='0' is contradictory (a pinned "
                                            "fixed window vs a per-round confidence window); drop one")
    suggestion = SettingError("vt", "confidence", "{vt} with {spec}: use {spec=dspark}", settings={"spec": "dflash"})
    assert str(suggestion) == "vt='confidence' with spec='dflash': use spec='dspark'"
    assert suggestion.render(lambda n, v: f"<{n} {v}>") == "<vt confidence> with <spec dflash>: use <spec dspark>"
    odd = SettingError("prec", "q4", "/a{b}/x.gguf is {unknown} here")  # braces that are not settings stay
    assert str(odd) == "prec='q4': /a{b}/x.gguf is {unknown} here"
