"""The quantized few-row kernel (memra_kernels.quant_linear) tuned on the shapes the drafter launches.

For each qtype and each `[out, in, glu]` the Qwen3-8B-shape DFlash drafter launches
(`drafter_round.LAUNCHED_8B`: fused q/k/v, o, gate/up with its SwiGLU epilogue, down, the
ingest's k/v, fc), at M = 16 bf16 rows: the table's current config first, then the candidate
tiles (`TILES`) at up to three split counts each (`splits_for`), then neighbours of the fastest.
Each candidate is checked against the reference and for row invariance (kernels_quant.check:
M = 1 / 16 / 32, NaN-poisoned outputs, rows alone against rows among 32) before it is timed; a
config that fails, does not compile or does not fit is recorded, not fatal. Times are CUDA-graph
replays of calls cycling through enough weight copies that L2 never holds the one being read
(timing.cycled_graph_ms, as drafter_round times the kernels).

Prints one line per shape (the current and the fastest config, µs and fraction of the copy
bandwidth, and the fastest one's static count of SASS instructions per weight byte in its k loop
and of spill loads and stores, `sass_stats`, recorded for every timed candidate) and a TUNED table to paste into kernels/quant_tuning.py (a shape keeps its current
config unless a candidate beats it by `--margin`); writes every timing to `--json` and the whole
table to `--tuned` (the module's entries for shapes not swept beside the winners), which
`quant_tuning.load_tuned` and `drafter_round --quant-tuned` read.

A tile's compiled kernel depends on its constexprs, not on the shape or the split count (both are
run-time arguments), so the tiles below compile once per (qtype, glu, split or not) and every
shape reuses them: the sweep fits one device call.

    python -m benchmarks.gpu.quant_linear_sweep [--budget-s 200] [--qtypes q8_0,q4_0] [--json F] [--tuned F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from memra_kernels import quant_linear as ql
from memra_kernels import quant_pack as qp
from memra_kernels import quant_tuning as qt

from benchmarks import timing

SWEEP_M = 16
C = qt.KernelConfig
# Candidate tiles (split_k 1 here: `splits_for` sets it per shape). Why these: in the sm_90 SASS
# the loop's instructions per weight byte fall with the byte-permute dequantization (mantissa),
# with more output features per warp (x's fragments shared by more of them) and, for q4_0, with
# scale-after-dot; 1-2 warps with swap_ab take the per-warp MMAs, 4 warps the warpgroup ones
# (a wait per dot). docs/tuning.md#quantized-linear has the counts.
TILES = {
    "q8_0": [
        C(block_m=16, block_n=64, block_k=128, num_warps=2, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=64, block_k=128, num_warps=1, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=128, block_k=128, num_warps=2, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=32, block_k=128, num_warps=1, num_stages=4, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=64, block_k=256, num_warps=2, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=64, block_k=64, num_warps=1, num_stages=4, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, mantissa=True),
        C(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=64, block_k=128, num_warps=2, num_stages=3, swap_ab=True),  # mantissa's share
    ],
    "q4_0": [
        C(block_m=16, block_n=64, block_k=128, num_warps=1, num_stages=3, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=64, block_k=128, num_warps=2, num_stages=3, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=128, block_k=128, num_warps=2, num_stages=3, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=32, block_k=128, num_warps=1, num_stages=4, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=64, block_k=256, num_warps=2, num_stages=3, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=64, block_k=64, num_warps=1, num_stages=4, swap_ab=True, scale_after_dot=True),
        C(block_m=16, block_n=128, block_k=128, num_warps=2, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=64, block_k=128, num_warps=1, num_stages=3, swap_ab=True, mantissa=True),
        C(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, mantissa=True),
    ],
}
# Programs in flight that fill an H200's 132 multiprocessors for a 4-warp program; fewer warps
# a program, proportionally more programs (they share a multiprocessor).
TARGET_PROGRAMS_4_WARPS = 264


def log(*a) -> None:
    print(*a, flush=True)


def n_tiles(n: int, glu: bool, cfg: qt.KernelConfig) -> int:
    """Output tiles of a launch: a GLU tile holds block_n / 2 output columns (quant_linear._launch)."""
    cols = cfg.block_n // 2 if glu else cfg.block_n
    return -(-(n // 2 if glu else n) // cols)


def splits_for(n: int, k: int, glu: bool, cfg: qt.KernelConfig) -> list[int]:
    """Up to three split counts for a tile on a shape, the likeliest first: the power of two
    that brings the programs nearest the target for its warps, then its half and its double,
    each leaving every program at least two `in` tiles (a pipeline of loads to overlap)."""
    tiles, k_tiles = n_tiles(n, glu, cfg), k // cfg.block_k
    target = TARGET_PROGRAMS_4_WARPS * 4 // cfg.num_warps
    best = 1
    while best * 2 * 2 <= k_tiles and tiles * best * 2 <= target:
        best *= 2
    return [s for s in (best, best // 2, best * 2) if s >= 1 and (s == 1 or k_tiles // s >= 2)]


def candidates(qtype: str, n: int, k: int, glu: bool) -> list[qt.KernelConfig]:
    """The current config of the shape, then every tile of TILES[qtype] at its likeliest split
    count, then the tiles at their other split counts (so a budget cut short drops splits, not
    tiles); all fixed per shape: every M of a shape runs the same config."""
    out = [qt.config_for(qtype, n, k)]
    tiles = [t for t in TILES[qtype] if k % t.block_k == 0]
    splits = {t: splits_for(n, k, glu, t) for t in tiles}
    for rank in range(3):
        for tile in tiles:
            if rank < len(splits[tile]):
                cfg = replace(tile, split_k=splits[tile][rank]).check()
                if cfg not in out:
                    out.append(cfg)
    return out


def refinements(best: qt.KernelConfig, k: int) -> list[qt.KernelConfig]:
    """Neighbours of the fastest: a pipeline stage more or fewer, the split halved or doubled."""
    out = [replace(best, num_stages=best.num_stages + 1)]
    if best.num_stages > 2:
        out.append(replace(best, num_stages=best.num_stages - 1))
    if best.split_k > 1:
        out.append(replace(best, split_k=best.split_k // 2))
    if k // best.block_k // (best.split_k * 2) >= 2:
        out.append(replace(best, split_k=best.split_k * 2))
    return out


def cfg_str(c: qt.KernelConfig) -> str:
    flags = "".join(f" {f}" for f, on in (("sw", c.swap_ab), ("sa", c.scale_after_dot), ("mant", c.mantissa)) if on)
    return f"m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}{flags}"


def config_source(c: qt.KernelConfig) -> str:
    """`_C(...)` as kernels/quant_tuning.py's TUNED writes it: the fields that differ from the
    defaults, block_m always."""
    default = qt.KernelConfig()
    args = [f"{f.name}={getattr(c, f.name)!r}" for f in fields(c)
            if f.name == "block_m" or getattr(c, f.name) != getattr(default, f.name)]
    return f"_C({', '.join(args)})"


def whole_table(winners: dict[tuple[str, int, int], qt.KernelConfig]) -> dict[str, dict]:
    """The module's TUNED entries for the shapes not swept, then the winners, as the JSON that
    `quant_tuning.load_tuned` reads."""
    table = {key: cfg for key, cfg in qt.TUNED.items() if key not in winners}
    table.update(winners)
    return {qt.tuned_key(*key): asdict(cfg) for key, cfg in table.items()}


def loop_instructions(sass: str) -> list[str]:
    """The instructions of the longest loop in nvdisasm's text of a kernel: from a label to the
    backward branch to it (the k loop of the quantized kernel, one weight tile an iteration)."""
    at: dict[str, int] = {}
    body: list[str] = []
    best: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            at[label.group(1)] = len(body)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;?\s*$", line)
        if not ins:
            continue
        body.append(ins.group(1))
        back = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if back and back.group(1) in at and len(body) - at[back.group(1)] > len(best):
            best = body[at[back.group(1)]:]
    return best


def sass_stats(kern, qtype: str, cfg: qt.KernelConfig) -> dict | None:
    """What the compiler made of a tile, from the compiled kernel's cubin through Triton's bundled
    nvdisasm (None where either is missing): `instr_per_byte`, the SASS instructions a thread
    issues in the k loop per weight byte it dequantizes (a static count: the loop's length over
    the bytes of one block_n x block_k tile a thread holds), and `local_ops`, the kernel's
    local-memory loads and stores (register spills)."""
    import subprocess
    import tempfile

    from triton import knobs

    cubin = getattr(kern, "asm", {}).get("cubin")
    tool = knobs.nvidia.nvdisasm.path
    if not cubin or not tool:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=60).stdout
    loop = loop_instructions(sass)
    tile_bytes = cfg.block_n * cfg.block_k // (2 if qtype == "q4_0" else 1)
    return {"instr_per_byte": len(loop) / (tile_bytes / (32 * cfg.num_warps)) if loop else None,
            "local_ops": len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))}


def frac(nbytes: int, us: float, copy_bw: float) -> float:
    return nbytes / (us * 1e-6) / copy_bw


def sweep_shape(qtype: str, n: int, k: int, glu: bool, deadline: float, gen, device: str = "cuda",
                time_ms=timing.cycled_graph_ms) -> dict:
    """Time the candidates of one launched shape until `deadline`: {"candidates": {cfg: µs or
    error}, "current", "best" (configs as dicts), "current_us", "best_us", "bytes"}. `time_ms(call,
    n_copies)` times `call(i)` over the weight copies (the CPU test passes a stand-in)."""
    from benchmarks.gpu import kernels_quant as kq

    first = kq.random_packed(qtype, n, k, gen, device)
    copies = [first] + [qp.Packed(qtype, (n, k), first.qweight.clone(), first.scales.clone())
                        for _ in range(kq.copies_for(first.nbytes) - 1)]
    x = torch.randn((SWEEP_M, k), generator=gen).to(device, torch.bfloat16)
    rec: dict = {"qtype": qtype, "out": n, "in": k, "glu": glu, "candidates": {}, "sass": {},
                 "bytes": first.nbytes + SWEEP_M * k * 2 + SWEEP_M * (n // 2 if glu else n) * 2}
    timed: dict[qt.KernelConfig, float] = {}

    def run(cfg: qt.KernelConfig) -> None:
        key = cfg_str(cfg)
        if key in rec["candidates"] or time.time() > deadline:
            return
        try:
            ok = check_glu(qtype, first, cfg, gen) if glu else kq.check(qtype, first, cfg, gen)
            if not ok["ok"]:
                rec["candidates"][key] = f"check failed: {ok}"
                return
            us = 1e3 * time_ms(lambda i: ql.quant_linear(x, copies[i], config=cfg, glu=glu), len(copies))
        except Exception as exc:  # out of resources, a compile error: the candidate is skipped
            rec["candidates"][key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            return
        rec["candidates"][key] = us
        timed[cfg] = us
        try:  # what the compiler made of the tile: the sm_90 loop's instructions per byte
            out = torch.empty((SWEEP_M, n // 2 if glu else n), dtype=torch.bfloat16, device=x.device)
            rec["sass"][key] = sass_stats(ql._launch(x, first, cfg, out, glu=glu), qtype, cfg)
        except Exception as exc:  # the counts are a note beside the timing, never a failure
            rec["sass"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}

    current = qt.config_for(qtype, n, k)
    rec["current"] = asdict(current)
    for cfg in candidates(qtype, n, k, glu):
        run(cfg)
    if timed:
        for cfg in refinements(min(timed, key=timed.get), k):
            run(cfg)
    if timed:
        best = min(timed, key=timed.get)
        rec["best"], rec["best_us"] = asdict(best), timed[best]
        rec["current_us"] = timed.get(current)
    return rec  # the copies go with this frame (main empties the allocator's cache)


def check_glu(qtype: str, packed: qp.Packed, cfg: qt.KernelConfig, gen) -> dict:
    """The GLU launch against its two-launch form under the same config (bit for bit: the
    epilogue's contract) and the plain launch's checks (reference, NaN, row invariance)."""
    from benchmarks.gpu import kernels_quant as kq
    from memra_kernels import activation

    res = kq.check(qtype, packed, cfg, gen)
    x = torch.randn((SWEEP_M, packed.shape[1]), generator=gen).to(packed.device, torch.bfloat16)
    fused = ql.quant_linear(x, packed, config=cfg, glu=True)
    res["glu_equal"] = bool(torch.equal(fused, activation.silu_mul(ql.quant_linear(x, packed, config=cfg))))
    res["ok"] = res["ok"] and res["glu_equal"]
    return res


def pick(rec: dict, margin: float) -> qt.KernelConfig:
    """The shape's table entry: the fastest config when it beats the current one by `margin`
    (or the current one failed), else the current one (timing noise does not churn the table)."""
    current = qt.KernelConfig(**rec["current"])
    if "best" not in rec:
        return current
    cur_us = rec.get("current_us")
    if cur_us is None or rec["best_us"] < (1 - margin) * cur_us:
        return qt.KernelConfig(**rec["best"])
    return current


def main(argv=None) -> int:
    from benchmarks.gpu import kernels_quant as kq
    from benchmarks.gpu.drafter_round import LAUNCHED_8B

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--qtypes", default="q8_0,q4_0")
    p.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget of the candidates")
    p.add_argument("--margin", type=float, default=0.02, help="a candidate must beat the current config by this")
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "quant_sweep.json")
    p.add_argument("--tuned", type=Path, default=None, help="write the whole TUNED table (load_tuned's JSON) here")
    a = p.parse_args(argv)
    qtypes = [q.strip() for q in a.qtypes.split(",") if q.strip()]
    bad = [q for q in qtypes if q not in qp.QTYPES]
    if bad or not qtypes:
        p.error(f"--qtypes {a.qtypes!r}: expected a comma-separated list of {', '.join(qp.QTYPES)}")
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure (the sweep is a GPU measurement)")
        return 1
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    kq.L2_BYTES = getattr(props, "L2_cache_size", kq.L2_BYTES) or kq.L2_BYTES
    copy_bw = timing.copy_gbps() * 1e9
    res = {"device": props.name, "torch": torch.__version__, "copy_gbps": copy_bw / 1e9, "m": SWEEP_M,
           "command": "python -m benchmarks.gpu.quant_linear_sweep " + " ".join(sys.argv[1:] if argv is None else argv),
           "shapes": []}
    log(f"{props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; M = {SWEEP_M}, bf16 x")
    jobs = [(q, n, k, glu) for q in qtypes for n, k, glu in LAUNCHED_8B]
    gen = torch.Generator().manual_seed(0)
    winners: dict[tuple[str, int, int], qt.KernelConfig] = {}
    for i, (qtype, n, k, glu) in enumerate(jobs):
        left = a.budget_s - (time.time() - t0)
        try:
            rec = sweep_shape(qtype, n, k, glu, time.time() + max(0.0, left / (len(jobs) - i)), gen)
        except Exception as exc:  # e.g. out of memory for the copies: the shape keeps its config
            rec = {"qtype": qtype, "out": n, "in": k, "glu": glu, "candidates": {}, "sass": {},
                   "bytes": 0, "current": asdict(qt.config_for(qtype, n, k)),
                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
        chosen = pick(rec, a.margin)
        rec["chosen"] = asdict(chosen)
        winners[(qtype, n, k)] = chosen
        res["shapes"].append(rec)
        log(shape_line(rec, copy_bw))
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    res["tuned"] = whole_table(winners)
    res["seconds"] = round(time.time() - t0, 1)
    a.json.write_text(json.dumps(res, indent=1))
    if a.tuned:
        a.tuned.parent.mkdir(parents=True, exist_ok=True)
        a.tuned.write_text(json.dumps(res["tuned"], indent=1))
    log("TUNED = {  # the launched shapes at M = 16 (benchmarks/gpu/quant_linear_sweep.py)")
    for (qtype, n, k), cfg in winners.items():
        log(f"    ({qtype!r}, {n}, {k}): {config_source(cfg)},")
    log("}")
    return 0


def shape_line(rec: dict, copy_bw: float) -> str:
    """One shape's result: the current config and the fastest, µs and fraction of copy bandwidth."""
    head = f"{rec['qtype']} [{rec['out']:>5}, {rec['in']:>5}]{' glu' if rec['glu'] else '    '}"
    cur = qt.KernelConfig(**rec["current"])
    cur_us = rec.get("current_us")
    now = (f"now {cfg_str(cur)} {cur_us:7.2f} us ({frac(rec['bytes'], cur_us, copy_bw):.2f})" if cur_us
           else f"now {cfg_str(cur)} {rec['candidates'].get(cfg_str(cur), 'not timed')}")
    if "best" not in rec:
        return f"{head} {now} | no candidate timed{': ' + rec['error'] if 'error' in rec else ''}"
    best = qt.KernelConfig(**rec["best"])
    stats = rec["sass"].get(cfg_str(best)) or {}
    ipb, spills = stats.get("instr_per_byte"), stats.get("local_ops")
    return (f"{head} {now} | best {cfg_str(best)} {rec['best_us']:7.2f} us "
            f"({frac(rec['bytes'], rec['best_us'], copy_bw):.2f})"
            f"{f', {ipb:.1f} instr/byte' if isinstance(ipb, float) else ''}"
            f"{f', {spills} spill ops' if spills else ''} of {len(rec['candidates'])} tried")


if __name__ == "__main__":
    sys.exit(main())
