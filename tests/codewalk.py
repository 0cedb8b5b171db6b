"""Walks over agentd's own code for the tests of its vocabulary (event names, record
kinds): the modules, a read of ``x["key"]`` or ``x.get("key")``, the strings a node
holds, and every place a finder reports, as a test's failure lists them."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: agentd's own code (``worker/testing`` is the store suites' made-up data).
SOURCES = [
    path
    for package in ("supervisor", "worker")
    for path in sorted((REPO / package).rglob("*.py"))
    if "testing" not in path.relative_to(REPO).parts
]

Finder = Callable[[ast.AST], Iterator[tuple[int, str]]]


def reads_key(node: ast.AST, key: str) -> bool:
    """``x[key]`` or ``x.get(key)``: a field of a record read back."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == key
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = node.args
        return node.func.attr == "get" and bool(args) and getattr(args[0], "value", None) == key
    return False


def texts(node: ast.AST | None) -> list[str]:
    """The strings ``node`` is, or holds (a tuple, set or list of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return [t for element in node.elts for t in texts(element)]
    return []


def compared_with(node: ast.Compare, key: str) -> list[str]:
    """The strings a comparison holds a read of ``key`` against."""
    sides = [node.left, *node.comparators]
    if not any(reads_key(side, key) for side in sides):
        return []
    return [t for side in sides for t in texts(side)]


def found_in_code(finder: Finder) -> list[str]:
    """``path:line: 'text'`` for each place ``finder`` reports in ``SOURCES``."""
    return [
        f"{path.relative_to(REPO)}:{line}: {text!r}"
        for path in SOURCES
        for line, text in finder(ast.parse(path.read_text()))
    ]
