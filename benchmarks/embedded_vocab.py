"""What a draft vocabulary costs in acceptance, on the embedded pair: the user's two commands, run.

For each size in `--tops`, `memra draft-vocab` ranks the embedded target's tokens over a counting
set (default `mbpp`: neither bench set) and the target's own greedy continuations of it; then one
`memra bench` process runs `off`, `plain`, each drafter, and each drafter with each vocabulary
(`KIND:vocab=FILE`) on the bench set, with the exactness gate over every arm. On the embedded
pair the lm_head is small (4096 x 256), so the subset saves no time here: the bench's tau per
size is what it measures (docs/draft-vocab.md). Runs on the CPU or the GPU.

    python -m benchmarks.embedded_vocab --json OUT.json [--tops 256,512,1024] [--prompts humaneval]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _memra(*args: str) -> dict:
    """One `memra ... --json` command; the JSON it prints."""
    proc = subprocess.run([sys.executable, "-m", "memra_cli", *args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise SystemExit(f"memra {' '.join(args)}: exit {proc.returncode}: {last}")
    return json.loads(proc.stdout)


def _split(spec: str, k: int, folder: Path) -> tuple[str, str]:
    """The prompt set `spec` as two JSONL files: its first `k` prompts, and the rest."""
    from memra_cli.engine.prompts import load_prompts

    texts = load_prompts(spec).texts
    if not 0 < k < len(texts):
        raise SystemExit(f"--held-out {k}: the set {spec} has {len(texts)} prompts (need 0 < K < {len(texts)})")
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for part, rows in (("count", texts[:k]), ("bench", texts[k:])):
        f = folder / f"{spec}_{part}_{k}.jsonl"
        f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in rows))
        names.append(str(f))
    return names[0], names[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--tops", default="256,512,1024", help="vocabulary sizes, comma-separated")
    p.add_argument("--count-set", default="mbpp", help="the prompt set the tokens are counted over")
    p.add_argument("--count-max-new", type=int, default=128, help="the target's continuation counted per prompt")
    p.add_argument("--prompts", default="humaneval", help="the bench set")
    p.add_argument("--n", type=int, default=None, help="first N prompts of both sets (a smoke run)")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kinds", default="dspark,dflash")
    p.add_argument("--held-out", type=int, default=0,
                   help="count over the bench set's first K prompts (and their continuations) instead of "
                        "--count-set, and bench on the rest: a vocabulary ranked on the bench's own kind of text, "
                        "never on a prompt it is measured on")
    a = p.parse_args(argv)
    started = time.time()
    if a.held_out:
        a.count_set, a.prompts = _split(a.prompts, a.held_out, a.json.parent)
    n = ["--n", str(a.n)] if a.n else []
    out: dict = {"command": "python -m benchmarks.embedded_vocab " + " ".join(sys.argv[1:] if argv is None else argv),
                 "count_set": a.count_set, "bench_set": a.prompts, "vocabs": {}}
    files = {}
    for top in [int(t) for t in a.tops.split(",")]:
        f = a.json.parent / f"{a.json.stem}_vocab{top}.json"
        out["vocabs"][top] = _memra("draft-vocab", str(f), "--prompts", a.count_set, "--max-new", str(a.count_max_new),
                                    "--top", str(top), "--force", *n)
        files[top] = f
        print(f"vocabulary {top}: {json.dumps(out['vocabs'][top])}", flush=True)
    arms = ["off", "plain"]
    for kind in a.kinds.split(","):
        arms += [kind] + [f"{kind}:vocab={f}" for f in files.values()]
    bench = _memra("bench", "--prompts", a.prompts, "--max-new", str(a.max_new), "--warmup", str(a.warmup), *n,
                   *[x for arm in arms for x in ("--arm", arm)])
    out["bench"] = bench
    out["summary"] = {arm["name"]: {"tau": arm.get("tau"), "speedup": arm.get("speedup"), "tok_per_s": arm.get("tok_per_s")}
                      for arm in bench["arms"]}
    out["exact"], out["seconds"] = bench.get("exact"), round(time.time() - started, 1)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    for name, row in out["summary"].items():
        print(f"{name:60s} tau {row['tau'] or 0:.3f}  speedup {row['speedup'] or 0:.3f}  {row['tok_per_s'] or 0:,.0f} tok/s")
    print(f"exact: {out['exact']}  ({out['seconds']} s)")
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
