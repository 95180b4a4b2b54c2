"""A target family declares what the runtime uses (models/base.py `TargetModel`, `TargetState`):
`target_family` checks it once when a family is picked and refuses one that lacks a member or
claims a state capability without the methods behind it, naming the family and what is missing."""

import json

import pytest

from memra_cli.engine.errors import UnsupportedError
from memra_cli.engine.models import base
from memra_cli.engine.models.common import TargetBase
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.models.qwen3_5 import Qwen35Target
from memra_cli.engine.models.kv_cache import KVCache


def _target_dir(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


def _pick(monkeypatch, tmp_path, family):
    monkeypatch.setitem(base.MODEL_FAMILIES, "standin", lambda: family)
    return base.target_family(_target_dir(tmp_path, "standin"))


class _Complete(TargetBase):
    """A stand-in family with every member the runtime calls (bodies never run here)."""

    state_class = KVCache

    @classmethod
    def from_dir(cls, path, dtype, device): ...
    def new_state(self, rows): ...
    def ensure_positions(self, rows): ...
    def embed(self, ids): ...
    def logits(self, hidden): ...
    def lm_head(self, hidden): ...
    def forward(self, ids, start, state, taps=None): ...
    def static_step(self, ids, positions, state, taps=None, widen=True): ...


def test_shipped_families_pass_the_check():
    for model_type, loader in base.MODEL_FAMILIES.items():
        base.check_family(model_type, loader())
    assert Qwen3Target.state_class is KVCache and Qwen35Target.state_class.settles_on_device


def test_a_complete_stand_in_is_accepted(monkeypatch, tmp_path):
    assert _pick(monkeypatch, tmp_path, _Complete) is _Complete


def test_a_family_without_static_step_is_refused_by_name(monkeypatch, tmp_path):
    NoStep = type("NoStep", (TargetBase,), {k: v for k, v in vars(_Complete).items()
                                            if k not in ("static_step", "__dict__", "__weakref__")})
    with pytest.raises(UnsupportedError, match=r"model family 'standin' \(NoStep\): lacks static_step"):
        _pick(monkeypatch, tmp_path, NoStep)


def test_a_family_without_a_state_class_is_refused(monkeypatch, tmp_path):
    NoState = type("NoState", (_Complete,), {"state_class": None})
    with pytest.raises(UnsupportedError, match=r"\(NoState\): state_class must be the class new_state returns"):
        _pick(monkeypatch, tmp_path, NoState)


def test_a_state_lacking_a_capability_is_refused(monkeypatch, tmp_path):
    class BareState:  # no StateBase: no capability declared
        def rollback(self, n_keep): ...
        def reset(self): ...
        def commit(self, end, step_continues=False): ...
        nbytes = 0

    Bare = type("Bare", (_Complete,), {"state_class": BareState})
    with pytest.raises(UnsupportedError, match=r"its state BareState lacks host_bookkeeping, round_graphs_ok, "
                                               r"settles_on_device, graph_variants, graph_variant"):
        _pick(monkeypatch, tmp_path, Bare)


def test_a_claimed_capability_without_its_methods_is_refused(monkeypatch, tmp_path):
    Claims = type("ClaimsState", (KVCache,), {"settles_on_device": True})
    Family = type("Claimer", (_Complete,), {"state_class": Claims})
    with pytest.raises(UnsupportedError, match=r"ClaimsState sets settles_on_device but does not provide "
                                               r"restore_round and settled_on_device"):
        _pick(monkeypatch, tmp_path, Family)


def test_a_claimed_restore_graph_without_the_cache_hook_is_refused(monkeypatch, tmp_path):
    """A state that replays graphs of its own must take the runtime's cache (the runtime, not the
    model, captures them)."""
    Claims = type("RestoresState", (KVCache,), {"graphed_restores": True})
    Family = type("Restorer", (_Complete,), {"state_class": Claims})
    with pytest.raises(UnsupportedError, match=r"RestoresState sets graphed_restores but does not provide "
                                               r"attach_graph_cache"):
        _pick(monkeypatch, tmp_path, Family)


def test_reading_rows_holds_its_bound_inside_and_refuses_no_rows():
    """`StateBase.reading_rows(n)`: the state's host bound is n inside (nested: the inner one),
    put back after, also after an error; a bound below one row is refused by name."""
    from memra_cli.engine.models.state import StateBase

    state = StateBase()
    assert state.live_bound is None
    with state.reading_rows(1):
        assert state.live_bound == 1
        with state.reading_rows(3):
            assert state.live_bound == 3
        assert state.live_bound == 1
    with pytest.raises(RuntimeError), state.reading_rows(2):
        raise RuntimeError("the step failed")
    assert state.live_bound is None
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="reads at least one row"), state.reading_rows(bad):
            pass
