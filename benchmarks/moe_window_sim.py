"""SIMULATION (no model runs): expected speedup over plain decoding of each verify-window policy
on a mixture-of-experts target, from a step-cost model and per-slot acceptance profiles.

Cost: `engine/spec/priced.py`'s expected weight bytes of a step of vt rows (independent routing:
the expert union's upper bound; K/V and the drafter's own step left out, so every speculative
policy is charged the target's reads only). Acceptance: a geometric profile per (drafter, set),
each draft accepted with probability alpha given the ones before, alpha solved so a fixed
16-row window (15 drafts) has the published tau. Policies: fixed-16; the reactive ladder
(vt = clamp(m + 2, 3, 16) after m accepted drafts; its long-run rate by the stationary
distribution of that chain); expert-priced (the vt of most expected tokens per expected byte,
from the profile as a prior); plain = 1 token at cost(1).

    python benchmarks/moe_window_sim.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

from memra_cli.engine.spec.priced import StepCost, expected_committed, geometric_survival, priced_vt, qwen3_moe_cost

CAP = 16
# Published tau at a 16-token block (greedy unless said): DSpark paper Table 1, Qwen3-8B HumanEval
# at T = 1 (as quoted in docs/bench.md); memra's embedded drafters on the H200, HumanEval and the
# stdlib set (docs/bench.md).
PROFILES = {
    "DFlash, HumanEval (DSpark paper, T=1)": 4.64,
    "DSpark, HumanEval (DSpark paper, T=1)": 5.52,
    "DFlash, HumanEval (memra embedded, H200)": 2.59,
    "DSpark, HumanEval (memra embedded, H200)": 3.87,
    "DSpark, stdlib (memra embedded, H200)": 4.08,
}
SHAPES = {
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                          num_experts=128, top_k=8, moe_intermediate=768),
    "Qwen3-8B (dense)": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                             num_experts=0, top_k=0, moe_intermediate=0, dense_intermediate=12288),
}


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


def ladder_rate(survival: list[float], cost: StepCost) -> tuple[float, float]:
    """Long-run (tokens per byte, mean vt) of the reactive ladder, by power iteration."""
    states = list(range(3, CAP + 1))
    p = {vt: 1.0 / len(states) for vt in states}
    for _ in range(2000):
        nxt = dict.fromkeys(states, 0.0)
        for vt, pv in p.items():
            for m, pm in enumerate(accepted_dist(survival, vt)):
                nxt[min(max(m + 2, 3), CAP)] += pv * pm
        p = nxt
    tokens = sum(pv * expected_committed(survival, vt) for vt, pv in p.items())
    nbytes = sum(pv * cost.bytes(vt) for vt, pv in p.items())
    return tokens / nbytes, sum(pv * vt for vt, pv in p.items())


def simulate(shape: str, profile: str, tau: float) -> dict:
    cost = qwen3_moe_cost(**SHAPES[shape])
    alpha = alpha_for_tau(tau)
    s = geometric_survival(alpha, CAP - 1)
    plain = 1.0 / cost.bytes(1)
    fixed = expected_committed(s, CAP) / cost.bytes(CAP)
    ladder, ladder_vt = ladder_rate(s, cost)
    vt = priced_vt(s, cost, CAP)
    priced = expected_committed(s, vt) / cost.bytes(vt)
    return {"shape": shape, "profile": profile, "tau_fixed16": tau, "alpha": round(alpha, 4),
            "speedup": {"fixed-16": fixed / plain, "ladder": ladder / plain, "priced": priced / plain},
            "priced_vt": vt, "ladder_mean_vt": round(ladder_vt, 2),
            "union_at_16": round(cost.expected_union(CAP), 1) if not cost.is_flat else None}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = [simulate(shape, name, tau) for shape in SHAPES for name, tau in PROFILES.items()]
    print("SIMULATION: expected speedup over plain (weight bytes read; drafter cost left out)")
    print(f"{'shape':18} {'profile':42} {'tau':>5} {'fixed-16':>8} {'ladder':>7} {'priced':>7} {'vt*':>4}")
    for r in rows:
        sp = r["speedup"]
        print(f"{r['shape']:18} {r['profile']:42} {r['tau_fixed16']:5.2f} {sp['fixed-16']:8.2f} "
              f"{sp['ladder']:7.2f} {sp['priced']:7.2f} {r['priced_vt']:4d}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"simulation": True, "cap": CAP, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
