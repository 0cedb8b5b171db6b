"""The worker's modules import one way: no module imports, even lazily inside a function,
a module that imports it back (directly or through others). A circle is how two concepts
end up in each other's files; a lazy import only hides it from the interpreter."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (top level or in a function)."""
    paths = {}
    for path in (REPO / package).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name] |= {m for m in found if m in paths and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import path that comes back to where it started, found once each."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return found


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c", "a"]]


def test_the_worker_has_no_import_circle() -> None:
    graph = module_imports("worker")
    assert "worker.tools.registry" in graph["worker.__main__"]  # the graph is read
    assert circles(graph) == []


def test_no_worker_module_imports_opentelemetry() -> None:
    """Workers record spans as lines of their task's events (``worker.spans``); only the
    daemon's exporter loads the SDK (docs/design.md section 14)."""
    found = []
    for path in (REPO / "worker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "opentelemetry"]
    assert (REPO / "worker" / "spans.py").exists()
    assert found == []
