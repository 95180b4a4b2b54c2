"""SIMULATION (no model runs): expected speedup over plain decoding of each verify-window policy
on a mixture-of-experts target, from a step-cost model and per-slot acceptance profiles.

Cost: `engine/spec/priced.py`'s expected weight bytes of a step of vt rows (independent routing:
the expert union's upper bound; K/V and the drafter's own step left out, so every speculative
policy is charged the target's reads only). Acceptance: a geometric profile per (drafter, set),
each draft accepted with probability alpha given the ones before, alpha solved so a fixed
16-row window (15 drafts) has the published tau. Policies: fixed-16; the reactive ladder
(vt = clamp(m + 2, 3, 16) after m accepted drafts; its long-run rate by the stationary
distribution of that chain); expert-priced (the vt of most expected tokens per expected byte,
from the profile as a prior: what a confidence head that knows the profile would size);
expert-priced without a confidence head (the engine's `accepted-runs` survival: the window priced
from a geometric rate fitted to the session's accepted runs; Monte Carlo over SESSIONS sessions
of ROUNDS rounds, a fixed seed, so its transient counts; on a flat cost the engine resolves it to
the ladder); and, for comparison, the same window priced from the last round's run alone (rate
(m + 1) / (m + 2), the run the ladder expects next; stationary chain), which a steep cost narrows
to 2 rows for good; plain = 1 token at cost(1) (measured: the plain round's own step, which routes
its one row alone, where the run timed it).

`--measured MOE_STEP_JSON` adds rows priced by a measured cost curve instead of bytes: the graphed
step times of `benchmarks/moe_step.py`'s Triton rows (ms of the fixed-width step with vt live rows
where it timed one, else of a step of vt rows; linear between the vt it measured), so the fixed
overhead a real step pays beside its expert reads counts too.

    python benchmarks/moe_window_sim.py [--json OUT] [--measured docs/results/h100-moe-step-a3b-expert-grid.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from memra_cli.engine.spec.priced import (StepCost, accepted_runs_survival, expected_committed, geometric_survival,
                                          priced_vt, qwen3_moe_cost)

CAP = 16
SESSIONS, ROUNDS = 50, 64  # the accepted-runs window's Monte Carlo: 64 rounds ~ a 256-token answer at tau 4
# Published tau at a 16-token block (greedy unless said): DSpark paper Table 1, Qwen3-8B HumanEval
# at T = 1 (as quoted in docs/bench.md); memra's embedded drafters on the H200, HumanEval and the
# stdlib set (docs/bench.md).
PROFILES = {
    "DFlash, HumanEval (DSpark paper, T=1)": 4.64,
    "DSpark, HumanEval (DSpark paper, T=1)": 5.52,
    "DFlash, HumanEval (memra embedded, H200)": 2.59,
    "DSpark, HumanEval (memra embedded, H200)": 3.87,
    "DSpark, stdlib (memra embedded, H200)": 4.08,
    "synthetic stronger drafter (no source)": 9.0,  # where a window fitted to one round's run falls behind
}
SHAPES = {
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                          num_experts=128, top_k=8, moe_intermediate=768),
    "Qwen3-8B (dense)": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                             num_experts=0, top_k=0, moe_intermediate=0, dense_intermediate=12288),
}


@dataclass(frozen=True)
class MeasuredCost:
    """A step cost read off a measured curve (`priced_vt`'s cost interface): `bytes(vt)` is the
    measured ms of a step of vt rows, linear between the measured `vts` (a unit-free cost: the
    policies compare ratios); `unions` the experts per sparse layer those steps ran."""

    vts: tuple[int, ...]
    ms: tuple[float, ...]
    unions: tuple[float, ...]
    plain_ms: float | None = None  # the plain decode round's step, where the run timed it
    is_flat = False

    @classmethod
    def from_moe_step(cls, path: Path) -> "MeasuredCost":
        every = [r for r in json.loads(path.read_text())["rows"] if r.get("graph_ms")]
        # a verify's steps (the plain decode round's, which reads one row, is not one)
        timed = [r for r in every if not r.get("reads")]
        by_vt = {r["vt"]: r for r in timed if not r.get("width")}
        by_vt.update({r["vt"]: r for r in timed if r.get("width")})  # what the engine runs: vt live of its width
        rows = [by_vt[v] for v in sorted(by_vt)]
        if not rows or rows[0]["vt"] != 1 or rows[-1]["vt"] < CAP:
            raise ValueError(f"{path}: expected graphed rows from vt = 1 to {CAP} (benchmarks/moe_step.py --json)")
        plain = [r["graph_ms"] for r in every if r.get("reads") == 1 and r.get("width")]
        return cls(tuple(r["vt"] for r in rows), tuple(r["graph_ms"] for r in rows),
                   tuple(r["experts_per_layer"] for r in rows), plain[0] if plain else None)

    def plain(self) -> float:
        """A plain token's cost: the plain round's step where timed, else a one-row verify's."""
        return self.bytes(1) if self.plain_ms is None else self.plain_ms

    def _interp(self, values: tuple[float, ...], vt: int) -> float:
        i = next(i for i, v in enumerate(self.vts) if v >= vt)
        if self.vts[i] == vt:
            return values[i]
        lo, hi = self.vts[i - 1], self.vts[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (vt - lo) / (hi - lo)

    def bytes(self, vt: int) -> float:
        return self._interp(self.ms, vt)

    def expected_union(self, vt: int) -> float:
        return self._interp(self.unions, vt)


def alpha_for_tau(tau: float, drafts: int = CAP - 1) -> float:
    """The per-slot acceptance whose geometric profile gives `tau` over `drafts` slots (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + sum(geometric_survival(mid, drafts)) < tau else (lo, mid)
    return (lo + hi) / 2


def accepted_dist(survival: list[float], vt: int) -> list[float]:
    """P(m accepted drafts) for m = 0..vt-1 with vt rows."""
    c = [1.0] + survival[: vt - 1]
    return [c[m] - (c[m + 1] if m + 1 < vt else 0.0) for m in range(vt)]


def chain_rate(survival: list[float], cost: StepCost, window) -> tuple[float, float]:
    """Long-run (tokens per byte, mean vt) of a window carried from the last round's accepted
    count m (`window(m)` -> vt; the first round's m is CAP - 2), by power iteration over m."""
    p = {m: 0.0 for m in range(CAP)}
    p[CAP - 2] = 1.0
    dists = {m: accepted_dist(survival, window(m)) for m in p}
    for _ in range(2000):
        nxt = dict.fromkeys(p, 0.0)
        for m, pm in p.items():
            for m2, q in enumerate(dists[m]):
                nxt[m2] += pm * q
        done = max(abs(nxt[m] - p[m]) for m in p) < 1e-15  # converged to the last bits
        p = nxt
        if done:
            break
    tokens = sum(pm * expected_committed(survival, window(m)) for m, pm in p.items())
    nbytes = sum(pm * cost.bytes(window(m)) for m, pm in p.items())
    return tokens / nbytes, sum(pm * window(m) for m, pm in p.items())


def ladder_rate(survival: list[float], cost: StepCost) -> tuple[float, float]:
    """Long-run (tokens per byte, mean vt) of the reactive ladder vt = clamp(m + 2, 3, CAP)."""
    return chain_rate(survival, cost, lambda m: min(max(m + 2, 3), CAP))


def last_run_rate(survival: list[float], cost: StepCost) -> tuple[float, float]:
    """Long-run (tokens per byte, mean vt) of the priced window on the last round's run alone
    (geometric rate (m + 1) / (m + 2)); on a flat cost the ladder, as the accepted-runs window."""
    if cost.is_flat:
        return ladder_rate(survival, cost)
    windows = {m: priced_vt(geometric_survival((m + 1) / (m + 2), CAP - 1), cost, CAP) for m in range(CAP)}
    return chain_rate(survival, cost, windows.__getitem__)


def accepted_runs_rate(alpha: float, cost: StepCost, seed: int = 0) -> tuple[float, float]:
    """(tokens per byte, mean vt) of the priced window on the fitted survival over SESSIONS
    sessions of ROUNDS rounds, each draft accepted with probability `alpha` given the ones
    before (the engine's Session bookkeeping: drafts kept, rounds that rejected one); on a flat
    cost the ladder (what the engine resolves it to)."""
    if cost.is_flat:
        return ladder_rate(geometric_survival(alpha, CAP - 1), cost)
    rng, tokens, nbytes, rows = random.Random(seed), 0.0, 0.0, 0
    for _ in range(SESSIONS):
        kept = rejected = 0
        for _ in range(ROUNDS):
            vt = priced_vt(accepted_runs_survival(kept, rejected, CAP - 1), cost, CAP)
            m = 0
            while m < vt - 1 and rng.random() < alpha:
                m += 1
            kept, rejected = kept + m, rejected + (m < vt - 1)
            tokens, nbytes, rows = tokens + m + 1, nbytes + cost.bytes(vt), rows + vt
    return tokens / nbytes, rows / (SESSIONS * ROUNDS)


def simulate(shape: str, profile: str, tau: float, cost=None) -> dict:
    """One table row: each policy's expected speedup over plain under `cost` (default: the
    shape's byte model)."""
    cost = cost or qwen3_moe_cost(**SHAPES[shape])
    alpha = alpha_for_tau(tau)
    s = geometric_survival(alpha, CAP - 1)
    plain = 1.0 / (cost.plain() if isinstance(cost, MeasuredCost) else cost.bytes(1))
    fixed = expected_committed(s, CAP) / cost.bytes(CAP)
    ladder, ladder_vt = ladder_rate(s, cost)
    vt = priced_vt(s, cost, CAP)
    priced = expected_committed(s, vt) / cost.bytes(vt)
    runs, runs_vt = accepted_runs_rate(alpha, cost)
    last, last_vt = last_run_rate(s, cost)
    return {"shape": shape, "profile": profile, "tau_fixed16": tau, "alpha": round(alpha, 4),
            "speedup": {"fixed-16": fixed / plain, "ladder": ladder / plain, "priced": priced / plain,
                        "priced-accepted-runs": runs / plain, "priced-last-run": last / plain},
            "priced_vt": vt, "ladder_mean_vt": round(ladder_vt, 2), "accepted_runs_mean_vt": round(runs_vt, 2),
            "last_run_mean_vt": round(last_vt, 2),
            "union_at_16": round(cost.expected_union(CAP), 1) if not cost.is_flat else None}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--measured", type=Path, help="also price by this moe_step.py --json's graphed step times")
    args = ap.parse_args(argv)
    rows = [simulate(shape, name, tau) for shape in SHAPES for name, tau in PROFILES.items()]
    if args.measured:
        try:
            measured = MeasuredCost.from_moe_step(args.measured)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: --measured {args.measured}: {exc}", file=sys.stderr)
            return 2
        rows += [simulate("Qwen3-30B-A3B, measured step ms", name, tau, measured) for name, tau in PROFILES.items()]
    print("SIMULATION: expected speedup over plain (weight bytes read, or measured step ms; drafter cost left out)")
    print(f"{'shape':34} {'profile':42} {'tau':>5} {'fixed-16':>8} {'ladder':>7} {'priced':>7} {'vt*':>4} "
          f"{'no-head':>7} {'vt~':>5} {'last-run':>8}")
    for r in rows:
        sp = r["speedup"]
        print(f"{r['shape']:34} {r['profile']:42} {r['tau_fixed16']:5.2f} {sp['fixed-16']:8.2f} "
              f"{sp['ladder']:7.2f} {sp['priced']:7.2f} {r['priced_vt']:4d} {sp['priced-accepted-runs']:7.2f} "
              f"{r['accepted_runs_mean_vt']:5.2f} {sp['priced-last-run']:8.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"simulation": True, "cap": CAP, "measured": str(args.measured) if args.measured else None,
                   "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
