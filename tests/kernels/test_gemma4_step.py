"""Gemma 4's fixed-width step through the Triton step ops (the interpreter on CPU): logits against
transformers' Gemma4ForCausalLM, and the exactness rule with the kernels in place (a speculative
stream == plain greedy at the same step width).

The step then runs memra_kernels' windowed attention (sliding layers: window 8, prompts past it;
full layers: their own head dim, k_eq_v), Gemma's q/k norm + rope + v norm + K/V write and the
softcap (30) in place of their torch twins."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.layers.torch_step_ops import TorchStepOps
from memra_cli.engine.layers.triton_step_ops import TritonStepOps
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.engine.runtime.steps import StepRunner
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.gemma4 import make_tiny_gemma4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from fp32_bounds import layer_reductions, reorder_bound  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, WIDTH = 512, 16
HF_TOL = 1e-5  # the torch step against transformers (tests/engine/test_gemma4.py says why)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # 3 sliding (window 8, head_dim 16) + 2 full layers (head_dim 32, 1 KV head, k_eq_v), softcap 30
    return make_tiny_gemma4(tmp_path_factory.mktemp("gemma4") / "base")


def _target(path, ops, dtype=torch.float32):
    target = Gemma4Target.from_dir(path, dtype=dtype, device=DEVICE)
    target.step_ops = ops
    return target


def _bound(cfg, keys: int) -> float:
    """The kernels sum in other orders than torch (attention's splits and blocks, the norms' sums
    of squares): fp32_bounds' reordering bound of the layer chain, on top of the torch step's own
    distance from transformers. The softcap's tanh (a few float32 ulps off torch's, <= 2^-20
    absolute, times the cap) is far inside it at these logits' scale."""
    hd = max(cfg.head_dims)
    layer = layer_reductions(cfg.hidden_size, cfg.num_attention_heads * hd, hd, keys, 2 * cfg.intermediate_size)
    return HF_TOL + reorder_bound(*layer * cfg.num_hidden_layers, cfg.hidden_size, cfg.hidden_size)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return transformers.Gemma4ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()


@torch.no_grad()
def _steps_vs_transformers(tiny_dir, hf, chunks, width) -> tuple[float, float]:
    """The prompt's first chunk prefilled (the forward), the others as fixed-width steps through
    the kernels: (relative error of the steps' logits against transformers', its bound)."""
    target = _target(tiny_dir, TritonStepOps())
    ids = torch.randint(0, VOCAB - 4, (sum(chunks),), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
    runner = StepRunner(target, width)
    state = target.new_state(len(ids) + width)
    runner.prefill(torch.tensor(ids[:chunks[0]], device=DEVICE), state)
    rows, start = [], chunks[0]
    for chunk in chunks[1:]:
        logits, _ = runner.step(torch.tensor(ids[start:start + chunk], device=DEVICE), start, state)
        rows.append(logits.cpu())
        start += chunk
    got, want = torch.cat(rows).double(), want[chunks[0]:].double()
    return ((got - want).norm() / want.norm()).item(), _bound(target.cfg, len(ids))


def test_a_step_through_the_kernels_matches_transformers(tiny_dir, hf):
    """One 2-row step at positions 20, 21 (sliding layers' windows 13..20 and 14..21)."""
    err, bound = _steps_vs_transformers(tiny_dir, hf, (20, 2), 2)
    assert err < bound, (err, bound)


@pytest.mark.exhaustive  # four 16-row steps through the interpreter (~20 s)
def test_verify_steps_through_the_kernels_match_transformers(tiny_dir, hf):
    """Verify-sized 16-row steps whose rows straddle the window's edge (and padding rows)."""
    err, bound = _steps_vs_transformers(tiny_dir, hf, (3, 11, 1, 16, 2), WIDTH)
    assert err < bound, (err, bound)


@pytest.mark.exhaustive  # a whole speculative session through the interpreter
def test_speculative_equals_plain_with_the_kernels(tiny_dir, tmp_path):
    """With the kernels in place, the dflash arm over a tiny z-lab drafter gives the plain greedy
    stream of the same step width, and that stream is the torch ops' (float32: no near-ties)."""
    prompt = torch.randint(0, VOCAB - 4, (23,), generator=torch.Generator().manual_seed(6)).tolist()
    torch_stream = greedy_reference(StepRunner(_target(tiny_dir, TorchStepOps()), WIDTH), prompt, 12)
    engine = Engine.from_model(_target(tiny_dir, TritonStepOps()), step_width=WIDTH)
    plain = greedy_reference(engine.runner, prompt, 12)
    assert plain == torch_stream
    draft = make_tiny_draft(tmp_path / "d", "zlab", block_size=4, target_layer_ids=(-1, 1, 4), num_target_layers=5)
    arm = engine.arm(ArmConfig(draft=draft, mode="dflash"))
    with engine.session(prompt, 12, arm, eos_ids=()) as session:
        assert session.run() == plain


@pytest.mark.exhaustive  # steps through the interpreter; the torch path's ring: tests/engine/test_gemma4_ring.py
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_steps_over_a_sliding_ring_are_the_plain_storages(tiny_dir, monkeypatch, dtype):
    """The sliding layers' K/V in a ring of window + 16 rows (RING_SPAN patched to the step
    width so that a 64-position session takes it): fixed 16-row steps through the kernels, past
    the ring's end and wrapping around it, give the plain storage's logits bit for bit."""
    target = _target(tiny_dir, TritonStepOps(), dtype)
    runner = StepRunner(target, WIDTH)
    ids = torch.randint(0, VOCAB - 4, (44,), generator=torch.Generator().manual_seed(7)).tolist()

    def steps(span: int) -> torch.Tensor:
        monkeypatch.setattr(Gemma4Target, "RING_SPAN", span)
        state = target.new_state(64)
        rows, start = [], 0
        for g in (20, 16, 8):  # positions 0..43: windows past row 24 wrap around the ring
            rows.append(runner.step(torch.tensor(ids[start:start + g], device=DEVICE), start, state)[0])
            start += g
        return torch.cat(rows), max(kv.shape[2] for kv in state.kv if kv is not None), \
            min(kv.shape[2] for kv in state.kv if kv is not None)

    ring, plain = steps(WIDTH), steps(10 ** 9)
    assert ring[2] == 8 + WIDTH < ring[1] == 64 and plain[2] == 64  # the ring, and every position
    assert torch.equal(ring[0], plain[0])


@pytest.mark.exhaustive  # ~2 s through the interpreter
def test_the_benchmarks_attention_sweep_runs():
    """benchmarks/gpu/gemma4_step.py's attention sweep (target_step.py --attn-sweep on the H200):
    its candidate tiles are runnable tiles, and on a tiny shape through the interpreter it times
    every tile (a stand-in timer) and measures each against the module tile's output."""
    import importlib.util

    from memra_kernels.attention import Tile

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma4_step.py"
    spec = importlib.util.spec_from_file_location("gemma4_step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert all(Tile(*c) for tiles in [*mod.ATTN_CANDIDATES.values(), mod.STEP_FULL_TILES] for c in tiles)
    out = mod.attention_sweep([40], lambda fn: (fn(), 0.25)[1], torch.device(DEVICE), torch.float32,
                              shapes={"sliding": (4, 2, 64, 8)}, candidates={128: [(32, 16, 16, 1, 4)]})
    rows = out["sliding"]
    # the module tile, the candidate, and the module tile again on the causal grid (the same bits)
    assert len(rows) == 3 and all(r["40"]["us_1"] == r["40"]["us_16"] == 250.0 for r in rows.values())
    assert all(r["40"]["rel_l2_vs_module"] < 1e-5 for r in rows.values())  # float32: summation order only
    causal = [r for name, r in rows.items() if name.endswith(",causal-grid")]
    assert len(causal) == 1 and causal[0]["40"]["rel_l2_vs_module"] == 0.0


def test_the_sweeps_pick_is_the_fastest_long_tile_no_slower_short():
    """gemma4_step.pick_tile: the fastest 16-row tile at the longest context among those within
    5% of the module tile (the first row) at the shorter ones; None when that is the module's."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma4_step.py"
    spec = importlib.util.spec_from_file_location("gemma4_step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(short, long):
        return {"512": {"us_16": short}, "32768": {"us_16": long}}

    rows = {"128,32,16,2,8,0,0,0": row(20.0, 900.0), "256,32,64,2,8,2048,4096,256": row(22.0, 200.0),
            "256,16,64,2,8,2048,4096,256": row(20.5, 250.0), "64,32,16,2,8,0,0,0": row(19.0, 950.0),
            "128,32,64,2,8,1024,4096,256": {"512": {"error": "OutOfResources"}, "32768": {"us_16": 1.0}}}
    assert mod.pick_tile(rows) == (256, 16, 64, 2, 8, 2048, 4096, 256)  # 22.0 is over 5% slower at 512
    assert mod.pick_tile(rows, slack=1.2) == (256, 32, 64, 2, 8, 2048, 4096, 256)
    assert mod.pick_tile({"128,32,16,2,8,0,0,0": row(20.0, 900.0), "64,32,16,2,8,0,0,0": row(30.0, 100.0)}) is None


def test_the_benchmarks_step_ab_sets_and_restores_the_attentions_globals(monkeypatch):
    """gemma4_step's causal_grid_steps and full_tile_steps (GPU runs: here an Engine stand-in and a
    timer that records what it ran under): each step is timed with the grid / tile it names, and
    the module's values are back after, also when a step fails."""
    import importlib.util

    from memra_cli.engine.api import Engine
    from memra_kernels import attention

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gemma4_step.py"
    spec = importlib.util.spec_from_file_location("gemma4_step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    seen = []

    class Helpers:
        @staticmethod
        def step_ms(engine, ctx, rows):
            seen.append((attention.GRID_OVER_WINDOWS, attention.TILES[512].split, ctx, rows))
            if ctx == 13:
                raise RuntimeError("out of memory")
            return 1.5, 0.0

    class Target:
        step_ops = None

    monkeypatch.setattr(Engine, "from_model", classmethod(lambda cls, *a, **k: object()))
    module = attention.TILES[512]
    rows = mod.causal_grid_steps(Target(), [512, 32768], Helpers, 16)
    assert rows == {c: {"plain_ms": 1.5, "verify16_ms": 1.5} for c in ("512", "32768")}
    assert {s[0] for s in seen} == {False} and attention.GRID_OVER_WINDOWS is True
    seen.clear()
    rows = mod.full_tile_steps(Target(), [512], Helpers, 16, [(128, 32, 16, 2, 8)])
    assert rows["128,32,16,2,8"]["512"] == {"plain_ms": 1.5, "verify16_ms": 1.5}
    assert {s[1] for s in seen} == {128} and attention.TILES[512] is module
    with pytest.raises(RuntimeError):
        mod.full_tile_steps(Target(), [13], Helpers, 16, [(128, 32, 16, 2, 8)])
    with pytest.raises(RuntimeError):
        mod.causal_grid_steps(Target(), [13], Helpers, 16)
    assert attention.TILES[512] is module and attention.GRID_OVER_WINDOWS is True
