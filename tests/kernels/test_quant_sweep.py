"""The quantized kernel's sweep (benchmarks/gpu/quant_linear_sweep.py) end to end on tiny shapes
through Triton's interpreter: every candidate is checked against the reference (and a GLU launch
against its two launches) before it is timed, a config planted wrong is recorded as failing its
check and never picked, and the current config is timed first. Timing is a stand-in (the
interpreter's times mean nothing); tests/engine/test_quant_sweep_script.py covers the rest of the
script on the CPU."""

from __future__ import annotations

import importlib
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memra_kernels import quant_linear as ql
from memra_kernels import quant_pack as qp
from memra_kernels import quant_tuning as qt

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.exhaustive  # dozens of interpreted launches


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    mod = importlib.import_module("benchmarks.gpu.quant_linear_sweep")
    kq = importlib.import_module("benchmarks.gpu.kernels_quant")
    monkeypatch.setattr(kq, "MS", (1, 3))  # fewer interpreted launches per check
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run: on a GPU the suite runs the sweep")
@pytest.mark.parametrize("qtype", qp.QTYPES)
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
def test_sweep_checks_then_times_and_never_picks_a_wrong_config(sweep, monkeypatch, qtype, glu):
    tile = sweep.TILES[qtype][0]
    planted = replace(sweep.TILES[qtype][1], block_n=32)  # made to compute wrong below
    monkeypatch.setitem(sweep.TILES, qtype, [tile, planted])
    real = ql._launch

    def launch(x, packed, cfg, out, glu=False):
        kern = real(x, packed, cfg, out, glu=glu)
        if cfg.block_n == 32 and cfg.num_warps == planted.num_warps:
            out.add_(1)  # a wrong result, as a broken tile would give
        return kern

    monkeypatch.setattr(ql, "_launch", launch)
    timed = []

    def fake_ms(call, n_copies):
        for i in range(n_copies):
            call(i)
        timed.append(n_copies)
        return 0.001 * len(timed)  # later candidates slower: the first timed one wins

    rec = sweep.sweep_shape(qtype, 64, 256, glu, time.time() + 600, torch.Generator().manual_seed(0),
                            device="cpu", time_ms=fake_ms)
    current = qt.config_for(qtype, 64, 256)
    assert rec["current"] == vars(current) and rec["current_us"] == pytest.approx(1.0)
    assert rec["best"] == vars(current)
    wrong = [key for key, v in rec["candidates"].items() if isinstance(v, str)]
    right = [key for key, v in rec["candidates"].items() if not isinstance(v, str)]
    assert wrong and all(rec["candidates"][key].startswith("check failed") for key in wrong)
    assert all(" n32 " in key for key in wrong) and right
    assert len(timed) == len(right)
    assert sweep.pick(rec, 0.02) == current
