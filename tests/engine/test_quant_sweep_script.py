"""The quantized kernel's sweep (benchmarks/gpu/quant_linear_sweep.py) on the CPU: its candidates
are valid fixed-per-shape configs with split counts that leave every program a pipeline of loads,
its table text and JSON read back as the configs they came from (`quant_tuning.load_tuned`, which
refuses a bad entry naming it), it refuses to run without a GPU, and the suite runs it before the
drafter round, which then loads its table. The timing itself is a GPU measurement."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # `benchmarks` is a package of the repo, not installed
    return importlib.import_module("benchmarks.gpu.quant_linear_sweep")


@pytest.fixture
def qt():
    from memra_kernels import quant_tuning

    saved = dict(quant_tuning.TUNED)
    yield quant_tuning
    quant_tuning.TUNED.clear()
    quant_tuning.TUNED.update(saved)
    quant_tuning._CONFIG_CACHE.clear()


def test_candidates_are_valid_and_fixed_per_shape(sweep, qt):
    from benchmarks.gpu.drafter_round import LAUNCHED_8B
    from memra_kernels.quant_pack import QTYPES

    for qtype in QTYPES:
        for n, k, glu in LAUNCHED_8B:
            cands = sweep.candidates(qtype, n, k, glu)
            assert cands[0] == qt.config_for(qtype, n, k)  # the current config is timed first
            assert len(set(cands)) == len(cands) and len(cands) > len(sweep.TILES[qtype])
            for cfg in cands[1:]:
                assert cfg.check() is cfg and cfg.block_m == 16
                k_tiles = k // cfg.block_k
                assert cfg.split_k == 1 or k_tiles // cfg.split_k >= 2, (qtype, n, k, cfg)
                assert cfg.split_k & (cfg.split_k - 1) == 0
            assert cands == sweep.candidates(qtype, n, k, glu)  # a function of the shape alone
    # a GLU tile holds block_n / 2 output columns (their gate and up rows), so a fused [2I, in]
    # weight has as many tiles with its epilogue as without (quant_linear._launch's grid)
    tile = sweep.TILES["q8_0"][0]
    assert sweep.n_tiles(24576, True, tile) == sweep.n_tiles(24576, False, tile) == 24576 // tile.block_n


def test_refinements_stay_inside_the_shape(sweep, qt):
    best = qt.KernelConfig(block_m=16, block_n=64, block_k=128, split_k=16, num_warps=2, num_stages=2)
    for cfg in sweep.refinements(best, 4096):
        assert cfg.check() and cfg.num_stages >= 2
        assert cfg.split_k == 1 or 4096 // cfg.block_k // cfg.split_k >= 2


def test_table_text_and_json_read_back(sweep, qt, tmp_path):
    winners = {("q8_0", 6144, 4096): qt.KernelConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_warps=2,
                                                     swap_ab=True, mantissa=True),
               ("q4_0", 2048, 4096): qt.KernelConfig(block_m=16, block_n=32, block_k=128, split_k=8, num_warps=1,
                                                     num_stages=4, swap_ab=True, scale_after_dot=True)}
    for cfg in winners.values():  # the pasted line builds the same config
        assert eval(sweep.config_source(cfg), {"_C": qt.KernelConfig}) == cfg
    table = sweep.whole_table(winners)
    untouched = [key for key in qt.TUNED if key not in winners]
    assert untouched and all(qt.tuned_key(*key) in table for key in untouched)
    path = tmp_path / "quant_tuned.json"
    path.write_text(json.dumps(table))
    before = dict(qt.TUNED)
    loaded = qt.load_tuned(path)
    assert {key: loaded[key] for key in winners} == winners
    assert all(loaded[key] == before[key] for key in untouched)
    assert qt.config_for("q8_0", 6144, 4096) == winners[("q8_0", 6144, 4096)]  # the cache was cleared


@pytest.mark.parametrize("entry", [{"q9_0 64x64": {}}, {"q8_0 64by64": {}}, {"q8_0 64x64": {"block_q": 3}},
                                   {"q8_0 64x64": {"block_n": 48}},
                                   {"q8_0 64x64": {"mantissa": True, "scale_after_dot": True}}])
def test_load_tuned_refuses_a_bad_entry_and_keeps_the_table(qt, tmp_path, entry):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"q8_0 6144x4096": {"block_m": 16}, **entry}))
    before = dict(qt.TUNED)
    with pytest.raises(ValueError, match=f"entry '{next(iter(entry))}'"):
        qt.load_tuned(path)
    assert qt.TUNED == before


def test_pick_keeps_the_current_config_within_the_margin(sweep, qt):
    cur, fast = qt.KernelConfig(block_m=16), qt.KernelConfig(block_m=16, num_warps=2)
    rec = {"current": vars(cur), "current_us": 10.0, "best": vars(fast), "best_us": 9.9}
    assert sweep.pick(rec, 0.02) == cur
    assert sweep.pick({**rec, "best_us": 9.0}, 0.02) == fast
    assert sweep.pick({**rec, "current_us": None}, 0.02) == fast  # the current one failed its check
    assert sweep.pick({"current": vars(cur)}, 0.02) == cur  # nothing timed


def test_refuses_to_run_without_a_gpu(sweep, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the sweep would run")
    assert sweep.main(["--json", "/dev/null"]) == 1
    assert "no CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--qtypes", "q5_0"])
    assert exc.value.code == 2


def test_suite_runs_the_sweep_before_the_round_that_loads_its_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    suite = importlib.import_module("benchmarks.gpu.suite")
    sweep_cmd = suite.PARTS["quant_sweep"].commands(tmp_path, False)
    assert suite.PARTS["quant_sweep"].commands(tmp_path, True) is None  # no CPU mode
    assert sweep_cmd[0][1:3] == ["-m", "benchmarks.gpu.quant_linear_sweep"]
    assert str(tmp_path / suite.QUANT_TUNED) in sweep_cmd[0]
    names = list(suite.PARTS)
    assert names.index("quant_sweep") < names.index("drafter_round")
    assert "--quant-tuned" not in suite.PARTS["drafter_round"].commands(tmp_path, False)[0]
    (tmp_path / suite.QUANT_TUNED).write_text("{}")
    cmd = suite.PARTS["drafter_round"].commands(tmp_path, False)[0]
    assert cmd[cmd.index("--quant-tuned") + 1] == str(tmp_path / suite.QUANT_TUNED)
    assert "--quant-tuned" not in suite.PARTS["drafter_round"].commands(tmp_path, True)[0]


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   LDSM.16.M88.4 R4, [R3] ;
        /*0040*/                   PRMT R8, R4, 0x7604, R9 ;
        /*0050*/                   FFMA R8, R8, R10, R11 ;
        /*0060*/                   HMMA.16816.F32.BF16 R12, R16, R8, R12 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
"""


def test_loop_instructions_takes_the_longest_loop(sweep):
    """nvdisasm's text: the k loop is the longest label-to-backward-branch run (the other loop,
    the label before it and the instructions after are not counted)."""
    loop = sweep.loop_instructions(SASS)
    assert [ins.split()[0] for ins in loop] == ["LDSM.16.M88.4", "PRMT", "FFMA", "HMMA.16816.F32.BF16", "@P1"]
    assert sweep.loop_instructions("no loop here") == []


def test_shape_line_reports_times_fractions_and_failures(sweep, qt):
    cur, fast = qt.KernelConfig(block_m=16), qt.KernelConfig(block_m=16, num_warps=2, mantissa=True)
    rec = {"qtype": "q8_0", "out": 2048, "in": 4096, "glu": False, "bytes": 4_000_000,
           "current": vars(cur), "current_us": 2.0, "best": vars(fast), "best_us": 1.0,
           "candidates": {sweep.cfg_str(cur): 2.0, sweep.cfg_str(fast): 1.0},
           "sass": {sweep.cfg_str(fast): {"instr_per_byte": 4.5, "local_ops": 0}}}
    line = sweep.shape_line(rec, copy_bw=4e12)
    assert "2.00 us (0.50)" in line and "1.00 us (1.00), 4.5 instr/byte of 2 tried" in line and " mant" in line
    failed = {"qtype": "q4_0", "out": 2048, "in": 4096, "glu": True, "bytes": 0, "current": vars(cur),
              "candidates": {}, "sass": {}, "error": "OutOfMemoryError: ..."}
    assert sweep.shape_line(failed, 4e12).endswith("no candidate timed: OutOfMemoryError: ...")
    rec["sass"][sweep.cfg_str(fast)]["local_ops"] = 6
    assert "4.5 instr/byte, 6 spill ops of 2" in sweep.shape_line(rec, 4e12)
    assert sweep.pick(failed, 0.02) == cur


def test_drafter_round_refuses_a_table_for_its_tiny_run(sweep, tmp_path, capsys):
    """`--quant-tuned` sets the GPU kernels' tiles; the CPU smoke run launches none, so it is refused
    in one line (exit 2) rather than silently ignored, before anything is written."""
    from benchmarks.gpu import drafter_round

    table = tmp_path / "quant_tuned.json"
    table.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        drafter_round.main(["--tiny", "--quant-tuned", str(table), "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 2
    assert "--quant-tuned" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "r.json").exists()
