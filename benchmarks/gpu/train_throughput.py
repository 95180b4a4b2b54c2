"""`memra train`'s training throughput with online taps, at the Qwen3-8B shape (not a test).

Builds a random-weight Qwen3-8B-shape target (36 layers, hidden 4096, bf16; benchmarks/gpu_shapes.py)
in memory and trains a fresh drafter of `memra train`'s default geometry for it (dspark: 5
layers, taps 1,9,17,25,33, block 7, markov 256, confidence head; dflash: block 16) with the same
TrainJob the command runs. The batches are random token sequences of prompt + answer length
(speed does not depend on the text), so the answer generation is not timed here. Each step's
taps come from the engine's target (`EngineTaps`), as in `memra train`. Reports:

- step_ms: one whole training step (taps + drafter forward/backward + AdamW), steady state,
- taps_ms: the target forward that makes the taps alone, the rest being the drafter's share;
  taps_one_at_a_time_ms beside it: the same batch's taps one sequence at a time (`forward` per
  sequence, as training ran before `forward_taps` took the batch in one pass), and the two
  passes' largest difference relative to the taps' scale (`taps_max_rel_diff`: rounding only),
- taps_kernels (CUDA): one taps call's kernels by name under the profiler, and their summed GPU
  time (`gpu_us`): what of taps_ms the device spends, the rest being the host's launches,
- target tokens/s: sequence positions trained on per second,
- peak GPU memory, and the checkpoint's size on disk (the only file online training writes),
- cache_bytes_per_token: what a precomputed cache of the same taps would need per training token
  (n_taps * hidden * 2 bytes in bf16), for comparison with a cached pipeline.

    PYTHONPATH=$PWD python benchmarks/gpu/train_throughput.py [--kind dspark] [--batch 8] [--anchors 16] \
        [--steps 10] [--compile] [--json OUT.json]
    PYTHONPATH=$PWD python benchmarks/gpu/train_throughput.py --tiny --json OUT.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_shapes import SHAPES, random_target
from memra_cli.engine.models.common import TargetBase
from memra_cli.train.geometry import DEFAULT_BLOCK, DEFAULT_MARKOV_RANK, Geometry, spread_taps
from memra_cli.train.job import Hyper, TrainJob
from memra_cli.train.taps import EngineTaps


class RandomData:
    """Stand-in for online.py's OnlineData: random sequences of `length` with `prompt` prompt tokens."""

    def __init__(self, vocab: int, length: int, prompt: int, seed: int = 0):
        self.vocab, self.length, self.prompt = vocab, length, prompt
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, rows: list[int], pad: int):
        n = len(rows)
        ids = torch.randint(0, self.vocab - 1, (n, self.length), generator=self.gen)
        return ids, torch.full((n,), self.length), torch.full((n,), self.prompt)


def geometry(kind: str, s: dict, layers: int) -> Geometry:
    dspark = kind == "dspark"
    # the 8B shape's taps are spread_taps(5, 36) = 1,9,17,25,33; the small shape's 4 layers are too few to spread 2 over
    taps = s["taps"] if s["layers"] < 20 else spread_taps(layers, s["layers"])
    return Geometry(kind, layers, DEFAULT_BLOCK[kind], tuple(taps), s["vocab"] - 1,
                    min(DEFAULT_MARKOV_RANK, s["vocab"]) if dspark else 0, dspark, s["hidden"], s["heads"], s["kv"],
                    s["hd"], s["ffn"], s["vocab"], s["layers"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn, calls: int, device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / calls


def measure(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    s = SHAPES["small" if args.tiny else "8b"]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = random_target(s, dtype, device)
    geo = geometry(args.kind, s, s["d_layers"])
    data = RandomData(s["vocab"], args.prompt + args.answer, args.prompt)
    source = EngineTaps(target)
    job = TrainJob(geo, Hyper(steps=10**6, batch=args.batch, anchors=args.anchors), data, source, device, list(range(64)),
                   compile=args.compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        job.one_step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(args.steps):
        job.one_step()
    _sync(device)
    step_s = (time.perf_counter() - t) / args.steps
    ids, lengths, _ = data.batch(list(range(args.batch)), 0)
    ids = ids.to(device)
    taps_s = _seconds_per_call(lambda: source.tap_batch(ids, geo.taps, lengths.tolist()), args.steps, device)
    # the same batch one sequence at a time (TargetBase's forward_taps, what training ran before
    # the batched pass), in the same process: the batched pass's A/B
    rowwise_s = _seconds_per_call(lambda: TargetBase.forward_taps(target, ids, geo.taps, lengths.tolist()),
                                  args.steps, device)
    batched, rowwise = (source.tap_batch(ids, geo.taps, lengths.tolist()).float(),
                        TargetBase.forward_taps(target, ids, geo.taps, lengths.tolist()).float())
    taps_max_rel_diff = ((batched - rowwise).abs().max() / rowwise.abs().max()).item()  # rounding only
    taps_kernels = None
    if device.type == "cuda":  # the taps' GPU time by kernel: beside taps_ms, how much of it is the host's
        from benchmarks.timing import kernel_table

        taps_kernels = kernel_table(lambda: source.tap_batch(ids, geo.taps, lengths.tolist()), top=15)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_bytes = job.save(Path(tmp)).stat().st_size
    tokens_per_step = args.batch * (args.prompt + args.answer)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "small" if args.tiny else "8b", "dtype": str(dtype).removeprefix("torch."), "geometry": geo.as_json(),
        "compile": args.compile, "batch": args.batch, "anchors": args.anchors, "seq_len": args.prompt + args.answer, "steps_timed": args.steps,
        "step_ms": round(1e3 * step_s, 2), "taps_ms": round(1e3 * taps_s, 2),
        "drafter_ms": round(1e3 * (step_s - taps_s), 2),
        "taps_batched": target.batched_taps, "taps_one_at_a_time_ms": round(1e3 * rowwise_s, 2),
        "taps_max_rel_diff": taps_max_rel_diff,
        "taps_kernels": taps_kernels,
        "target_tokens_per_s": round(tokens_per_step / step_s, 1),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "checkpoint_bytes": ckpt_bytes,
        "cache_bytes_per_token": len(geo.taps) * geo.hidden * 2,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=("dflash", "dspark"), default="dspark")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--answer", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="the drafter's forward and losses through torch.compile")
    p.add_argument("--tiny", action="store_true", help="the small shape on the CPU (smoke test)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.batch, args.anchors, args.prompt, args.answer = 2, 1, 2, 4, 16, 32
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny for the CPU smoke test")
    out = measure(args)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
