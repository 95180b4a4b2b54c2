"""Training's taps of a batch (`forward_taps`): every family runs the batch's rows through its
layers' matmuls together (the mixers per sequence where they must be) and gives what `forward`
gives one sequence at a time, padding zeroed."""

from __future__ import annotations

import pytest
import torch

from memra_cli.engine.models.common import TargetBase
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.engine.models.gemma4_moe import Gemma4MoeTarget
from memra_cli.engine.models.llama import LlamaTarget
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.models.qwen3_5_moe import Qwen35MoeTarget
from memra_cli.engine.models.qwen3_moe import Qwen3MoeTarget
from memra_cli.tiny.__main__ import TINY_MOE
from memra_cli.tiny.gemma4 import make_tiny_gemma4
from memra_cli.tiny.qwen3_5 import make_tiny_qwen35
from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
from memra_cli.tiny.target import make_tiny_llama, make_tiny_qwen3

from fp32_bounds import assert_close_at_scale, layer_reductions, reorder_bound

PLE_LAYERS = ("sliding_attention", "full_attention") * 3  # every type keeps a layer of its own K/V before the shared two
BATCHED = {
    "qwen3": (make_tiny_qwen3, Qwen3Target),
    "llama": (make_tiny_llama, LlamaTarget),
    "qwen3_moe": (make_tiny_qwen3_moe, Qwen3MoeTarget),
    "qwen3_5": (make_tiny_qwen35, Qwen35Target),
    "qwen3_5_moe": (lambda d: make_tiny_qwen35(d, moe=TINY_MOE), Qwen35MoeTarget),
    "gemma4": (make_tiny_gemma4, Gemma4Target),
    "gemma4_moe": (lambda d: make_tiny_gemma4(d, moe=TINY_MOE, tie=False), Gemma4MoeTarget),
    # per-layer inputs and two KV-shared layers (reading their source layer's storage)
    "gemma4_ple_shared": (lambda d: make_tiny_gemma4(d, ple=8, shared=2, layer_types=PLE_LAYERS, k_eq_v=False,
                                                     softcap=None, tie=False, seed=1), Gemma4Target),
}


def _one_at_a_time(target, ids, taps, lengths) -> torch.Tensor:
    """Each sequence through `forward` on its own fresh state: what training ran before batching."""
    return TargetBase.forward_taps(target, ids, taps, lengths)


def _bound(target, depth: int, keys: int) -> float:
    """Float32 reordering bound through `depth` layers (a batch's matmuls sum over the same
    lengths as one sequence's, in another order): each layer's reductions taken at an envelope
    of the tiny targets' widths (mixer up to 2x hidden, MLP up to 4x)."""
    h = target.hidden_size
    return reorder_bound(*layer_reductions(h, 2 * h, h, keys, 4 * h) * depth)


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 40), generator=gen)
    return ids, [40, 23, 31]  # one full row, two padded


@pytest.mark.parametrize("family", sorted(BATCHED))
def test_a_batch_in_one_pass_gives_each_sequences_own_taps(tmp_path, family):
    make, cls = BATCHED[family]
    target = cls.from_dir(make(tmp_path / family), torch.float32, "cpu")
    assert target.batched_taps is True
    ids, lengths = _batch(target.vocab_size)
    ids[1, lengths[1]:] = 7  # what a padding row holds never reaches a real row
    deep = target.n_layers - 2  # past the first layers (the PLE model's: a KV-shared one), not the last
    taps = (-1, 0, deep)
    got = target.forward_taps(ids, taps, lengths)
    want = _one_at_a_time(target, ids, taps, lengths)
    assert got.shape == (3, 40, 3 * target.hidden_size) and got.dtype == torch.float32
    bound = _bound(target, deep + 1, 40)
    assert_close_at_scale(got, want, bound, family)
    for b, n in enumerate(lengths):
        assert torch.count_nonzero(got[b, n:]) == 0 and torch.count_nonzero(got[b, :n]) > 0
    # the taps are per sequence: another row beside it changes nothing beyond rounding
    alone = target.forward_taps(ids[2:3, :lengths[2]], taps)
    assert_close_at_scale(got[2:3, :lengths[2]], alone, bound, f"{family} alone")
    # taps come back in the order asked
    swapped = target.forward_taps(ids, (deep, -1), lengths)
    h = target.hidden_size
    torch.testing.assert_close(swapped, torch.cat([got[..., 2 * h:], got[..., :h]], dim=-1), rtol=0, atol=0)


def test_a_gemma_batch_long_enough_for_rings_runs_forward_per_sequence(tmp_path, monkeypatch):
    """Sliding-layer rings (a storage past window + RING_SPAN rows) need forward's chunked
    writes: such a batch goes through `forward` one sequence at a time, with the same taps."""
    target = Gemma4Target.from_dir(make_tiny_gemma4(tmp_path / "g"), torch.float32, "cpu")
    monkeypatch.setattr(Gemma4Target, "RING_SPAN", 16)  # rings of window + 16 rows, under the batch's 40
    assert Gemma4Target._has_ring(target.new_state(40))
    calls = []
    per_sequence = TargetBase.forward_taps
    monkeypatch.setattr(TargetBase, "forward_taps", lambda *a, **k: calls.append(1) or per_sequence(*a, **k))
    ids, lengths = _batch(target.vocab_size, seed=1)
    got = target.forward_taps(ids, (0, 1), lengths)
    assert calls == [1]
    for b, n in enumerate(lengths):
        _, want = target.forward(ids[b, :n], 0, target.new_state(n), taps=[0, 1])
        assert torch.equal(got[b, :n], want) and torch.count_nonzero(got[b, n:]) == 0


def test_bad_taps_and_ids_are_refused_before_any_layer_runs(tmp_path):
    from memra_cli.engine.errors import ConfigError, PromptError

    target = Qwen3Target.from_dir(make_tiny_qwen3(tmp_path / "q"), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="tap layer id 4"):
        target.forward_taps(torch.zeros(2, 8, dtype=torch.long), (0, 4))
    with pytest.raises(ConfigError, match="at least one tap"):
        target.forward_taps(torch.zeros(2, 8, dtype=torch.long), ())
    with pytest.raises(PromptError, match=r"ids \[B, L\] with B, L >= 1, got shape \[2, 0\]"):
        target.forward_taps(torch.zeros(2, 0, dtype=torch.long), (0,))


@pytest.mark.parametrize("rollback_rows", [16, 64])
def test_the_hybrids_batch_takes_forwards_recurrence_form(tmp_path, monkeypatch, rollback_rows):
    """A Qwen3.5 batch of 40-token rows runs the chunked DeltaNet form past `rollback_rows` (16)
    and the sequential one within it (64), as `forward` does for a prompt from position 0."""
    from memra_cli.engine.models import qwen3_5

    target = Qwen35Target.from_dir(make_tiny_qwen35(tmp_path / "h"), torch.float32, "cpu")
    target.set_rollback(target.rollback_mode, rollback_rows)
    ids, lengths = _batch(target.vocab_size, seed=2)
    calls = []
    chunked = qwen3_5.gated_delta_rule_chunked
    monkeypatch.setattr(qwen3_5, "gated_delta_rule_chunked", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    got = target.forward_taps(ids, (-1, 1, 3), lengths)
    assert bool(calls) == (rollback_rows == 16)
    assert_close_at_scale(got, _one_at_a_time(target, ids, (-1, 1, 3), lengths), _bound(target, 4, 40), rollback_rows)
