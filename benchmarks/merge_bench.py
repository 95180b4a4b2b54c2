"""Merge `memra bench --json` outputs of several prompt slices into one table (not a test).

Counts add up exactly (tokens, rounds, accepted, drafted, tau histograms); tok/s is total tokens
over total wall time per arm; speedup is that over the speed baseline's (the `plain` arm's, or
`off`'s in runs from before the plain arm), and speedup_vs_off over the `off` arm's, so each
slice's arms stay interleaved with each other and the ratio is still side by side. An arm that is
not gated (plain; accept=rejection) keeps `exact` null. Prints a markdown table.

    python benchmarks/merge_bench.py docs/results/h200-humaneval-*.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def merge(paths: list[Path]) -> dict:
    runs = [json.loads(p.read_text()) for p in paths]
    arms: dict[str, dict] = {}
    for run in runs:
        for a in run["arms"]:
            m = arms.setdefault(a["name"], {"name": a["name"], "tokens": 0, "rounds": 0, "accepted": 0, "drafted": 0,
                                            "wall_s": 0.0, "n_prompts": 0, "exact": True, "tau_hist": Counter(),
                                            "steps": a.get("steps")})
            for k in ("tokens", "rounds", "accepted", "drafted", "wall_s", "n_prompts"):
                m[k] += a[k] or 0
            m["exact"] = None if a["exact"] is None else (m["exact"] is not False and bool(a["exact"]))
            m["tau_hist"].update({int(k): v for k, v in a["tau_hist"].items()})
    baseline = "plain" if "plain" in arms else "off"
    off = arms["off"]["tokens"] / arms["off"]["wall_s"]
    base = arms[baseline]["tokens"] / arms[baseline]["wall_s"]
    for m in arms.values():
        m["tau"] = (m["accepted"] + m["rounds"]) / m["rounds"]
        m["acceptance"] = m["accepted"] / m["drafted"] if m["drafted"] else None
        m["tok_per_s"] = m["tokens"] / m["wall_s"]
        m["speedup"] = m["tok_per_s"] / base
        m["speedup_vs_off"] = m["tok_per_s"] / off
        m["tau_hist"] = {str(k): v for k, v in sorted(m["tau_hist"].items())}
    first = runs[0]
    return {"slices": [str(p) for p in paths], "device": first["device"], "dtype": first["dtype"],
            "max_new": first["max_new"], "exact": all(r["exact"] for r in runs), "speedup_baseline": baseline,
            "baselines": first.get("baselines"), "phase_times": any(r.get("phase_times") for r in runs),
            "arms": list(arms.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    out = merge(a.files)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{out['device']} {out['dtype']}, {sum(m['n_prompts'] for m in out['arms'][:1])} prompts, max_new {out['max_new']}, "
          f"exact={out['exact']}, phases timed={out['phase_times']}\n")
    for name, b in (out["baselines"] or {}).items():
        print(f"- `{name}`: {b['steps']}; {b['role']}")
    vs_off = out["speedup_baseline"] != "off"  # runs from before the plain arm: one ratio
    print(f"\n| arm | tau | acceptance | tok/s | speedup vs {out['speedup_baseline']} |{' speedup vs off |' * vs_off} exact |\n"
          f"|---|---|---|---|---|{'---|' * vs_off}---|")
    for m in out["arms"]:
        acc = f"{m['acceptance']:.3f}" if m["acceptance"] is not None else "-"
        exact = "not gated" if m["exact"] is None else m["exact"]
        extra = f" {m['speedup_vs_off']:.2f} |" if vs_off else ""
        print(f"| `{m['name']}` | {m['tau']:.2f} | {acc} | {m['tok_per_s']:.1f} | {m['speedup']:.2f} |{extra} {exact} |")

if __name__ == "__main__":
    main()
