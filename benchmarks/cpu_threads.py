"""Plain greedy decoding on the CPU at 1 vs 2 intra-op threads (not a test).

Loads a target (the embedded one, or a random-weight Qwen3 of a given size written to --dir:
speed does not depend on the values) and decodes N tokens of plain greedy through the engine
(16-row steps, as `memra generate --spec off` does), alternating the thread count run by run
(1, 2, 2, 1, ...) so drift lands on both; prints the median tok/s of each and every run. Run it
as it is, under `nice -n -20` (the closest a shared machine gets to idle), and beside a busy
loop (`python -c 'while 1: pass' &`) to see the three conditions of docs/perf.md § CPU threads.

    python -m benchmarks.cpu_threads [--size embedded|29m|59m|235m] [--reps 6] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

SIZES = {  # name -> make_tiny_qwen3 geometry (vocab, hidden, layers, heads, kv heads, head dim, ffn)
    "29m": (4096, 512, 8, 8, 4, 64, 1536),
    "59m": (4096, 1024, 4, 16, 8, 64, 3072),
    "235m": (8192, 2048, 4, 16, 8, 128, 6144),
}


def target_dir(size: str, root: Path) -> Path:
    if size == "embedded":
        from memra_cli.assets import default_pair

        return Path(default_pair()[0])
    from memra_cli.tiny.target import make_tiny_qwen3

    v, h, n, heads, kv, hd, ff = SIZES[size]
    out = root / f"target-{size}"
    if not (out / "config.json").is_file():
        make_tiny_qwen3(out, vocab=v, hidden=h, layers=n, heads=heads, kv_heads=kv, head_dim=hd, intermediate=ff)
    return out


def tok_per_s(engine, ids: list[int], n: int) -> float:
    with torch.inference_mode(), engine.session(ids, n) as session:  # no arm: plain decoding
        t0 = time.perf_counter()
        session.run()
        return len(session.tokens) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="embedded", choices=["embedded", *SIZES])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/memra-threads"))
    args = ap.parse_args()

    from memra_cli.engine.formats.checkpoint import open_checkpoint
    from memra_cli.engine.threads import checkpoint_params
    from memra_cli.engine.api import Engine, EngineConfig

    path = target_dir(args.size, args.dir)
    engine = Engine.load(EngineConfig(target=path, device="cpu", dtype="float32"))  # 16-row steps, as generate
    ids = list(range(5, 37))
    runs: dict[int, list[float]] = {1: [], 2: []}
    for threads in (1, 2):  # warm-up, not counted
        torch.set_num_threads(threads)
        tok_per_s(engine, ids, 8)
    for r in range(args.reps):
        for threads in (1, 2) if r % 2 == 0 else (2, 1):
            torch.set_num_threads(threads)
            runs[threads].append(tok_per_s(engine, ids, args.tokens))
    print(f"{args.size} ({checkpoint_params(open_checkpoint(path)) / 1e6:.1f}M params), {args.tokens} tokens, load {os.getloadavg()[0]:.2f}, "
          f"nice {os.nice(0)}")
    for threads, values in runs.items():
        print(f"  {threads} thread(s): median {statistics.median(values):.1f} tok/s  "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
