"""Programmatic dependent launch (kernels/_pdl.py): the source rules that make it safe.

A kernel launched with PDL may start before the previous kernel has finished; it is correct only
if it waits (`pdl_wait(PDL)`) before its first memory access. These tests read kernels/*.py and
require, for every kernel a module launches (`name[grid](...)`): a `PDL` constexpr parameter,
`pdl_wait(PDL)` as the first statement of its body (after the docstring), and `**pdl_args(...)`
at every launch, which sets the flag and the launch attribute together. (test_sm90_compile.py
checks the compiled side: each launch's attribute matches the kernel's flag.) The last tests
plant each kind of mistake in a copy of a kernel's source and show the checker reports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _launches(tree: ast.AST) -> list[ast.Call]:
    """Calls of the form `name[grid](...)`."""
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)]


# Kernels launched in plain stream order on purpose (never with PDL), and why: they must then
# have no PDL flag and no pdl_args at their launches, so the choice is visible in one place.
PLAIN_ORDER = {
    "_quant_linear_kernel": "a weight stream over many blocks: slower with PDL on the H200 (docs/perf.md)",
}


# Kernels whose first statement may be a helper that reads weights (no kernel writes them) before
# it waits for the previous kernel: kernel -> the helper. The helper must take PDL first and must
# not load (tl.load) anything; `test_prefetching_waits_load_nothing` reads it.
WAITS_AFTER_PREFETCH = {
    "_dense_linear_kernel": "_prefetch_then_wait",
    "_router_route_kernel": "_prefetch_router_then_wait",
}


def pdl_violations(source: str, module: str = "<src>") -> list[str]:
    """The PDL rule breaches of one kernel module's source (empty when it follows them)."""
    tree = ast.parse(source)
    jits = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}
    out = []
    launched = set()
    for call in _launches(tree):
        name = call.func.value.id
        if name not in jits:
            continue
        launched.add(name)
        starred = [k.value for k in call.keywords if k.arg is None]
        has_args = any(isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "pdl_args"
                       for v in starred)
        if name in PLAIN_ORDER:
            if has_args:
                out.append(f"{module}:{call.lineno}: {name} is launched in plain order (PLAIN_ORDER) but passes pdl_args")
        elif not has_args:
            out.append(f"{module}:{call.lineno}: launch of {name} without **pdl_args(...)")
        if any(k.arg in ("PDL", "launch_pdl") for k in call.keywords):
            out.append(f"{module}:{call.lineno}: launch of {name} sets PDL / launch_pdl by hand")
    for name in sorted(launched):
        fn = jits[name]
        params = {a.arg: a for a in fn.args.args}
        if name in PLAIN_ORDER:
            if "PDL" in params:
                out.append(f"{module}: {name} is launched in plain order (PLAIN_ORDER) but has a PDL parameter")
            continue
        if "PDL" not in params:
            out.append(f"{module}: {name} has no PDL parameter")
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        first = body[0] if body else None
        call = first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) else None
        callee = call.func.id if call is not None and isinstance(call.func, ast.Name) else None
        args = [ast.unparse(a) for a in call.args] if call is not None else []
        plain_wait = callee == "pdl_wait" and args == ["PDL"]
        prefetch_wait = callee is not None and callee == WAITS_AFTER_PREFETCH.get(name) and args[:1] == ["PDL"]
        if not (plain_wait or prefetch_wait):
            out.append(f"{module}: {name} does not start with pdl_wait(PDL)")
    return out


def _modules():
    return sorted(p for p in KERNELS.glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.stem)
def test_every_launched_kernel_waits_first(path):
    assert pdl_violations(path.read_text(), path.name) == []


def test_the_rules_see_every_launch():
    """The scan finds the launches it checks (a scan that finds none would pass vacuously)."""
    n = sum(1 for p in _modules() for c in _launches(ast.parse(p.read_text())))
    assert n >= 20


NORM = (KERNELS / "norm.py").read_text()


@pytest.mark.parametrize("plant, expect", [
    (lambda s: s.replace("    pdl_wait(PDL)\n", "", 1), "does not start with pdl_wait(PDL)"),
    (lambda s: s.replace("    pdl_wait(PDL)\n    row = tl.program_id(0).to(tl.int64)\n",
                         "    row = tl.program_id(0).to(tl.int64)\n    pdl_wait(PDL)\n", 1),
     "does not start with pdl_wait(PDL)"),
    (lambda s: s.replace(", **pdl_args(x)", "", 1), "without **pdl_args"),
    (lambda s: s.replace(", PDL: tl.constexpr = False", "", 1).replace("pdl_wait(PDL)", "pdl_wait(False)", 1),
     "no PDL parameter"),
    (lambda s: s.replace("**pdl_args(x)", "**pdl_args(x), launch_pdl=True", 1), "by hand"),
])
def test_planted_breaches_are_reported(plant, expect):
    broken = plant(NORM)
    assert broken != NORM, "the plant did not apply: update this test with norm.py"
    found = pdl_violations(broken, "norm.py")
    assert any(expect in v for v in found), found


def test_prefetching_waits_load_nothing():
    """A helper allowed before the wait only prefetches (never tl.load) and waits when PDL is set."""
    src = (KERNELS / "dense_linear.py").read_text()
    helpers = {n.name: n for p in _modules() for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.FunctionDef)}
    for kernel, helper in WAITS_AFTER_PREFETCH.items():
        fn = helpers[helper]
        body = ast.unparse(fn)
        assert fn.args.args[0].arg == "PDL", helper
        assert "tl.load" not in body and "gdc_wait()" in body, helper
        assert "gdc_launch_dependents" not in body, f"{helper}: the next kernel would squat while this one streams"
    broken = src.replace("    _prefetch_then_wait(PDL, ", "    _prefetch_then_wait(True, ", 1)
    assert broken != src
    assert any("does not start with pdl_wait" in v for v in pdl_violations(broken, "dense_linear.py"))


def test_a_plain_order_kernel_given_pdl_args_is_reported():
    src = (KERNELS / "quant_linear.py").read_text()
    broken = src.replace("num_warps=cfg.num_warps, num_stages=cfg.num_stages,",
                         "num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x),", 1)
    assert broken != src
    assert any("PLAIN_ORDER" in v for v in pdl_violations(broken, "quant_linear.py"))


def test_off_on_cpu_and_by_switch(monkeypatch):
    from memra_kernels import _pdl

    assert _pdl.pdl_args(torch.zeros(1)) == {}
    monkeypatch.setenv(_pdl.ENV, "0")
    assert not _pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv(_pdl.ENV, "yes")
    with pytest.raises(ValueError, match="MEMRA_PDL='yes': expected 0 or 1"):
        _pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv(_pdl.ENV, "0")
    if torch.cuda.is_available():
        assert _pdl.pdl_args(torch.zeros(1, device="cuda")) == {}


def test_plain_launches_scope(monkeypatch):
    """`plain_launches()` turns PDL off inside it (nested too), on this thread only, and back."""
    import threading

    from memra_kernels import _pdl

    monkeypatch.setattr(_pdl, "interpreting", lambda: False)  # as on an sm_90 GPU
    monkeypatch.setattr(_pdl, "_capable", lambda index: True)
    monkeypatch.delenv(_pdl.ENV, raising=False)
    dev = torch.device("cuda", 0)
    assert _pdl.enabled(dev)
    seen = []
    with _pdl.plain_launches():
        assert not _pdl.enabled(dev)
        with _pdl.plain_launches():
            assert not _pdl.enabled(dev)
        assert not _pdl.enabled(dev)
        other = threading.Thread(target=lambda: seen.append(_pdl.enabled(dev)))
        other.start()
        other.join()
    assert seen == [True] and _pdl.enabled(dev)
    with pytest.raises(RuntimeError):
        with _pdl.plain_launches():
            raise RuntimeError("boom")
    assert _pdl.enabled(dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chain_with_pdl_equals_plain_launches(monkeypatch):
    """A chain of dependent kernels (add + norm -> SiLU*mul -> argmax, twice) in one CUDA graph
    with PDL on, against the same chain launched eagerly without it: bit-identical. A kernel
    that read its input before the previous kernel finished would show here as a mismatch."""
    from memra_kernels import _pdl
    from memra_kernels.activation import silu_mul
    from memra_kernels.argmax import row_argmax
    from memra_kernels.norm import add_rms_norm

    monkeypatch.delenv(_pdl.ENV, raising=False)
    if not _pdl.enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    d, inter = 4096, 2048
    x = torch.randn(16, d, device="cuda", dtype=torch.bfloat16, generator=g)
    res = torch.randn(16, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(d, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5

    def chain():
        h, r = add_rms_norm(x, res, w, 1e-6)
        a = silu_mul(h[:, : 2 * inter])
        h2, _ = add_rms_norm(r, h, w, 1e-6)
        return torch.stack([row_argmax(a), row_argmax(h2)]), h2

    monkeypatch.setenv(_pdl.ENV, "0")
    ref_idx, ref_h = chain()
    monkeypatch.setenv(_pdl.ENV, "1")
    chain()  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, h = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(idx, ref_idx) and torch.equal(h, ref_h)
