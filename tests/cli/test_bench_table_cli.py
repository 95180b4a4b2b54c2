"""The bench table on a terminal of 80 and 120 columns: the essential columns (arm, tau,
accept, tok/s, speedup, vs off, exact) are readable whole; nothing is cut to `…`; the lines under
it say what each baseline was and whether phases were timed."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from memra_cli.cli.bench import _render_table

# (name, mode, tau, acceptance, tok/s, speedup over plain, speedup over off): the docs' arms, and wide numbers
ARMS = [("off", "off", 1.0, None, 240.2, 0.24, 1.0), ("plain", "plain", 1.0, None, 1001.5, 1.0, 4.17),
        ("dflash", "dflash", 1.39, 0.173, 182.0, 0.18, 0.76),
        ("dspark", "dspark", 1.75, 0.084, 201.8, 0.2, 0.84), ("dspark:vt=ladder", "dspark", 1.69, 0.285, 202.8, 0.2, 0.84),
        ("dspark:vt=confidence,tau=0.3", "dspark", 1.70, 0.176, 11198.1, 11.18, 46.62),
        ("dspark:harvest=dflash", "dspark", 1.56, 0.062, 182.7, 0.18, 0.76)]
OFF_STEPS, PLAIN_STEPS = "fixed 16-row steps, CUDA graphs on", "one-row steps, CUDA graphs on"


def _report(arms=ARMS, phases=True) -> dict:
    rows = []
    for name, mode, tau, acc, tps, speedup, vs_off in arms:
        rows.append({"name": name, "mode": mode, "tau": tau, "acceptance": acc, "tok_per_s": tps, "speedup": speedup,
                     "speedup_vs_off": vs_off, "exact": None if mode == "plain" else True, "n_prompts": 164, "tokens": 20992,
                     "phase_ms": {"prefill": 0.123, "draft": 6.512, "verify": 10.034, "rollback": 0.012, "ingest": 0.811} if phases else None,
                     "tau_hist": {} if mode in ("off", "plain") else {str(k): 12345 // k for k in range(1, 17)}})
    names = [a[0] for a in arms]
    baselines = {"off": {"role": "exactness reference", "steps": OFF_STEPS}}
    if "plain" in names:
        baselines["plain"] = {"role": "speed baseline", "steps": PLAIN_STEPS, "same_as_off": 161}
    return {"arms": rows, "prompts": {"set": "humaneval", "n": 164}, "max_new": 128, "device": "cuda",
            "dtype": "bfloat16", "warmup": 1, "speedup_baseline": "plain" if "plain" in names else "off",
            "baselines": baselines, "phase_times": phases,
            "phase_clock": "perf_counter, device synchronized at every phase boundary: slows every arm, plain decoding most" if phases else None}


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


def _lines_under_the_main_table(text: str) -> str:
    """The text between the main table and the next table, wrapped lines joined."""
    after = text.split("└", 1)[1].split("\n", 1)[1]
    return " ".join(line.strip() for line in after.split("per arm:")[0].splitlines())


@pytest.mark.parametrize("width", [80, 120])
def test_the_essential_columns_are_whole(width):
    text = _render(_report(), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    rows = _main_rows(text)
    assert list(rows) == [a[0] for a in ARMS]  # every arm name whole (a long one folds, joined here)
    for name, mode, tau, acc, tps, speedup, vs_off in ARMS:
        assert rows[name] == [f"{tau:.2f}", "-" if acc is None else f"{acc:.3f}", f"{tps:.1f}", f"{speedup:.2f}x",
                              f"{vs_off:.2f}x", {"off": "ref", "plain": "n/a"}.get(mode, "yes")]
    for header in ("tau", "accept", "tok/s", "speedup", "vs off", "exact", "prefill", "verify", "rollback", "tau histogram"):
        assert header in text
    under = _lines_under_the_main_table(text)
    assert f"speedup = tok/s over plain's; plain: the fastest plain decoding here, {PLAIN_STEPS}" in under
    assert f"vs off = tok/s over off's; off: the exactness reference, {OFF_STEPS}" in under
    assert "plain is not gated; its stream equalled off's on 161 of 164 prompts" in under
    assert "phases: timed (perf_counter, device synchronized at every phase boundary" in under


@pytest.mark.parametrize("width", [80, 120])
def test_untimed_phases_are_said_and_leave_no_phase_columns(width):
    text = _render(_report(phases=False), width)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    assert "phases: not timed (--phase-times times them; on CUDA that synchronizes every phase)" in _lines_under_the_main_table(text)
    assert "prefill" not in text and "per arm: prompts, tokens" in text and "by phase" not in text


def test_a_long_arm_name_folds_and_the_numbers_stay_whole():
    long = "dspark:vt=confidence,tau=0.35,cap=9,prec=q8,markov=1,harvest=dspark"
    arms = ARMS[:2] + [(long, "dspark", 1.7, 0.176, 201.8, 0.2, 0.84)]
    text = _render(_report(arms), 80)
    assert "…" not in text
    assert _main_rows(text) == {"off": ["1.00", "-", "240.2", "0.24x", "1.00x", "ref"],
                                "plain": ["1.00", "-", "1001.5", "1.00x", "4.17x", "n/a"],
                                long: ["1.70", "0.176", "201.8", "0.20x", "0.84x", "yes"]}


def test_without_plain_the_speedup_line_names_off():
    text = _render(_report(ARMS[:1] + ARMS[2:3]), 80)
    under = _lines_under_the_main_table(text)
    assert "speedup, vs off = tok/s over off's; off: the exactness reference" in under and "plain's" not in under and "plain is" not in under


def test_the_title_is_a_line_of_its_own_not_squeezed_to_a_narrow_table():
    text = _render(_report(ARMS[:1]), 80)  # the off arm alone: a narrow table
    assert text.splitlines()[0] == "memra bench: humaneval, 164 prompts x 128 new, cuda bfloat16, warm-up 1"
