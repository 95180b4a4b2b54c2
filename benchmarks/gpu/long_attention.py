"""Growing splits for the decode attention at the 8B shape: which (long_split, long_from) to ship.

The attention kernel (memra_kernels.attention) cuts the key axis into fixed splits and merges
their float32 partials in a second launch. With the head_dim-128 tile's 256-key split, a 16-row
step at 32k keys writes and re-reads 34 MB of partials a layer (a quarter of its K/V) and each
program walks 8 key blocks. A tile may double a row's split at position long_from and at each
doubling after it, up to long_split keys (memra_kernels.attention.Tile). This times candidates
in one process: µs per call of `attention._launch`, one CUDA graph over 36 per-layer caches
`[2, 8, ctx + 64, 128]` bf16 (replay / 36), 32 query heads, rows 1 and 16 at positions
ctx-rows..ctx-1, at contexts 512 to 32768; whether the compiled kernels keep a row's bits
alone and over a storage cut to the live keys; and the time to read one layer's live K/V at the
eager copy bandwidth measured in the same process (the attention's floor). `best` is the
candidate of least summed time at contexts >= 4096 (shorter ones run the same code for all).

    python -m benchmarks.gpu.long_attention [--json OUT.json] [--candidates 'S,BN,BM,ST,W[,LS,LF];...'|wide]
        [--pick F] [--pick-long F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.gpu.target_step import eager_copy_gbps, replay_ms
from memra_cli.engine.runtime import cuda_graphs

HEADS, KV, HD, LAYERS = 32, 8, 128, 36
CONTEXTS = (512, 4096, 8192, 16384, 32768)
LONG_CONTEXTS = (4096, 8192, 16384, 32768)  # the score's: shorter contexts run the same code
BASE = (256, 32, 64, 3, 4)
# (long_split, long_from): a row's split doubles at long_from and at each doubling after it,
# up to long_split keys (memra_kernels.attention.Tile)
CANDIDATES = (
    BASE,
    BASE + (512, 8192), BASE + (1024, 8192), BASE + (2048, 8192),
    BASE + (1024, 4096), BASE + (1024, 16384),
)
# A wider set for the suite's long_attention part (the module's tile first: the pick's baseline):
# the inner block, pipeline depth and warps beside growing splits, and the 128-key split (faster
# at 512 keys) grown to 1024 past 8192
WIDE = (
    (256, 64, 64, 3, 4, 1024, 8192),  # the module's tile (attention.TILES[128]), then the one before it
    BASE, BASE + (1024, 8192),
    (256, 64, 64, 3, 4), (256, 64, 64, 2, 4), (256, 32, 64, 4, 4), (256, 32, 64, 3, 8), (256, 64, 64, 3, 8),
    (256, 32, 64, 4, 4, 1024, 8192), (256, 32, 64, 3, 8, 1024, 8192),
    (512, 64, 64, 3, 4), (512, 64, 64, 3, 8),
    (128, 32, 64, 3, 4, 1024, 8192), (128, 64, 64, 2, 4, 1024, 8192), (128, 32, 64, 3, 4, 1024, 4096),
)


def main() -> None:
    from memra_kernels import attention as A

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "h200-long-attention.json")
    p.add_argument("--candidates", default="",
                   help="tiles to time instead of the built-in list: 'S,BN,BM,ST,W[,LONG_SPLIT,LONG_FROM];...', "
                        "or 'wide' (WIDE: inner blocks, stages and warps beside growing splits)")
    p.add_argument("--pick", type=Path, default=None,
                   help="also write the candidate of least 16-row time at 512 + 4096 keys whose 16-row time at "
                        "32768 is within 10 us a layer of the first candidate's, as --attn-tile text, here")
    p.add_argument("--pick-long", type=Path, default=None,
                   help="also write the candidate of least 16-row time at 32768 keys whose 16-row times at 512 "
                        "and 4096 keys are within 3%% (or 0.5 us) of the first candidate's, as --attn-tile text, here")
    a = p.parse_args()
    candidates = WIDE if a.candidates == "wide" else \
        [tuple(int(v) for v in c.split(",")) for c in a.candidates.split(";") if c] or CANDIDATES
    t0 = time.time()
    bw = eager_copy_gbps(reps=30)
    out: dict = {"device": torch.cuda.get_device_name(), "command": "python -m benchmarks.gpu.long_attention",
                 "shape": f"{HEADS} q / {KV} kv heads of {HD}, {LAYERS} layers", "copy_gbps": bw,
                 "module_hd128": dataclasses.asdict(A.TILES[128]), "rows": {}}
    rows = []
    for c in candidates:
        row = {"tile": list(c)}
        try:
            row["launch"] = dataclasses.asdict(A.Tile(*c))
        except (TypeError, ValueError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    floor = {}
    for ctx in CONTEXTS:
        caches = [torch.randn(2, KV, ctx + 64, HD, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        floor[str(ctx)] = 1e6 * 2 * KV * ctx * HD * 2 / (bw * 1e9)  # one layer's live K/V at copy speed
        for n in (1, 16):
            q = torch.randn(n, HEADS, HD, dtype=torch.bfloat16, device="cuda")
            pos = torch.arange(ctx - n, ctx, device="cuda")
            for row in rows:
                if "error" in row:
                    continue

                def calls(kw=row["launch"]):
                    for cache in caches:
                        A._launch(q, cache[0], cache[1], pos, HD ** -0.5, **kw)
                try:
                    graph, _ = cuda_graphs.capture(calls, torch.device("cuda"))
                    row[f"ctx{ctx}_rows{n}"] = 1e3 * replay_ms(graph.replay, 20) / LAYERS
                    del graph
                except Exception as exc:  # noqa: BLE001 - report the candidate's failure, go on
                    row[f"ctx{ctx}_rows{n}"] = f"{type(exc).__name__}: {exc}"[:200]
            if n == 16:  # the invariance the kernel promises, on the compiled kernels: the last
                # row alone == in the step, and over a storage cut to the live keys (another grid)
                for row in rows:
                    if "error" in row or not isinstance(row.get(f"ctx{ctx}_rows16"), float):
                        continue
                    kw, c0 = row["launch"], caches[0]
                    step = A._launch(q, c0[0], c0[1], pos, HD ** -0.5, **kw)
                    alone = A._launch(q[-1:], c0[0], c0[1], pos[-1:], HD ** -0.5, **kw)
                    cut = A._launch(q, c0[0, :, :ctx], c0[1, :, :ctx], pos, HD ** -0.5, **kw)
                    row[f"ctx{ctx}_invariant"] = bool(torch.equal(alone[0], step[-1]) and torch.equal(cut, step))
        del caches
        torch.cuda.empty_cache()
        print(f"ctx {ctx}: " + "  ".join(
            f"{r['tile'][5:] or 'base'}: {r.get(f'ctx{ctx}_rows1', 0):.1f}/{r.get(f'ctx{ctx}_rows16', 0):.1f}"
            for r in rows if "error" not in r and isinstance(r.get(f"ctx{ctx}_rows16"), float)), flush=True)
    for row in rows:
        timed = [row.get(f"ctx{c}_rows{n}") for c in LONG_CONTEXTS for n in (1, 16)]
        row["long_score"] = sum(timed) if all(isinstance(x, float) for x in timed) else None
    scored = [r for r in rows if r["long_score"] is not None]
    out["floor_us_per_layer"] = floor
    out["rows"] = rows
    if scored:
        best = min(scored, key=lambda r: r["long_score"])
        out["best"], out["best_score"] = best["tile"], best["long_score"]
        print("best", best["tile"], round(best["long_score"], 1))
    ok = [r for r in rows if all(isinstance(r.get(f"ctx{c}_rows16"), float) for c in (512, 4096, 32768))
          and all(r.get(f"ctx{c}_invariant", True) for c in CONTEXTS)]
    if a.pick_long and ok and ok[0] is rows[0]:
        def as_short(r, c):  # no slower than the first candidate where decoding mostly happens
            base = rows[0][f"ctx{c}_rows16"]
            return r[f"ctx{c}_rows16"] <= max(1.03 * base, base + 0.5)
        pick = min((r for r in ok if as_short(r, 512) and as_short(r, 4096)), key=lambda r: r["ctx32768_rows16"])
        out["pick_long"] = pick["tile"]
        a.pick_long.write_text(",".join(str(v) for v in pick["tile"]))
        print("pick_long", pick["tile"], flush=True)
    if a.pick:
        if ok and ok[0] is rows[0]:
            limit = rows[0]["ctx32768_rows16"] + 10.0
            pick = min((r for r in ok if r["ctx32768_rows16"] <= limit),
                       key=lambda r: r["ctx512_rows16"] + r["ctx4096_rows16"])
            out["pick"] = pick["tile"]
            a.pick.write_text(",".join(str(v) for v in pick["tile"]))
            print("pick", pick["tile"], flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
