"""Throughput of the embedded build's two slow parts, to size a recipe before spending a build on it.

    python -m benchmarks.gpu.train_probe drafter --kind dspark --batches 128,256,512 [--json out.json]
    python -m benchmarks.gpu.train_probe datagen --gen-batches 4096,16384 [--json out.json]

`drafter`: steady-state training steps per second (eager and through torch.compile) of a fresh drafter (the recipe's depth,
taps and block) over the shipped target, at each batch size, on random token sequences of the
build's length (speed does not depend on the text). Reports steps/s and sequences/s. Run two at
once (one per kind) to see what the build's side-by-side stage gets.
`profile`: the torch profiler's kernel table over five training steps at the first batch size.
`datagen`: sequences per second of the greedy continuations the drafter data is made of
(`greedy_forced`, the build's generator), at each generation batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from memra_cli.assets import ASSETS
from memra_cli.assets.build import Recipe, _geometry, shipped
from memra_cli.assets.train import greedy_forced
from memra_cli.train.job import Hyper, TrainJob
from memra_cli.train.online import FixedSequences
from memra_cli.train.taps import HFTaps


def _target(device):
    from memra_cli.hf_compat import protect_kernels_name

    protect_kernels_name()  # the repository's kernels/ folder must not shadow Hugging Face's
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.bfloat16, attn_implementation="sdpa")
    return shipped(model, device)  # as the build runs it


def _setup(kind: str, n_seqs: int, device):
    """(recipe, shipped target, random `[n_seqs, L]` sequences of the build's length as the build's
    data step serves them, the drafter's geometry: the recipe's taps and block, 2 layers)."""
    r = Recipe()
    taps, block = (r.dflash_taps, r.dflash_block) if kind == "dflash" else (r.dspark_taps, r.dspark_block)
    seqs = torch.randint(2, r.vocab, (n_seqs, r.prompt_len + r.cont_len), generator=torch.Generator().manual_seed(0))
    return r, _target(device), FixedSequences(seqs, torch.full((n_seqs,), r.prompt_len)), _geometry(kind, r, taps, block, layers=2)


def _job(r: Recipe, target, data: FixedSequences, geo, batch: int, device, compile: bool) -> TrainJob:
    """The build's drafter training job (build.py `_train`) at `batch` sequences a step."""
    hyper = Hyper(steps=10**9, batch=batch, anchors=r.anchors, lr=r.draft_lr)
    return TrainJob(geo, hyper, data, HFTaps(target), device, list(range(len(data))), compile=compile)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return values


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    if not set(modes) <= {"eager", "compile"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected eager and/or compile, comma-separated")
    return modes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def probe_drafter(kind: str, batches: list[int], steps: int, device, modes: list[str]) -> list[dict]:
    r, target, data, geo = _setup(kind, 4096, device)
    rows = []
    for batch in batches:
        for mode in modes:
            torch._dynamo.reset()
            job = _job(r, target, data, geo, batch, device, mode == "compile")
            t = time.time()
            job.one_step()  # pays start-up and compilation
            _sync(device)
            warm_s, t = time.time() - t, time.time()
            for _ in range(steps):
                job.one_step()
            _sync(device)
            dt = time.time() - t
            row = {"kind": kind, "batch": batch, "mode": mode, "warmup_s": round(warm_s, 1), "steps_per_s": round(steps / dt, 2),
                   "seqs_per_s": round(steps * batch / dt, 1),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def profile_drafter(kind: str, batch: int, device, rows: int = 30) -> str:
    """The torch profiler's table (top `rows` by device time) over 5 training steps."""
    from torch.profiler import ProfilerActivity, profile

    r, target, data, geo = _setup(kind, 1024, device)
    job = _job(r, target, data, geo, batch, device, False)
    for _ in range(5):
        job.one_step()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            job.one_step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def probe_datagen(gen_batches: list[int], n: int, device) -> list[dict]:
    r = Recipe()
    target = _target(device)
    prompts = torch.randint(2, r.vocab, (n, r.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with torch.no_grad():
        for gb in gen_batches:
            greedy_forced(target, prompts[:8], r.prompt_len + 4, 8, device)  # warm-up
            _sync(device)
            t = time.time()
            greedy_forced(target, prompts, r.prompt_len + r.cont_len, gb, device)
            _sync(device)
            dt = time.time() - t
            row = {"gen_batch": gb, "sequences": n, "s": round(dt, 1), "seqs_per_s": round(n / dt, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("drafter", "datagen", "profile"))
    ap.add_argument("--kind", choices=("dflash", "dspark"), default="dspark")
    ap.add_argument("--batches", type=_ints, default="128,256,512")
    ap.add_argument("--steps", type=int, default=60)  # timed steps, after a first one that pays start-up
    ap.add_argument("--modes", default="eager,compile", type=_modes,
                    help="eager and/or compile (TrainJob's compile=)")
    ap.add_argument("--gen-batches", type=_ints, default="4096,16384")
    ap.add_argument("--sequences", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.what == "profile":
        table = profile_drafter(a.kind, a.batches[0], device)
        print(table)
        if a.json:
            a.json.write_text(table)
        return
    if a.what == "drafter":
        rows = probe_drafter(a.kind, a.batches, a.steps, device, a.modes)
    else:
        rows = probe_datagen(a.gen_batches, a.sequences, device)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
