"""The bench plot gives each arm one colour, the same in the speedup bars and the tau histogram."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_hex  # noqa: E402

from memra_cli.cli.bench import plot_figure  # noqa: E402


def _arm(name: str, mode: str, speedup: float) -> dict:
    spec = mode not in ("off", "plain")
    return {"name": name, "mode": mode, "speedup": speedup, "rounds": 4 if spec else 0, "tau": 2.0,
            "tau_hist": {"1": 2, "3": 2} if spec else {}}


def test_each_arm_has_one_colour_in_both_panels():
    arms = [_arm("off", "off", 0.9), _arm("plain", "plain", 1.0), _arm("dflash", "dflash", 1.4), _arm("dspark", "dspark", 1.9)]
    report = {"arms": arms, "prompts": {"set": "mbpp", "n": 2}, "max_new": 8, "device": "cpu", "speedup_baseline": "plain"}
    ax1, ax2 = plot_figure(report).axes
    bar_colour = {t.get_text(): to_hex(p.get_facecolor()) for t, p in zip(ax1.get_xticklabels(), ax1.patches)}
    assert set(bar_colour) == {"off", "plain", "dflash", "dspark"}
    hist_colour = {c.get_label().split(" (")[0]: to_hex(c.patches[0].get_facecolor()) for c in ax2.containers}
    assert set(hist_colour) == {"dflash", "dspark"}
    for name, colour in hist_colour.items():
        assert bar_colour[name] == colour, name
    assert len(set(hist_colour.values())) == 2  # and the arms are told apart
