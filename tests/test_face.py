"""The public face (``agentd``): the names users import, the same objects as agentd's own,
re-exported without logic, and never imported by agentd's own modules."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from tests.test_structure import REPO, import_graph

FACE = REPO / "agentd"

#: Each name of the face and where it lives.
NAMES = {
    "agentd.tools": ("worker.tools.tool", ["tool", "ToolContext", "ToolError", "Tool"]),
    "agentd.testing": ("worker.testing.messages_api", ["MessagesAPIServer", "Reply", "Fault"]),
}


def test_the_face_gives_agentds_own_objects() -> None:
    for face, (home, names) in NAMES.items():
        there, here = importlib.import_module(home), importlib.import_module(face)
        for name in names:
            assert getattr(here, name) is getattr(there, name), f"{face}.{name}"
    from agentd.tools import Effect
    from worker.tools.registry import Effect as OldEffect
    from worker.tools.registry import tool as old_tool

    assert Effect is OldEffect and importlib.import_module("agentd.tools").tool is old_tool


def test_the_face_holds_no_logic() -> None:
    """Only imports, ``__all__``, a docstring and the version lookup: no def, no class."""
    for path in sorted(FACE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        defined = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        assert defined == [], f"{path.relative_to(REPO)} defines {[n.name for n in defined]}"


def test_agentds_own_modules_never_import_the_face() -> None:
    graph = import_graph()
    for module in graph:
        source = (REPO / Path(*module.split("."))).with_suffix(".py")
        if not source.exists():
            source = REPO / Path(*module.split(".")) / "__init__.py"
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("agentd"), f"{module} imports the face"
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("agentd") for a in node.names), module


def test_a_tool_module_written_on_the_face_runs_in_a_task(tmp_path: Path) -> None:
    """The README's example, as a user writes it, loads into a task's registry."""
    module = tmp_path / "billing.py"
    module.write_text(
        "from agentd.tools import Effect, ToolContext, tool\n\n"
        "@tool(effect=Effect.KEYED)\n"
        "def charge(ctx: ToolContext, customer: str, cents: int) -> str:\n"
        '    """Charge a customer."""\n'
        '    return f"charged {cents} to {customer} (key {ctx.idempotency_key})"\n'
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import billing\n"
        "t = billing.charge\n"
        "print(t.name, t.effect.value, sorted(t.input_schema['properties']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert out.split() == ["charge", "keyed", "['cents',", "'customer']"]


def test_the_testing_face_imports_without_pytest() -> None:
    """``agentd.testing`` (not its conformance suites) needs nothing beyond agentd."""
    code = (
        "import sys\n"
        "class NoPytest:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pytest' or name.startswith('_pytest'):\n"
        "            raise ImportError('no pytest here')\n"
        "sys.meta_path.insert(0, NoPytest())\n"
        "import agentd.testing\n"
        "print(agentd.testing.MessagesAPIServer.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert out.strip() == "MessagesAPIServer"
