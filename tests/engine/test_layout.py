"""The package's structure, as the architecture doc states it: no import cycle, front ends that
build nothing themselves, and build / oracle code kept out of what `generate` loads."""

from __future__ import annotations

import ast
from pathlib import Path

import memra_cli

ROOT = Path(memra_cli.__file__).parent


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _deps(source: str, mods, name: str) -> set[str]:
    """The memra modules (of `mods`) that module `name`'s `source` imports anywhere (lazy imports
    inside functions included)."""
    deps = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            for alias in node.names:
                full = f"{base}.{alias.name}"
                deps.add(full if full in mods else base)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
    return {d for d in deps if d in mods and d != name}


def _imports() -> dict[str, set[str]]:
    """module -> memra modules it imports anywhere (lazy imports inside functions included)."""
    mods = {_module(p): p for p in ROOT.rglob("*.py")}
    return {name: _deps(path.read_text(), mods, name) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    graph = {k: {d for d in v if not d.endswith("__init__")} for k, v in _imports().items()}
    # a package's __init__ re-exporting its own modules is not a cycle worth naming
    graph = {k: {d for d in v if not k.startswith(d + ".")} for k, v in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_a_planted_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_cli_module_builds_a_target_or_a_drafter():
    for path in (ROOT / "cli").glob("*.py"):
        text = path.read_text()
        for needle in ("Qwen3Target", "Drafter.load", "from_dir(", "StepRunner(", "models.drafter", "models.qwen3"):
            assert needle not in text, f"{path.name} builds a model itself ({needle}); use engine/api.py"


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph.get(n, ()))
    return seen


def test_runtime_never_imports_build_code_or_the_oracle_maker():
    reach = _reach(_imports(), "memra_cli.engine.api")
    bad = {m for m in reach if m.startswith(("memra_cli.assets", "memra_cli.tiny", "memra_cli.train", "memra_cli.bench",
                                             "memra_cli.parity", "memra_cli.serve"))}
    assert not bad, sorted(bad)


# The order imports point (docs/architecture.md): a module may import its own layer or a lower one.
LAYERS = ("formats", "quant", "layers", "models", "runtime", "spec", "api")
LEAVES = {"errors", "files", "stats", "text", "prompts", "threads"}  # engine modules every layer may import
ABOVE_API = {"defaults"}  # engine modules built on api.py (or beside it)
TOOLS = {"bench", "parity", "serve", "train"}  # the front ends' own packages, outside the engine core, above api
SPEC_LEVEL = {"greedy"}  # plain decoding over a runner and a sampler

def _rank(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "memra_cli":
        return None
    if parts[1] == "cli":
        return len(LAYERS) + 1
    if parts[1] in TOOLS:
        return len(LAYERS)
    if parts[1] != "engine" or len(parts) < 3:
        return None  # assets/, tiny/, hf_compat: build and test helpers, checked above
    name = parts[2]
    if name in LAYERS:
        return LAYERS.index(name)
    if name in LEAVES:
        return -1
    if name in SPEC_LEVEL:
        return LAYERS.index("spec")
    if name in ABOVE_API:
        return len(LAYERS)
    return None


def _against_the_order(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for module, deps in graph.items():
        rank = _rank(module)
        for dep in deps:
            dep_rank = _rank(dep)
            if rank is not None and dep_rank is not None and dep_rank > rank:
                bad.add((module, dep))
    return bad


# Inside layers/, the step-ops seam's modules import one way: each fused op undone, the torch
# reference, the kernels (which fall back to both), the seam that picks one.
STEP_OPS_ORDER = ("unfused", "torch_step_ops", "triton_step_ops", "step_ops")


def _against_the_step_ops_order(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    def rank(module: str) -> int | None:
        prefix = "memra_cli.engine.layers."
        name = module[len(prefix):] if module.startswith(prefix) else None
        return STEP_OPS_ORDER.index(name) if name in STEP_OPS_ORDER else None

    return {(m, d) for m, deps in graph.items() for d in deps
            if rank(m) is not None and rank(d) is not None and rank(d) > rank(m)}


def test_every_engine_module_has_a_layer():
    unplaced = [m for m in _imports() if m.startswith("memra_cli.engine.") and _rank(m) is None]
    assert not unplaced, f"give these a layer in test_layout.py: {unplaced}"


def test_imports_point_down_the_layers():
    graph = _imports()
    assert sum(map(len, graph.values())) > 200  # the scan sees the real package's edges
    bad = _against_the_order(graph)
    assert not bad, f"imports against {' < '.join(LAYERS)} < cli: {sorted(bad)}"
    assert all(f"memra_cli.engine.layers.{name}" in graph for name in STEP_OPS_ORDER)
    bad = _against_the_step_ops_order(graph)
    assert not bad, f"layers/ imports against {' < '.join(STEP_OPS_ORDER)}: {sorted(bad)}"


def test_a_planted_upward_import_is_found():
    graph = {"memra_cli.engine.layers.x": {"memra_cli.engine.spec.y"}, "memra_cli.engine.spec.y": set()}
    assert _against_the_order(graph) == {("memra_cli.engine.layers.x", "memra_cli.engine.spec.y")}
    torch_ops, seam = "memra_cli.engine.layers.torch_step_ops", "memra_cli.engine.layers.step_ops"
    assert _against_the_step_ops_order({torch_ops: {seam}, seam: {torch_ops}}) == {(torch_ops, seam)}


def test_a_planted_lazy_upward_import_in_the_real_package_is_found():
    """A model module that captures a graph itself (a lazy import of the runtime inside a
    method), planted into the package's real graph: the scan reads it and the order refuses
    exactly that edge."""
    graph = _imports()
    planted = "memra_cli.engine.models.qwen3_5"
    source = ("import torch\n\nclass S:\n    def restore(self):\n"
              "        from memra_cli.engine.runtime import cuda_graphs\n        return cuda_graphs\n")
    graph[planted] = graph[planted] | _deps(source, graph, planted)
    assert _against_the_order(graph) == {(planted, "memra_cli.engine.runtime.cuda_graphs")}


KERNELS = ROOT.parent / "kernels"


def _kernel_modules_importing_memra_cli(sources: dict[str, str]) -> set[str]:
    """`sources`: file name -> source of kernels/*.py. The names of those importing memra_cli
    anywhere (lazy imports inside functions included)."""
    importing = set()
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "memra_cli" or n.startswith("memra_cli.") for n in names):
                importing.add(name)
    return importing


def test_kernels_import_nothing_from_memra_cli():
    """memra_kernels sits below the whole app: none of its modules imports memra_cli, lazily or not."""
    sources = {path.name: path.read_text() for path in KERNELS.glob("*.py")}
    assert len(sources) > 10  # the scan reads the real folder (an empty glob would pass vacuously)
    importing = _kernel_modules_importing_memra_cli(sources)
    assert not importing, f"kernels importing memra_cli: {sorted(importing)}"


def test_a_planted_kernel_import_of_memra_cli_is_found():
    planted = {
        "top.py": "from memra_cli.engine.quant.blocks import quantize\n",
        "lazy.py": "def f():\n    import memra_cli.engine.errors\n",
        "clean.py": "from ._common import check_tensors\nimport memra_clinic\n",
    }
    assert _kernel_modules_importing_memra_cli(planted) == {"top.py", "lazy.py"}


# Kernel modules the engine's CPU path and the packing at load import: they and every kernels/
# module they import (relative imports) must not import triton, which a CPU install may lack.
TRITON_FREE_KERNELS = ("ggml_blocks_ref.py", "quant_pack.py")


def _kernel_imports(source: str) -> tuple[set[str], bool]:
    """(kernels/ files `source` imports relatively, whether it imports triton), lazy imports included."""
    local, triton = set(), False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            local.update(f"{node.module}.py" if node.module else f"{a.name}.py" for a in node.names)
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        triton |= any(n == "triton" or n.startswith("triton.") for n in names)
    return local, triton


def _importing_triton(sources: dict[str, str], roots) -> set[str]:
    """The files reachable from `roots` through relative imports that import triton."""
    seen, todo, bad = set(), list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in sources:
            continue
        seen.add(name)
        local, triton = _kernel_imports(sources[name])
        if triton:
            bad.add(name)
        todo.extend(local)
    return bad


def test_packing_and_codec_kernels_are_triton_free():
    sources = {path.name: path.read_text() for path in KERNELS.glob("*.py")}
    assert all(name in sources for name in TRITON_FREE_KERNELS)
    reached = _importing_triton(sources, ["quant_linear.py"])  # the scan sees triton, and follows imports
    assert {"quant_linear.py", "_quant_dequant.py", "_splitk.py"} <= reached
    assert not _importing_triton(sources, TRITON_FREE_KERNELS)


def test_a_planted_triton_import_behind_a_relative_import_is_found():
    planted = {"a.py": "from .b import f\n", "b.py": "def f():\n    import triton.language as tl\n",
               "c.py": "import tritonic\nfrom . import a\n"}
    assert _importing_triton(planted, ["c.py"]) == {"b.py"}
