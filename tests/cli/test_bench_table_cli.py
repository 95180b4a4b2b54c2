"""The bench table on a terminal of 80 and 120 columns: the essential columns (arm, tau,
accept, tok/s, speedup, exact) are readable whole; nothing is cut to `…`."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from memra_cli.cli.bench import _render_table

# (name, mode, tau, acceptance, tok/s, speedup): the docs' six arms, and wide numbers
ARMS = [("off", "off", 1.0, None, 240.2, 1.0), ("dflash", "dflash", 1.39, 0.173, 182.0, 0.76),
        ("dspark", "dspark", 1.75, 0.084, 201.8, 0.84), ("dspark:vt=ladder", "dspark", 1.69, 0.285, 202.8, 0.84),
        ("dspark:vt=confidence,tau=0.3", "dspark", 1.70, 0.176, 11198.1, 12.82),
        ("dspark:harvest=dflash", "dspark", 1.56, 0.062, 182.7, 0.76)]


def _report(arms=ARMS) -> dict:
    rows = []
    for name, mode, tau, acc, tps, speedup in arms:
        rows.append({"name": name, "mode": mode, "tau": tau, "acceptance": acc, "tok_per_s": tps, "speedup": speedup,
                     "exact": True, "n_prompts": 164, "tokens": 20992,
                     "phase_ms": {"prefill": 0.123, "draft": 6.512, "verify": 10.034, "rollback": 0.012, "ingest": 0.811},
                     "tau_hist": {} if mode == "off" else {str(k): 12345 // k for k in range(1, 17)}})
    return {"arms": rows, "prompts": {"set": "humaneval", "n": 164}, "max_new": 128, "device": "cpu",
            "dtype": "float32", "warmup": 1}


def _render(report: dict, width: int) -> str:
    buf = io.StringIO()
    _render_table(report, Console(width=width, file=buf, force_terminal=True, color_system=None))
    return buf.getvalue()


def _main_rows(text: str) -> dict[str, list[str]]:
    """The first table's rows: arm name (fold pieces joined) -> its other cells."""
    rows: dict[str, list[str]] = {}
    last = None
    for line in text.split("per arm:")[0].splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[1]:  # a new row (a folded name continues with empty cells)
            last = cells[0]
            rows[last] = cells[1:]
        else:
            rows[last + cells[0]] = rows.pop(last)
            last = last + cells[0]
    return rows


@pytest.mark.parametrize("width", [80, 120])
def test_the_essential_columns_are_whole(width):
    text = _render(_report(), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    rows = _main_rows(text)
    assert list(rows) == [a[0] for a in ARMS]  # every arm name whole, on one line
    for name, _, tau, acc, tps, speedup in ARMS:
        assert rows[name] == [f"{tau:.2f}", "-" if acc is None else f"{acc:.3f}", f"{tps:.1f}", f"{speedup:.2f}x",
                              "ref" if name == "off" else "yes"]
    for header in ("tau", "accept", "tok/s", "speedup", "exact", "prefill", "verify", "rollback", "tau histogram"):
        assert header in text


def test_a_long_arm_name_folds_and_the_numbers_stay_whole():
    long = "dspark:vt=confidence,tau=0.35,cap=9,prec=q8,markov=1,harvest=dspark"
    arms = ARMS[:1] + [(long, "dspark", 1.7, 0.176, 201.8, 0.84)]
    text = _render(_report(arms), 80)
    assert "…" not in text
    assert _main_rows(text) == {"off": ["1.00", "-", "240.2", "1.00x", "ref"], long: ["1.70", "0.176", "201.8", "0.84x", "yes"]}


def test_the_title_is_a_line_of_its_own_not_squeezed_to_a_narrow_table():
    text = _render(_report(ARMS[:1]), 80)  # the off arm alone: a narrow table
    assert text.splitlines()[0] == "memra bench: humaneval, 164 prompts x 128 new, cpu float32, warm-up 1"
