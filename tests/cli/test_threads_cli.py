"""The CPU thread policy of generate and bench: one thread for a small target's narrow steps (a
second one only adds a synchronisation per op, and collapses when the other core is busy) and the
idle cores for its steps of 8+ rows, the user's choice
when there is one, the free cores for a larger target; always said in a note and in --json, and
torch's setting restored when an in-process run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.cli.threads import SMALL_TARGET_PARAMS, choose_threads, decide
from memra_cli.engine.errors import SettingError

runner = CliRunner()

EMBEDDED_PARAMS = 5_771_264


def _choose(requested=None, device="cpu", params=EMBEDDED_PARAMS, env=None, default=2, cores=2, load=0.0,
            from_env=False, idle=None):
    return choose_threads(requested, device, params, env=env or {}, default=default, cores=cores, load=load,
                          idle=idle, from_env=from_env)


def test_the_policy():
    small = _choose(idle=1.96)
    assert (small.threads, small.wide) == (1, 2) and small.note == (
        "CPU threads: 1, 2 for steps of 8+ rows (small target, 5.8M params: a second thread pays only on wide "
        "steps; 2.0 of 2 cores idle; --threads N to choose)")
    busy = _choose(idle=1.1)  # another process holds a core: no second thread for any step
    assert (busy.threads, busy.wide) == (1, None) and busy.note == (
        "CPU threads: 1 (small target, 5.8M params: a second thread only adds synchronisation per op; "
        "1.1 of 2 cores idle for wide steps; --threads N to choose)")
    assert _choose(load=1.3).wide is None and _choose(load=0.2).wide == 2  # idle unknown: cores less the load
    assert _choose(idle=8.0, cores=8, default=8).wide == 2  # at most WIDE_MAX
    assert _choose(idle=8.0, cores=8, default=1).wide is None  # and torch's default
    assert _choose(idle=2.0, default=1).wide is None and _choose(idle=2.0, default=1).note.endswith(
        "per op; --threads N to choose)")  # torch held to one thread: nothing about cores to say
    assert _choose(idle=1.0, cores=1, default=1).note.endswith("per op; --threads N to choose)")
    assert _choose(params=SMALL_TARGET_PARAMS, idle=0.0).wide is None  # a larger target: one count for every step
    assert _choose(params=SMALL_TARGET_PARAMS).threads == 2  # a larger target on an idle machine: every core
    assert _choose(params=SMALL_TARGET_PARAMS, load=1.2).threads == 1  # ... less the cores other work holds
    assert _choose(params=SMALL_TARGET_PARAMS, load=7.0).threads == 1  # at least one
    assert _choose(params=SMALL_TARGET_PARAMS, cores=16, default=8, load=3.0).threads == 8  # at most torch's default
    assert _choose(params=SMALL_TARGET_PARAMS, load=1.2).note == (
        "CPU threads: 1 of 2 (32.0M params; 1-minute load 1.2 on 2 cores; --threads N to choose)")
    assert _choose(params=None, cores=4, default=4, load=1.0).threads == 3  # size unknown: taken as large
    assert _choose(requested=3) == _choose(requested=3, params=10**10)  # the user's choice wins
    assert _choose(requested=3).note == "CPU threads: 3 (--threads)"
    assert _choose(requested=3, from_env=True).note == "CPU threads: 3 (MEMRA_THREADS)"
    omp = _choose(env={"OMP_NUM_THREADS": "2"})
    assert omp.threads is None and omp.note == "CPU threads: 2 (OMP_NUM_THREADS=2)"  # torch read it at start
    assert _choose(device="cuda") == _choose(device="cuda", params=10**10)  # CUDA: left alone, nothing to say
    assert _choose(device="cuda").threads is None and _choose(device="cuda").note is None
    assert _choose(requested=2, device="cuda").threads == 2  # unless the user asks


def test_a_cgroup_quota_bounds_the_cores(tmp_path):
    from memra_cli.engine.threads import cgroup_cpus

    quota = tmp_path / "cpu.max"
    for text, want in (("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000", 1),
                       ("garbage", None)):
        quota.write_text(text)
        assert cgroup_cpus(str(quota)) == want, text
    assert cgroup_cpus(str(tmp_path / "absent")) is None


def test_idle_cores_are_the_idle_share_of_the_ticks_over_the_window(tmp_path, monkeypatch):
    """The ticks read before and after the window (the sleep), their idle + iowait share times the
    machine's CPUs, capped at this process's cores; one sample kept; an unreadable file is None."""
    import memra_cli.engine.threads as threads

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4 5\n")
    monkeypatch.setattr(threads, "_IDLE_SAMPLE", [None])
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    # over the window: 400 ticks, 150 of them idle and 50 iowait: half of four CPUs idle
    monkeypatch.setattr(threads.time, "sleep", lambda s: stat.write_text("cpu  200 0 200 850 150 0 0 0 0 0\n"))
    assert threads.idle_cores(4, stat=str(stat)) == 2.0
    stat.write_text("garbage")
    assert threads.idle_cores(4, stat=str(stat)) == 2.0  # the kept sample
    monkeypatch.setattr(threads, "_IDLE_SAMPLE", [None])
    assert threads.idle_cores(4, stat=str(stat)) is None
    assert threads.idle_cores(4, stat=str(tmp_path / "absent")) is None
    stat.write_text("cpu  0 0 0 0 0 0 0 0\n")
    monkeypatch.setattr(threads.time, "sleep", lambda s: stat.write_text("cpu  0 0 0 100 0 0 0 0\n"))
    assert threads.idle_cores(1, stat=str(stat)) == 1.0  # every CPU idle, capped at this process's one core


def test_decide_refuses_what_the_flag_refuses():
    """A Python caller gets the same check the option's callback makes."""
    with pytest.raises(SettingError, match="threads='0': expected a positive integer"):
        decide("0", "cpu", Path("unused"))


GENERATE = ["generate", "--spec", "off", "--prompt-ids", "5,6,7", "--max-new", "3"]


@pytest.mark.parametrize("args, env, threads, note", [
    ([], {}, 1, "note: CPU threads: 1 (small target, 5.8M params: a second thread only adds synchronisation per op"),
    (["--threads", "2"], {}, 2, "note: CPU threads: 2 (--threads)"),
    ([], {"MEMRA_THREADS": "2"}, 2, "note: CPU threads: 2 (MEMRA_THREADS)"),
    ([], {"OMP_NUM_THREADS": "3"}, None, "note: CPU threads: "),
])
def test_generate_applies_says_and_restores(monkeypatch, args, env, threads, note):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the caller's, if any, would decide every case
    monkeypatch.setattr("memra_cli.engine.threads.idle_cores", lambda cores: 0.4)  # a busy machine: one count
    torch.set_num_threads(3)  # not the policy's 1 nor --threads 2: what comes back is the process's own
    try:
        obj = json.loads(runner.invoke(app, GENERATE + args + ["--json"], env=env).stdout)
        assert obj["threads"] == (3 if threads is None else threads)
        assert torch.get_num_threads() == 3  # an in-process run leaves the process as it found it
        r = runner.invoke(app, GENERATE + args, env=env)
        assert r.exit_code == 0, r.output
        assert any(line.startswith(note) for line in r.stderr.splitlines()), r.stderr
        if "OMP_NUM_THREADS" in env:
            assert "note: CPU threads: 3 (OMP_NUM_THREADS=3)" in r.stderr.splitlines()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)  # the session's setting (conftest)


def test_a_refused_run_restores_the_setting_too():
    before = torch.get_num_threads()
    r = runner.invoke(app, ["generate", "--spec", "off", "--prompt-ids", "5,6,7", "--max-new", "1000000",
                            "--threads", "2"])
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: prompt (3 tokens)"), r.output  # by the
    # engine, once the threads were set
    assert torch.get_num_threads() == before


def test_bench_applies_and_reports_it(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    base = ["bench", "--n", "1", "--max-new", "2", "--warmup", "0", "--arm", "off"]
    before = torch.get_num_threads()
    r = runner.invoke(app, base + ["--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["threads"] == 1
    monkeypatch.setattr("memra_cli.engine.threads.idle_cores", lambda cores: 2.0)  # an idle 2-core machine
    torch.set_num_threads(2)  # torch's default there
    try:
        r = runner.invoke(app, base + ["--json"])
        assert (json.loads(r.stdout)["threads"], json.loads(r.stdout)["threads_wide"]) == (1, 2)
        r = runner.invoke(app, base)
        assert "note: CPU threads: 1, 2 for steps of 8+ rows (small target" in r.stderr
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    r = runner.invoke(app, base + ["--threads", "2"])
    assert r.exit_code == 0, r.output
    assert "note: CPU threads: 2 (--threads)" in r.stderr.splitlines()
    r = runner.invoke(app, base + ["--json"], env={"MEMRA_THREADS": "2"})
    assert json.loads(r.stdout)["threads"] == 2
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("command", [GENERATE, ["bench", "--n", "1", "--arm", "off"]])
def test_a_bad_thread_count_is_one_line_naming_what_was_typed(command):
    for value in ("0", "-1", "two", "1.5", "²"):
        r = runner.invoke(app, command + ["--threads", value])
        assert r.exit_code == 2 and r.stderr.strip() == (
            f"error: --threads {value}: expected a positive integer (CPU threads per op)"), (value, r.output)
    r = runner.invoke(app, command, env={"MEMRA_THREADS": "0"})
    assert r.exit_code == 2 and r.stderr.strip() == (
        "error: --threads / MEMRA_THREADS=0 (from the environment): expected a positive integer (CPU threads per op)")
