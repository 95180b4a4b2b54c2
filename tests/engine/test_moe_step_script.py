"""benchmarks/moe_step.py on the tiny shape on the CPU: it builds a random MoE target in memory,
times steps of several widths and the MoE op alone over every sparse layer (the twin: the kernels
need CUDA), counts the experts each ran and writes its table; the kernels off CUDA are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_step.py"), "--shape", "tiny", "--device",
                           "cpu", "--dtype", "float32", "--iters", "1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.exhaustive  # the whole script through the interpreter; its refusals stay quick
def test_times_steps_and_counts_their_experts(tmp_path):
    out = tmp_path / "moe.json"
    proc = _run("--vts", "1,16", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows, ops = result["rows"], result["op_rows"]
    # the twin alone on the CPU; vt=1 also as the engine's 16-row step with one live row, a verify's
    # and the plain round's (one row read)
    assert [(r["ops"], r["vt"], r["width"], r.get("reads")) for r in rows] == [
        ("torch", 1, None, None), ("torch", 1, 16, None), ("torch", 1, 16, 1), ("torch", 16, None, None)]
    assert rows[0]["experts_per_layer"] == 2.0  # one row runs exactly its top-2
    assert rows[1]["experts_per_layer"] == rows[2]["experts_per_layer"] == 2.0  # one live row: padding runs none
    assert 2.0 < rows[3]["experts_per_layer"] <= 8.0  # 16 random rows run a wider union
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and "graph_ms" not in r for r in rows)
    assert [r["vt"] for r in ops] == [1, 16] and ops[0]["experts_per_layer"] == 2.0
    assert all(r["twin_us"] > 0 and r["route_twin_us"] > 0 and r["floor_us"] > 0 and "kernel_us" not in r for r in ops)


def test_the_kernels_off_cuda_are_refused_in_one_line():
    proc = _run("--ops", "torch,triton")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --ops 'torch,triton': expected some of torch, triton, triton-unfused, triton-route4w, "
        "triton-a3b-cublas, triton-unrouted (the triton ones need --device cuda)"]
    proc = _run("--tiles", "64x64x128x4x3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --tiles '64x64x128x4x3': the kernels need --device cuda"]



def test_a_negative_width_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_step import main

    assert main(["--shape", "tiny", "--device", "cpu", "--width", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --width -1: expected a row count (0: only the vt-row steps)"]


def test_tiles_take_the_program_count_and_bad_ones_are_refused_in_one_line(capsys, monkeypatch):
    """`--tiles` takes five fields (the programs per multiprocessor: moe.CONFIG's) or six (0: a
    program per (expert, tile), the grid the A/B compares against); other counts are refused."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_step import main, parse_tiles, tiles_name
    from memra_kernels.moe import CONFIG

    got = parse_tiles("64x64x128x4x3,32x64x128x4x4x0")
    assert [tiles_name(c) for c in got] == [f"64x64x128x4x3x{CONFIG.programs_per_sm}", "32x64x128x4x4x0"]
    for bad, why in (("64x64x128", "'64x64x128' has 3 fields, not 5 or 6"),
                     ("64x64x128x4x3x-1", "programs_per_sm must be >= 0, got -1")):
        assert main(["--shape", "tiny", "--device", "cpu", "--tiles", bad]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: --tiles {bad!r}: {why} (expected e.g. 64x64x128x4x3 or 64x64x128x4x3x0)"]


def test_router_chunks_take_powers_of_two_and_need_cuda(capsys, monkeypatch):
    """`--router-chunks` takes powers of two >= 16 (the router kernel's tile width); others, and
    any on the CPU (the kernels need CUDA), are refused in one line."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_step import main, parse_router_chunks

    assert parse_router_chunks("") == [] and parse_router_chunks("256,1024") == [256, 1024]
    for bad in ("300", "8", "512,x"):
        assert parse_router_chunks(bad) is None
        assert main(["--shape", "tiny", "--device", "cpu", "--router-chunks", bad]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: --router-chunks {bad!r}: expected powers of two >= 16, comma-separated (e.g. 256,512,1024)"]
    assert main(["--shape", "tiny", "--device", "cpu", "--router-chunks", "256"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --router-chunks '256': the kernels need --device cuda"]


def test_the_a3b_weights_run_on_the_dense_kernel_and_the_cublas_variant_puts_them_back(monkeypatch):
    """dense_linear.TUNED holds the A3B q/k/v and lm_head at unsplit tiles (the q/k/v's rope
    epilogue and the lm_head's argmax need an unsplit K), so the q/k/v takes its rope in one
    launch; `triton-a3b-cublas` takes them out for its steps and restores the table after, also
    when a step raises."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.moe_step import A3B_DENSE_SHAPES, variant_knobs
    from memra_kernels import dense_linear

    before = dict(dense_linear.TUNED)
    assert all(before[shape].split_k == 1 for shape in A3B_DENSE_SHAPES)
    qkv, x = torch.empty(5120, 2048, dtype=torch.bfloat16), torch.empty(16, 2048, dtype=torch.bfloat16)
    assert dense_linear.qkv_rope_eligible(x, qkv, 128)  # its tiles inside the A3B's 128-wide heads
    with variant_knobs("triton-a3b-cublas"):
        assert not set(A3B_DENSE_SHAPES) & set(dense_linear.TUNED)
        assert not dense_linear.qkv_rope_eligible(x, qkv, 128)
        assert dense_linear.TUNED == {k: v for k, v in before.items() if k not in A3B_DENSE_SHAPES}
    assert dense_linear.TUNED == before
    try:
        with variant_knobs("triton-a3b-cublas"):
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert dense_linear.TUNED == before
    with variant_knobs("triton"):
        assert dense_linear.TUNED == before

