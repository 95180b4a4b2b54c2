"""A method a model class overrides takes every call its base (or the target protocol) allows:
the same positional parameters in the same places, defaults where the base has them, no new
required parameter, and the base's keyword-only names. The runtime calls a drafter's and a
target's methods through the base's signature, so an override that falls behind it (as
Gemma4Drafter's static_round once did, a positional parameter short) breaks only the families
and paths that override it; this finds such drift on the CPU, without running them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import memra_cli.engine.models as models
from memra_cli.engine.models import base

P = inspect.Parameter
_POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


def call_gaps(base_fn, fn) -> list[str]:
    """How `fn` fails to take a call that `base_fn`'s signature allows ([] when it takes all)."""
    b, s = inspect.signature(base_fn).parameters, inspect.signature(fn).parameters
    b_pos = [p for p in b.values() if p.kind in _POSITIONAL]
    s_pos = [p for p in s.values() if p.kind in _POSITIONAL]
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in s.values())
    var_kw = any(p.kind == P.VAR_KEYWORD for p in s.values())
    gaps = []
    if len(s_pos) < len(b_pos) and not var_pos:
        gaps.append(f"takes {len(s_pos)} positional parameters, the base {len(b_pos)}")
    for i, p in enumerate(b_pos):
        if p.default is not P.empty and i < len(s_pos) and s_pos[i].default is P.empty:
            gaps.append(f"{s_pos[i].name} (the base's {p.name}) has no default")
    for p in s_pos[len(b_pos):]:
        if p.default is P.empty:
            gaps.append(f"new required parameter {p.name}")
    for p in b.values():
        if p.kind == P.KEYWORD_ONLY and p.name not in s and not var_kw:
            gaps.append(f"lacks keyword {p.name}")
    for p in s.values():
        if p.kind == P.KEYWORD_ONLY and p.default is P.empty and p.name not in b:
            gaps.append(f"new required keyword {p.name}")
    return gaps


def _model_classes() -> list[type]:
    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"{models.__name__}.{info.name}")
    out, todo = [], [c for m in list(vars(models).values()) if inspect.ismodule(m) for c in vars(m).values()
                     if inspect.isclass(c) and c.__module__.startswith(models.__name__)]
    for cls in todo:
        if cls not in out:
            out.append(cls)
    return out


def test_every_override_in_the_model_classes_takes_its_bases_calls():
    gaps = []
    for cls in _model_classes():
        for parent in cls.__mro__[1:]:
            if not parent.__module__.startswith("memra_cli"):
                continue
            for name, fn in vars(cls).items():
                parent_fn = vars(parent).get(name)
                if name.startswith("__") or not inspect.isfunction(fn) or not inspect.isfunction(parent_fn):
                    continue
                gaps += [f"{cls.__name__}.{name} vs {parent.__name__}: {g}" for g in call_gaps(parent_fn, fn)]
    assert gaps == []


def test_every_target_family_takes_the_protocols_calls():
    gaps = []
    for family, load in base.MODEL_FAMILIES.items():
        cls = load()
        for name, proto_fn in vars(base.TargetModel).items():
            if name.startswith("_") or not inspect.isfunction(proto_fn):
                continue
            gaps += [f"{family} {cls.__name__}.{name}: {g}" for g in call_gaps(proto_fn, getattr(cls, name))]
    assert gaps == []


@pytest.mark.parametrize("unfused", [False, True], ids=["fused", "unfused"])
def test_the_kernel_step_ops_take_the_torch_step_ops_calls_and_back(unfused):
    """TritonStepOps runs only on CUDA, so a model's call that the torch ops take and it does not
    would fail only there: every op both have takes the other's calls (extra parameters with
    defaults aside), and the kernels' ops lack none the models call through the seam; the same
    for `unfused()`'s ops (the launch fusions undone, the A/B the benchmarks time)."""
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    torch_ops = TorchStepOps()
    kernel_ops = TritonStepOps().unfused() if unfused else TritonStepOps()
    names = lambda ops: {n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))}
    # markov_bias: the torch markov chain's own helper, not a seam op (the kernels' chain needs none)
    assert names(torch_ops) - names(kernel_ops) == {"markov_bias"}
    gaps = []
    for name in sorted(names(torch_ops) & names(kernel_ops)):
        ref, kernel = getattr(torch_ops, name), getattr(kernel_ops, name)
        gaps += [f"TritonStepOps.{name}: {g}" for g in call_gaps(ref, kernel)]
        gaps += [f"TorchStepOps.{name}: {g}" for g in call_gaps(kernel, ref) if not g.startswith("takes ")]
    assert gaps == []


def test_a_drifted_override_is_found():
    """The check itself: a positional parameter short, a default dropped, a new required
    parameter and a missing keyword are each named; a compatible override passes."""

    class Base:
        def round(self, kv, noise, start, at=None, *, want=False): ...

    class Short(Base):
        def round(self, kv, noise, start, *, want=False): ...

    class NoDefault(Base):
        def round(self, kv, noise, start, at, *, want=False): ...

    class Extra(Base):
        def round(self, kv, noise, start, at=None, extra=None, *, want=False, fresh): ...

    class Renamed(Base):
        def round(self, cache, x, s, positions=None, more=0, *, want=True, also=1): ...

    class Grown:
        def step(self, ids, start): ...

    class GrownMore(Grown):
        def step(self, ids, start, state): ...

    class NoKeyword(Base):
        def round(self, kv, noise, start, at=None): ...

    assert call_gaps(Base.round, Short.round) == ["takes 4 positional parameters, the base 5"]
    assert call_gaps(Base.round, NoDefault.round) == ["at (the base's at) has no default"]
    assert call_gaps(Base.round, Extra.round) == ["new required keyword fresh"]
    assert call_gaps(Grown.step, GrownMore.step) == ["new required parameter state"]
    assert call_gaps(Base.round, NoKeyword.round) == ["lacks keyword want"]
    assert call_gaps(Base.round, Renamed.round) == []  # names of positionals may differ; extras with defaults
