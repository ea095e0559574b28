"""The package's modules import each other without cycles (lazy and TYPE_CHECKING imports count).

Plain modules only: a package's ``__init__`` that registers its submodules (models, tasks, data)
is a registry pattern the submodules import back from, not a cycle between two modules."""

from __future__ import annotations

import ast
from pathlib import Path

import mptrain

PKG = Path(mptrain.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the mptrain modules it imports anywhere in its source (functions included)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from mptrain import fp8" imports the submodule; "from mptrain.x import y" imports x.
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_detector_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "mptrain.numerics.fp8" in graph and "mptrain.numerics.precision" not in graph["mptrain.numerics.fp8"]
    assert "mptrain.numerics.loss_scaling" not in graph["mptrain.numerics.adaptive_scaling"] or (
        "mptrain.numerics.adaptive_scaling" not in graph["mptrain.numerics.loss_scaling"]
    )
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
