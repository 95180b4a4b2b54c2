"""Chunked prefill: a prompt runs in forwards of at most `prefill_chunk` rows, with the drafter's
context ingested chunk by chunk. The result must be the unchunked prefill's (f32: to rounding),
the transient mask must be bounded by the chunk, and speculative streams must still equal plain
greedy, in bf16 too."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.errors import ConfigError
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.runtime.steps import PREFILL_CHUNK, StepRunner
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35
from memra_cli.tiny.target import make_tiny_qwen3

VOCAB = 512


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("prefill") / "target", hidden=128, intermediate=384, layers=3,
                           heads=4, kv_heads=2, head_dim=32)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(model, ids: torch.Tensor, chunk: int, taps=(0, 2)):
    runner = StepRunner(model, 16, prefill_chunk=chunk)
    state = runner.new_state(ids.shape[0] + 8)
    logits, tapped = runner.prefill(ids, state, taps)
    return logits, tapped, state


@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_chunked_prefill_equals_one_forward(target_dir, chunk):
    model = Qwen3Target.from_dir(target_dir, dtype=torch.float32)
    ids = _ids(53, 1)
    want_logits, want_taps, want_state = _prefill(model, ids, 10_000)
    got_logits, got_taps, got_state = _prefill(model, ids, chunk)
    assert got_state.length == want_state.length == 53
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_taps, want_taps, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_state.kv, want_state.kv):
        torch.testing.assert_close(a[:, :, :53], b[:, :, :53], rtol=1e-5, atol=1e-5)


def test_chunk_taps_go_to_the_callback_in_order_and_are_not_kept(target_dir):
    model = Qwen3Target.from_dir(target_dir, dtype=torch.float32)
    ids = _ids(23, 2)
    _, whole, _ = _prefill(model, ids, 10_000)
    got = []
    runner = StepRunner(model, 16, prefill_chunk=10)
    _, returned = runner.prefill(ids, runner.new_state(30), (0, 2), on_taps=lambda t, lo: got.append((lo, t)))
    assert returned is None
    assert [(lo, t.shape[0]) for lo, t in got] == [(0, 10), (10, 10), (20, 3)]
    torch.testing.assert_close(torch.cat([t for _, t in got]), whole, rtol=1e-5, atol=1e-5)


def test_the_mask_is_bounded_by_the_chunk(target_dir, monkeypatch):
    """A long prompt never builds the [g*t, t] mask: each forward's mask has at most g*chunk rows."""
    model = Qwen3Target.from_dir(target_dir, dtype=torch.float32)
    shapes = []
    real = model._mask
    monkeypatch.setattr(model, "_mask", lambda start, t: shapes.append((start, t)) or real(start, t))
    _prefill(model, _ids(100, 3), 32, taps=None)
    assert [t for _, t in shapes] == [32, 32, 32, 4] and max(s + t for s, t in shapes) == 100


def test_prefill_chunk_is_checked_and_defaults(target_dir):
    model = Qwen3Target.from_dir(target_dir, dtype=torch.float32)
    assert StepRunner(model, 16).prefill_chunk == PREFILL_CHUNK
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            StepRunner(model, 16, prefill_chunk=bad)


@pytest.mark.parametrize("spec", ["dflash", "dspark"])
def test_bf16_speculative_equals_plain_with_chunked_prefill(target_dir, tmp_path, spec):
    """Prompts longer than the chunk: the drafter's context arrives chunk by chunk, and every
    stream still equals plain greedy of the same runner (bf16, 16-row steps)."""
    engine = Engine.from_model(Qwen3Target.from_dir(target_dir, dtype=torch.bfloat16), step_width=16)
    engine.runner.prefill_chunk = 7
    fmt = "zlab" if spec == "dflash" else "deepspec"
    extra = {} if spec == "dflash" else dict(markov_rank=16, confidence="markov")
    draft = make_tiny_draft(tmp_path / spec, fmt, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                            block_size=16, target_layer_ids=(0, 2), num_target_layers=3, dtype=torch.bfloat16, **extra)
    arm = engine.arm(ArmConfig(draft=draft, mode=spec, settings=PolicySettings(adapt="0")))
    for seed in range(3):
        prompt = _ids(20 + 9 * seed, 30 + seed).tolist()
        plain = greedy_reference(engine.runner, prompt, 32)
        assert engine.session(prompt, 32, arm, eos_ids=()).run() == plain, seed


def test_chunked_prefill_on_the_hybrid_target(tmp_path):
    """Qwen3.5 (Gated DeltaNet + gated attention): the recurrent state carries across chunks."""
    model = Qwen35Target.from_dir(make_tiny_qwen35(tmp_path / "q35"))
    ids = _ids(40, 4) % model.vocab_size
    runner_whole, runner_chunked = StepRunner(model, None, prefill_chunk=10_000), StepRunner(model, None, prefill_chunk=9)
    outs = []
    for runner in (runner_whole, runner_chunked):
        state = runner.new_state(60)
        logits, _ = runner.prefill(ids, state)
        step_logits, _ = runner.step(_ids(5, 5) % model.vocab_size, 40, state)
        outs.append((logits, step_logits))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
