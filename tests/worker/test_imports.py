"""What the worker's modules may import. Import circles among agentd's modules, the
worker's among them, are found by the one walk of ``tests/test_structure.py``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
