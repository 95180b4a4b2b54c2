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


def _imports() -> dict[str, set[str]]:
    """module -> memra modules it imports anywhere (lazy imports inside functions included)."""
    mods = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in mods else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


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
    bad = {m for m in reach if m.startswith(("memra_cli.assets", "memra_cli.tiny", "memra_cli.train")) or m == "memra_cli.engine.reference"}
    assert not bad, sorted(bad)
