"""The GPU benchmark suite: one entry point, parts chosen by name, one results folder.

    python -m benchmarks.gpu.suite --parts target_step,drafter_round,hybrid_step,embedded_bench,tests --out DIR

Each part runs the kept script (or `memra bench`, or pytest) in its own process under its own
time cap, writes a results file named by what it measures into DIR, and the suite writes
DIR/suite.json (per part: the command, exit code, seconds, files) after every part, so a run cut
short keeps what it measured. Parts run in the order given. The whole run is held under
`--budget-s` (a device call is at most 10 minutes): a part gets the smaller of its cap and what
is left, and is skipped (recorded so) when less than `MIN_PART_S` is left.

`--tiny`: the parts that have a CPU mode run it (the smoke test, tests/benchmarks); the others
are recorded as skipped. `--dry-run`: print and record every part's command, run nothing.
docs/perf.md, "How to measure", lists the parts and the numbers each one gives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MIN_PART_S = 20.0
# the embedded bench's arms (docs/bench.md): off and plain are the baselines every ratio uses
BENCH_ARMS = ("off", "plain", "dflash", "dspark", "dspark:vt=ladder", "dspark:adapt=0")


@dataclass(frozen=True)
class Part:
    """One measurement: `commands(out, tiny)` -> argv lists (None: no CPU mode), its cap, and
    whether a command's stdout is the results file (`stdout_to`, relative to DIR)."""

    name: str
    what: str
    cap_s: float
    commands: Callable[[Path, bool], list[list[str]] | None]
    stdout_to: str | None = None


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _target_step(out: Path, tiny: bool):
    if tiny:
        return None  # the 8B-shape step is a GPU measurement only
    return [_py("-m", "benchmarks.gpu.target_step", "--prefill-length", "0", "--json", str(out / "target_step.json"))]


QUANT_TUNED = "quant_tuned.json"  # the quant_sweep part's whole quant_linear TUNED table


def _exactness_8b(out: Path, tiny: bool):
    if tiny:
        return None  # the 8B-shape sessions run on the GPU only (tests/engine: the sweep's logic at tiny shapes)
    return [_py("-m", "benchmarks.gpu.target_step", "--variants", "triton", "--contexts", "512", "--prefill-length", "0",
                "--sweep-lengths", "512,4096,16384", "--sweep-prompts", "20", "--sweep-tokens", "256",
                "--json", str(out / "exactness_8b.json"))]


def _quant_tuned(out: Path) -> list[str]:
    """`--quant-tuned` of the table the quant_sweep part wrote earlier in this run, if it ran."""
    return ["--quant-tuned", str(out / QUANT_TUNED)] if (out / QUANT_TUNED).exists() else []


def _drafter_round(out: Path, tiny: bool):
    args = ["--tiny", "--prompts", "2"] if tiny else ["--reps", "20", "--budget-s", "60", "--draft-vocab", "32768",
                                                      *_quant_tuned(out)]
    return [_py("-m", "benchmarks.gpu.drafter_round", *args, "--json", str(out / "drafter_round.json"))]


def _quant_sweep(out: Path, tiny: bool):
    if tiny:
        return None  # the kernel's tiles are timed on the GPU only (tests/engine/test_quant_sweep_script.py: its logic)
    return [_py("-m", "benchmarks.gpu.quant_linear_sweep", "--budget-s", "190", "--json", str(out / "quant_sweep.json"),
                "--tuned", str(out / QUANT_TUNED))]


def _hybrid_step(out: Path, tiny: bool):
    args = ["--tiny", "--ckpt", str(out / "hybrid_tiny_ckpt")] if tiny else []
    return [_py("-m", "benchmarks.gpu.hybrid_step", *args, "--json", str(out / "hybrid_step.json"))]


DENSE_TUNED = "dense_tuned.json"  # the dense_sweep part's whole TUNED table


def _dense_tuned(out: Path) -> list[str]:
    """`--dense-tuned` of the table the dense_sweep part wrote earlier in this run, if it ran."""
    return ["--dense-tuned", str(out / DENSE_TUNED)] if (out / DENSE_TUNED).exists() else []


def _dense_sweep(out: Path, tiny: bool):
    if tiny:
        return None
    return [_py("-m", "benchmarks.gpu.dense_linear_sweep", "--shapes", "llama,moe-a3b", "--budget-s", "170",
                "--json", str(out / "dense_sweep.json"), "--tuned", str(out / DENSE_TUNED))]


def _llama_step(out: Path, tiny: bool):
    if tiny:
        return None  # an 8B-shape step is a GPU measurement only
    return [_py("-m", "benchmarks.gpu.target_step", "--family", "llama", "--contexts", "512,32768",
                "--sweep-lengths", "512", "--sweep-prompts", "3", "--prefill-length", "0",
                "--variants", "torch,triton,triton-tile", "--attn-tile", _long_tile(out),  # the attention's A/B
                *_dense_tuned(out), "--json", str(out / "llama_step.json"))]


# The head_dim-128 tile before the long_attention part's pick became the module's (32-key blocks,
# no growing splits): the whole step's A/B of that change (docs/tuning.md#attention-tiles)
PREVIOUS_TILE_128 = "256,32,64,3,4"
LONG_PICK = "attn_long_pick.txt"  # the long_attention part's pick


def _long_tile(out: Path) -> str:
    """The long_attention part's pick when it ran earlier in this run and is not the module's own
    tile, else PREVIOUS_TILE_128 (an A/B of the module's tile against itself measures nothing)."""
    from memra_kernels import attention

    pick = (out / LONG_PICK).read_text().strip() if (out / LONG_PICK).exists() else ""
    if pick and attention.Tile(*(int(v) for v in pick.split(","))) != attention.TILES[128]:
        return pick
    return PREVIOUS_TILE_128


def _long_attention(out: Path, tiny: bool):
    if tiny:
        return None
    return [_py("-m", "benchmarks.gpu.long_attention", "--candidates", "wide", "--pick-long", str(out / LONG_PICK),
                "--json", str(out / "long_attention.json"))]


def _gemma4_step(out: Path, tiny: bool):
    if tiny:
        return None
    return [_py("-m", "benchmarks.gpu.target_step", "--shape", "gemma4-31b", "--contexts", "512,32768",
                "--attn-sweep", "--json", str(out / "gemma4_31b_step.json"))]  # the attention's tiles beside it


def _gemma4_tiles(out: Path, tiny: bool):
    if tiny:
        return None
    return [_py("-m", "benchmarks.gpu.target_step", "--shape", "gemma4-31b", "--contexts", "512,32768",
                "--gemma-ops", "triton", "--json", str(out / "gemma4_31b_tiles.json"))]


def _moe_step(out: Path, tiny: bool):
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--vts", "1,4", "--iters", "2"] if tiny else \
        ["--shape", "a3b", "--device", "cuda", "--dtype", "bfloat16", "--ops", "triton",  # the twin's eager
         "--vts", "1,2,4,8,12,16", "--iters", "10",  # steps overran the cap (its op still runs in the op rows)
         # candidates beside moe.CONFIG; 64x64x128x4x3x1: CONFIG's tiles on the work items, the grid's A/B
         "--tiles", "64x64x128x4x3x1,32x64x128x4x3,64x32x64x4x4",
         "--router-chunks", "128,256,512,1024,2048"]  # the router's chunk (moe_route.ROUTER_CHUNK)
    return [_py("-m", "benchmarks.moe_step", *args, *([] if tiny else _dense_tuned(out)),
                "--json", str(out / "moe_step.json"))]


def _moe_profile(out: Path, tiny: bool):
    if tiny:
        return None  # the profile needs CUDA
    return [_py("-m", "benchmarks.moe_step", "--shape", "a3b", "--device", "cuda", "--dtype", "bfloat16",
                # the router's ranked expert list against the grid over every expert, both profiled
                "--ops", "triton,triton-unrouted", "--vts", "1,16", "--iters", "10",
                "--profile", *_dense_tuned(out),
                "--json", str(out / "moe_profile.json"))]


def _moe_hybrid_step(out: Path, tiny: bool):
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32"] if tiny else \
        ["--shape", "a3b", "--device", "cuda", "--dtype", "bfloat16",  # the fusions' A/B; the torch twin's eager
         "--ops", "triton,triton-unfused", "--iters", "10"]  # steps overran the part's cap before the kernels' rows
    return [_py("-m", "benchmarks.moe_hybrid_step", *args, "--json", str(out / "moe_hybrid_step.json"))]


def _moe_hybrid_profile(out: Path, tiny: bool):
    if tiny:
        return None  # the profile needs CUDA
    return [_py("-m", "benchmarks.moe_hybrid_step", "--shape", "a3b", "--device", "cuda", "--dtype", "bfloat16",
                "--ops", "triton,triton-route4w", "--vts", "1,16", "--iters", "10", "--profile",  # route_warps' A/B
                "--json", str(out / "moe_hybrid_profile.json"))]


def _hf_step(out: Path, tiny: bool):
    shapes = ("tiny-llama", "tiny-gemma4", "tiny-moe") if tiny else ("llama-8b", "gemma4-31b", "qwen3-30b-a3b")
    args = ["--device", "cpu", "--dtype", "float32", "--iters", "2", "--context", "64"] if tiny else []
    return [_py("-m", "benchmarks.gpu.hf_step", "--shape", s, *args, "--json", str(out / f"hf_step_{s}.json"))
            for s in shapes]


def _train_throughput(out: Path, tiny: bool):
    args = ["--tiny"] if tiny else ["--kind", "dspark"]
    return [_py("-m", "benchmarks.gpu.train_throughput", *args, "--json", str(out / "train_throughput.json"))]


def _serve_single(out: Path, tiny: bool):
    args = ["--device", "cpu", "--requests", "2", "--max-tokens", "8"] if tiny else \
        ["--device", "cuda", "--requests", "16", "--max-tokens", "256"]
    return [_py("-m", "benchmarks.serve_load", "single", *args, "--json")]


def _serve_load(out: Path, tiny: bool):
    args = ["--device", "cpu", "--requests", "4", "--clients", "2", "--max-tokens", "8"] if tiny else \
        ["--device", "cuda", "--requests", "200", "--clients", "16", "--max-tokens", "64", "--timeout-s", "280"]
    return [_py("-m", "benchmarks.serve_load", "load", *args, "--json")]


def _embedded_bench(out: Path, tiny: bool):
    size = ["--n", "2", "--max-new", "8", "--warmup", "0"] if tiny else ["--max-new", "128", "--warmup", "2"]
    arms = [a for arm in BENCH_ARMS for a in ("--arm", arm)]
    return [_py("-m", "memra_cli", "bench", "--prompts", "stdlib", *size, *arms, "--json")]


def _embedded_vocab(out: Path, tiny: bool):
    size = ["--n", "2", "--max-new", "8", "--count-max-new", "8", "--warmup", "0"] if tiny else []
    return [_py("-m", "benchmarks.embedded_vocab", "--json", str(out / "embedded_vocab_humaneval.json"),
                "--tops", "256,512,1024", *size)]


def _embedded_dense(out: Path, tiny: bool):
    size = ["--n", "2", "--max-new", "8", "--warmup", "0", "--device", "cpu"] if tiny else \
        ["--max-new", "128", "--warmup", "2"]
    arms = [a for arm in ("off", "plain", "dspark", "dflash") for a in ("--arm", arm)]
    return [_py("-m", "benchmarks.gpu.embedded_dense", "--table", table, "--out", str(out / f"embedded_dense_{table}.json"),
                "--prompts", "humaneval", *size, *arms, "--json") for table in ("cublas", "dense-combine", "dense")]


def _embedded_round(out: Path, tiny: bool):
    args = ["--device", "cpu", "--reps", "2"] if tiny else []
    return [_py("-m", "benchmarks.gpu.embedded_round", *args, "--json", str(out / "embedded_round.json"))]


def _bandwidth(out: Path, tiny: bool):
    args = ["--device", "cpu", "--gib", "0.03125", "--reps", "3"] if tiny else []
    return [_py("-m", "benchmarks.gpu.bandwidth", *args, "--json", str(out / "bandwidth.json"))]


def _kernels(out: Path, tiny: bool):
    if tiny:
        return None
    return [_py("-m", "benchmarks.gpu.kernels_target"), _py("-m", "benchmarks.gpu.kernels_quant")]


def _tests(out: Path, tiny: bool):
    if tiny:
        return None  # every gpu-marked test skips on the CPU
    # both tiers (tests/conftest.py): `--exhaustive` selects only the exhaustive-marked cases
    report = ["-rfE", "--durations=25"]  # failures named, and where the part's time goes
    return [_py("-m", "pytest", "-q", "-m", "gpu", *report, "-p", "no:cacheprovider", "tests"),
            _py("-m", "pytest", "-q", "-m", "gpu", "--exhaustive", *report, "-p", "no:cacheprovider", "tests")]


# the MoE path's own gpu-marked tests: the kernels, the router and the families' graphed sessions
MOE_TESTS = ("tests/kernels/test_moe.py", "tests/kernels/test_moe_route.py", "tests/kernels/test_moe_target.py",
             "tests/engine/test_qwen3_moe.py", "tests/engine/test_qwen3_5_moe.py", "tests/engine/test_gemma4_moe.py")


def _moe_tests(out: Path, tiny: bool):
    if tiny:
        return None
    report = ["-rfE", "--durations=10"]
    return [_py("-m", "pytest", "-q", "-m", "gpu", *report, "-p", "no:cacheprovider", *MOE_TESTS),
            _py("-m", "pytest", "-q", "-m", "gpu", "--exhaustive", *report, "-p", "no:cacheprovider", *MOE_TESTS)]


PARTS = {p.name: p for p in (
    Part("bandwidth", "copy and read floors, GB/s", 40, _bandwidth),
    Part("target_step", "Qwen3-8B-shape graphed step vs its floor, ms", 150, _target_step),
    Part("exactness_8b", "Qwen3-8B-shape speculative == plain greedy with the shipped kernels: 20 prompts x 256 "
         "tokens at 512, 4,096 and 16,384 keys (an oracle proposer with one corrupted slot; the random DFlash drafter "
         "on three), and the triton step at 512 keys beside it", 420, _exactness_8b),
    Part("quant_sweep", "the q8_0 / q4_0 kernel's tiles on every shape the 8B-shape drafter launches, µs and fraction of "
         "copy bandwidth at M = 16; writes the whole table a later drafter_round part loads", 240, _quant_sweep),
    Part("drafter_round", "Qwen3-8B-shape DFlash drafter's side of a round and the round (with quant_sweep's table "
         "when that part ran first), and both again with a 32,768-token draft vocabulary, ms", 140, _drafter_round),
    Part("hybrid_step", "Qwen3.5-4B-shape hybrid step, the 16-wide plain token with its padding skipped and run, verify, "
         "rollback, rounds, ms", 180, _hybrid_step),
    Part("dense_sweep", "the dense kernel's tiles against cuBLAS at the LLaMA-8B and Qwen3-30B-A3B weight shapes "
         "the 8B table lacks, µs; writes the whole table the later parts of the run load", 200, _dense_sweep),
    Part("long_attention", "the head_dim-128 attention alone at the 8B shape, 512 to 32768 keys, 1 and 16 rows, over "
         "inner blocks, stages, warps and growing splits, µs a layer; picks the fastest at 32768 keys that is no "
         "slower at 512 and 4096, which a later llama_step times in the whole step", 120, _long_attention),
    Part("llama_step", "LLaMA-3.1-8B-shape graphed step vs its floor (the shipped attention tile beside long_attention's "
         "pick, or the tile before it; with dense_sweep's table when that part ran first), ms", 150, _llama_step),
    Part("gemma4_step", "Gemma-4-31B text-shape step vs its floors, Triton and torch step ops, ms; its attention "
         "alone at both layer shapes over candidate tiles (the full layers' pick in the whole step), the sliding "
         "layers on the causal grid beside the window grid, µs", 400, _gemma4_step),
    Part("gemma4_tiles", "Gemma-4-31B text-shape step with the Triton step ops: the module tiles, the sliding "
         "layers on the causal grid, the full layers on gemma4_step.STEP_FULL_TILES, ms (no sweep, no torch ops)",
         240, _gemma4_tiles),
    Part("moe_step", "Qwen3-30B-A3B-shape MoE step at vt rows on the MoE kernels, and the MoE op (the twin's, the "
         "kernels' at other tiles and grids), vs the read floor of the expert union, ms", 240, _moe_step),
    Part("moe_profile", "Qwen3-30B-A3B-shape 16-row step at 1 and 16 live rows: graphed ms vs the floor (the "
         "expert matmuls over the router's ranked list, and over every expert), and each one's kernels by name under "
         "the profiler, µs", 150, _moe_profile),
    Part("moe_hybrid_step", "Qwen3.5-35B-A3B-shape hybrid MoE step at vt rows on the MoE kernels, fused and unfused "
         "(eager and graphed), vs its read floor, ms", 200,
         _moe_hybrid_step),
    Part("moe_hybrid_profile", "Qwen3.5-35B-A3B-shape 16-row step at 1 and 16 live rows, its 256-expert routing tiles "
         "on route_warps' 8 warps and on 4: graphed ms vs the floor, and each one's kernels by name under the profiler, "
         "µs", 150, _moe_hybrid_profile),
    Part("hf_step", "transformers' own decode at the LLaMA-3.1-8B, Gemma-4-31B and Qwen3-30B-A3B shapes, ms/token "
         "and peak memory (beside llama_step, gemma4_step, moe_step)", 300, _hf_step),
    Part("train_throughput", "memra train's step at the Qwen3-8B shape with online taps, target tokens/s", 150,
         _train_throughput),
    Part("serve_single", "memra serve's per-request tok/s against generate, one client (needs the serve wheels)", 240,
         _serve_single, stdout_to="serve_single.json"),
    Part("serve_load", "memra serve under 200 requests from 16 clients, every stream against plain decoding", 300,
         _serve_load, stdout_to="serve_load.json"),
    Part("embedded_bench", "the embedded pair's bench on the stdlib set, tok/s and tau", 140, _embedded_bench,
         stdout_to="embedded_bench_stdlib.json"),
    Part("embedded_vocab", "the embedded pair's bench on HumanEval with draft vocabularies of 256, 512 and 1,024 "
         "tokens (ranked over MBPP and the target's continuations) beside the whole vocabulary: tau, tok/s, the "
         "exactness gate", 300, _embedded_vocab),
    Part("embedded_dense", "the embedded pair's bench on HumanEval with its weight matmuls on the dense kernel with its "
         "launch fusions (as shipped), the same with an attention of one split in two launches (dense-combine), "
         "and on cuBLAS (benchmarks/gpu/embedded_dense.py), one process each: tok/s, tau, the exactness gate", 240,
         _embedded_dense),
    Part("embedded_round", "the embedded pair's graphed DSpark and DFlash rounds replayed (GPU ms), and their parts "
         "(propose, verify, ingest) eagerly under the profiler: kernels, GPU µs, the heaviest kernels "
         "(benchmarks/gpu/embedded_round.py)", 90, _embedded_round),
    Part("kernels", "the Triton kernels against torch and cuBLAS at the 8B shape, µs", 200, _kernels),
    Part("tests", "the gpu-marked tests on the device, both tiers", 420, _tests, stdout_to="gpu_tests.txt"),
    Part("moe_tests", "the MoE modules' gpu-marked tests (kernels, router, the families' graphed sessions), both "
         "tiers: the tests part's MoE share, for a call that changed only the MoE path", 180, _moe_tests,
         stdout_to="gpu_moe_tests.txt"),
)}
DEFAULT_PARTS = "target_step,drafter_round,hybrid_step,embedded_bench,tests"


def run_part(part: Part, out: Path, tiny: bool, limit_s: float, dry_run: bool) -> dict:
    """Run one part's commands in order under `limit_s` in all; its record for suite.json."""
    cmds = part.commands(out, tiny)
    rec: dict = {"what": part.what, "commands": None if cmds is None else [" ".join(["python", *c[1:]]) for c in cmds]}
    if cmds is None:
        return {**rec, "skipped": "no CPU mode (--tiny)"}
    if dry_run:
        return {**rec, "skipped": "dry run"}
    t0, rcs = time.monotonic(), []
    for cmd in cmds:
        left = limit_s - (time.monotonic() - t0)
        sink = open(out / part.stdout_to, "a") if part.stdout_to else None
        try:
            proc = subprocess.run(cmd, stdout=sink, timeout=max(1.0, left), env=_env(out))
            rcs.append(proc.returncode)
        except subprocess.TimeoutExpired:
            rcs.append(124)
        finally:
            if sink:
                sink.close()
        if rcs[-1] == 124:
            break
    return {**rec, "rc": rcs, "ok": all(rc == 0 for rc in rcs), "seconds": round(time.monotonic() - t0, 1)}


def _env(out: Path) -> dict:
    """The child's environment: OUT points at the results folder (scripts that write there by
    default, kernels_target and kernels_quant, use it)."""
    return {**os.environ, "OUT": str(out)}


def parse_parts(text: str) -> list[Part]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        print(f"error: --parts {text!r}: unknown part(s) {', '.join(unknown) or '(none given)'}; "
              f"expected a comma-separated list of {', '.join(PARTS)}", file=sys.stderr)
        raise SystemExit(2)
    return [PARTS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated, in order, of: {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, required=True, help="results folder (created)")
    p.add_argument("--budget-s", type=float, default=570.0, help="wall-clock budget of the whole run")
    p.add_argument("--tiny", action="store_true", help="CPU modes only (smoke test)")
    p.add_argument("--dry-run", action="store_true", help="record the commands, run nothing")
    a = p.parse_args(argv)
    parts = parse_parts(a.parts)
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python -m benchmarks.gpu.suite " + " ".join(sys.argv[1:] if argv is None else argv),
              "parts": {}}
    t0 = time.monotonic()
    for part in parts:
        left = a.budget_s - (time.monotonic() - t0)
        if left < MIN_PART_S and not a.dry_run:
            report["parts"][part.name] = {"what": part.what, "skipped": f"budget spent ({left:.0f} s left)"}
        else:
            report["parts"][part.name] = run_part(part, a.out, a.tiny, min(part.cap_s, left), a.dry_run)
        print(f"[suite] {part.name}: {json.dumps(report['parts'][part.name])}", flush=True)
        (a.out / "suite.json").write_text(json.dumps(report, indent=1))
    report["seconds"] = round(time.monotonic() - t0, 1)
    (a.out / "suite.json").write_text(json.dumps(report, indent=1))
    ran = [r for r in report["parts"].values() if "ok" in r]
    return 0 if all(r["ok"] for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
