"""DSpark's markov bias table is one-time set-up of a loaded drafter: `engine.arm` builds it
(counted in the arm's `load_ms`), so no session's first round pays for it in its draft phase."""

from __future__ import annotations

import torch

from memra_cli.assets import default_pair
from memra_cli.engine.api import ArmConfig, Engine, EngineConfig
from memra_cli.engine.layers.torch_step_ops import TorchStepOps


def test_the_bias_table_is_built_by_arm_not_by_the_first_round(monkeypatch):
    target_dir, drafts = default_pair()
    engine = Engine.load(EngineConfig(target=target_dir, device="cpu"))
    built = []
    real = TorchStepOps.markov_bias

    def counting(w1, w2, prev, dtype):
        built.append(int(prev[0]))
        return real(w1, w2, prev, dtype)

    monkeypatch.setattr(TorchStepOps, "markov_bias", staticmethod(counting))
    arm = engine.arm(ArmConfig(draft=drafts["dspark"], mode="dspark"))
    assert arm.program.markov and len(built) == arm.drafter.markov_w1.shape[0]  # every row, at load
    assert arm.load_ms is not None and arm.load_ms > 0
    built.clear()
    with torch.inference_mode():
        session = engine.session(list(range(40, 60)), 32, arm, eos_ids=())
        out = session.run()
    assert len(out) == 32 and session.stats.drafted > 0
    assert built == []  # the rounds gathered from the table; none built a row


def test_the_kernel_seam_builds_its_table_once_at_prepare(monkeypatch):
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    ops = TritonStepOps()
    built = []
    real = ops._markov.bias_table
    monkeypatch.setattr(ops._markov, "bias_table", lambda *a: built.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    assert ops.prepare_markov(w1, w2, torch.float32) and built == [1]
    assert ops.prepare_markov(w1, w2, torch.float32) and built == [1]  # kept, keyed by its weights
