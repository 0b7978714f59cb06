"""The import graph of ``app/`` has no cycle, counting imports made inside functions: a cycle
hidden by a function-local import is still two modules that cannot be read one without the
other."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, here: str, is_package: bool) -> list[str]:
    """The modules an import statement names (``from app import grains`` names
    ``app.analysis.grains`` as well as ``app``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the package this module is in
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found = {m for node in ast.walk(tree) for m in imported(node, name, is_package)}
        # a package's __init__ is imported with each of its modules: an edge to it is no cycle
        # of two modules unless the __init__ imports something back
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules in import order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_app_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_function_local_imports():
    graph = {"app.a": {"app.b"}, "app.b": {"app.a"}}
    assert find_cycle(graph) == ["app.a", "app.b", "app.a"]
    source = "def f():\n    from app.b import x\n"
    found = [m for node in ast.walk(ast.parse(source)) for m in imported(node, "app.a", False)]
    assert "app.b" in found
    assert import_graph()["app.engine.tracking"]  # the graph is built from app/'s files


def test_no_module_over_500_lines_without_a_reason():
    """A module over 500 lines says why in its docstring, in a paragraph starting ``Size``."""
    unexplained = []
    for path in sorted(APP.rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > 500:
            doc = ast.get_docstring(ast.parse(source)) or ""
            if "\nSize (over 500 lines):" not in doc:
                unexplained.append(str(path.relative_to(APP.parent)))
    assert not unexplained, f"over 500 lines without a reason in the docstring: {unexplained}"
