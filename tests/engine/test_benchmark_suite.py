"""The GPU suite's plumbing on the CPU (`python -m benchmarks.gpu.suite`): every part has a command,
a part with a CPU mode runs and writes its named results file, a GPU-only part is recorded as
skipped, an unknown part is refused in one line; and the shared timing module's CPU paths."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _suite(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def timing(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # `benchmarks` is a package of the repo, not installed
    return importlib.import_module("benchmarks.timing")


def test_dry_run_records_a_command_for_every_part(tmp_path):
    proc = _suite("--dry-run", "--parts", "bandwidth,target_step,drafter_round,hybrid_step,embedded_bench,"
                  "kernels,tests", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    parts = json.loads((tmp_path / "suite.json").read_text())["parts"]
    assert list(parts) == ["bandwidth", "target_step", "drafter_round", "hybrid_step", "embedded_bench",
                           "kernels", "tests"]
    for name, rec in parts.items():
        assert rec["skipped"] == "dry run" and rec["commands"], name
    assert parts["target_step"]["commands"] == [
        f"python -m benchmarks.gpu.target_step --prefill-length 0 --json {tmp_path / 'target_step.json'}"]
    assert parts["embedded_bench"]["commands"][0].startswith("python -m memra_cli bench --prompts stdlib")
    assert parts["tests"]["commands"] == [  # both tiers, failures named and the slowest listed
        "python -m pytest -q -m gpu -rfE --durations=25 -p no:cacheprovider tests",
        "python -m pytest -q -m gpu --exhaustive -rfE --durations=25 -p no:cacheprovider tests"]


def test_tiny_run_measures_what_has_a_cpu_mode_and_skips_the_rest(tmp_path):
    proc = _suite("--tiny", "--parts", "bandwidth,target_step", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    parts = json.loads((tmp_path / "suite.json").read_text())["parts"]
    assert parts["bandwidth"]["ok"] is True and parts["bandwidth"]["rc"] == [0]
    assert parts["target_step"]["skipped"] == "no CPU mode (--tiny)"
    bw = json.loads((tmp_path / "bandwidth.json").read_text())
    assert bw["device"] == "cpu" and bw["copy_eager_gbps"] > 0 and bw["read_sum_gbps"] > 0


@pytest.mark.exhaustive
def test_tiny_hf_step_times_transformers_for_each_family(tmp_path):
    proc = _suite("--tiny", "--parts", "hf_step", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "suite.json").read_text())["parts"]["hf_step"]["rc"] == [0, 0, 0]
    models = {}
    for shape in ("tiny-llama", "tiny-gemma4", "tiny-moe"):
        rec = json.loads((tmp_path / f"hf_step_{shape}.json").read_text())
        vocab = 640 if shape == "tiny-llama" else 512  # gpu_shapes' llama-small: no two weight roles share a shape
        assert rec["ms_per_token"] > 0 and rec["context"] == 64 and rec["config"]["vocab_size"] == vocab
        models[shape] = rec["model"]
    assert models == {"tiny-llama": "LlamaForCausalLM", "tiny-gemma4": "Gemma4ForCausalLM",
                      "tiny-moe": "Qwen3MoeForCausalLM"}


@pytest.mark.exhaustive  # two tiny bench runs in subprocesses (quick-tier time)
def test_tiny_embedded_dense_runs_the_bench_once_per_table(tmp_path):
    """The three tables' bench reports land in their own files (the bench's stdout redirected at
    the descriptor), each a whole `--json` report with its exactness gate; on the CPU the step ops
    are torch's, so the tables change nothing there and the gates agree. The round's parts
    (embedded_round) run on the CPU too: a report for each drafter."""
    proc = _suite("--tiny", "--parts", "embedded_dense,embedded_round", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    part = json.loads((tmp_path / "suite.json").read_text())["parts"]["embedded_dense"]
    assert part["ok"] and part["rc"] == [0, 0, 0], part
    for table in ("cublas", "dense-combine", "dense"):
        report = json.loads((tmp_path / f"embedded_dense_{table}.json").read_text())
        assert report["exact"] is True and report["prompts"]["n"] == 2
        assert [a["name"] for a in report["arms"]] == ["off", "plain", "dspark", "dflash"]
    rounds = json.loads((tmp_path / "embedded_round.json").read_text())
    assert sorted(rounds["arms"]) == ["dflash", "dspark"] and rounds["device"] == "cpu"


def test_an_unknown_part_is_refused_in_one_line(tmp_path):
    proc = _suite("--parts", "target_step,warp_drive", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --parts 'target_step,warp_drive': unknown part(s) warp_drive; expected a comma-separated list of "
        "bandwidth, target_step, exactness_8b, quant_sweep, drafter_round, hybrid_step, dense_sweep, long_attention, llama_step, "
        "gemma4_step, gemma4_tiles, moe_step, moe_profile, moe_hybrid_step, moe_hybrid_profile, hf_step, train_throughput, "
        "serve_single, serve_load, embedded_bench, embedded_vocab, embedded_dense, embedded_round, kernels, tests, moe_tests"]
    assert not (tmp_path / "suite.json").exists()


def test_median_ms_on_the_cpu_times_each_call(timing):
    calls = []
    ms = timing.median_ms(lambda: calls.append(1), reps=5, warmup=2, device="cpu")
    assert len(calls) == 7 and ms >= 0.0
    assert timing.median([3.0, 1.0, 2.0, 9.0]) == 3.0  # the upper median


def test_copy_and_read_probes_count_their_bytes(timing, monkeypatch):
    """With every call timed at exactly 1 ms, the probes' GB/s are their byte counts per ms: a
    copy moves its bytes twice (read + write), a read once."""
    monkeypatch.setattr(timing, "median_ms", lambda fn, reps, warmup=3, device=None: (fn(), 1.0)[1])
    n = 1 << 20
    assert timing.copy_gbps(n, reps=1, device="cpu") == pytest.approx(2 * n / 1e-3 / 1e9)
    assert timing.read_gbps(n, reps=1, device="cpu") == pytest.approx(n / 1e-3 / 1e9)


@pytest.mark.exhaustive  # a subprocess importing Triton (~1.3 s): the quick tier is near its budget
def test_the_dense_sweep_refuses_an_unknown_shape_set_before_any_work(tmp_path):
    """benchmarks/gpu/dense_linear_sweep.py: an unknown --shapes set is named in one error line
    (exit 2, nothing written), before it asks for a GPU."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.dense_linear_sweep", "--shapes", "llama,bogus",
                           "--json", str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: --shapes: unknown set(s) bogus; expected a comma-separated list of 8b, drafter, hybrid, llama, moe-a3b")
    assert not (tmp_path / "out.json").exists()


def test_llama_step_times_the_long_attention_parts_pick_when_it_ran_first(tmp_path, monkeypatch):
    """The suite chains long_attention -> llama_step as dense_sweep -> llama_step: the step's
    `triton-tile` variant runs the tile the sweep picked earlier in the call unless it is the module's
    own, else the tile before it;
    every WIDE candidate is a valid tile and the module's own tile is the first (the pick's baseline)."""
    monkeypatch.syspath_prepend(str(ROOT))
    suite = importlib.import_module("benchmarks.gpu.suite")
    long_attention = importlib.import_module("benchmarks.gpu.long_attention")
    from memra_kernels import attention

    names = list(suite.PARTS)
    assert names.index("long_attention") < names.index("llama_step")
    assert suite.PARTS["long_attention"].commands(tmp_path, True) is None  # GPU only

    def tile_of(cmd):
        return cmd[cmd.index("--attn-tile") + 1]

    assert tile_of(suite.PARTS["llama_step"].commands(tmp_path, False)[0]) == suite.PREVIOUS_TILE_128
    sweep = suite.PARTS["long_attention"].commands(tmp_path, False)[0]
    assert sweep[sweep.index("--pick-long") + 1] == str(tmp_path / suite.LONG_PICK)
    (tmp_path / suite.LONG_PICK).write_text("256,64,64,3,8\n")
    assert tile_of(suite.PARTS["llama_step"].commands(tmp_path, False)[0]) == "256,64,64,3,8"
    module = attention.TILES[128]
    (tmp_path / suite.LONG_PICK).write_text(",".join(str(v) for v in long_attention.WIDE[0]))  # the module's
    assert tile_of(suite.PARTS["llama_step"].commands(tmp_path, False)[0]) == suite.PREVIOUS_TILE_128
    assert attention.Tile(*long_attention.WIDE[0]) == module
    assert len({attention.Tile(*c) for c in long_attention.WIDE}) == len(long_attention.WIDE)
