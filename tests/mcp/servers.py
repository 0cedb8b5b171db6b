"""Where the tests' MCP servers are, and configs that name them.

``mcp-server-git`` and ``mcp-server-time`` come from PyPI (the dev extra pins them), the
filesystem and everything servers from npm (``make mcp-servers``: ``npm ci`` of
``tests/mcp/package-lock.json``); ``fault_server.py`` is ours.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tomli_w

from tests.support import missing_system_tool
from worker.config import Config, load_config

HERE = Path(__file__).resolve().parent
FAULT_SERVER = HERE / "fault_server.py"
VENV_BIN = Path(sys.executable).parent
NODE_BIN = HERE / "node_modules" / ".bin"


def fault_server(*flags: str) -> list[str]:
    return [sys.executable, str(FAULT_SERVER), *flags]


def git_server(repository: str = ".") -> list[str]:
    return [str(VENV_BIN / "mcp-server-git"), "--repository", repository]


def time_server() -> list[str]:
    return [str(VENV_BIN / "mcp-server-time"), "--local-timezone", "UTC"]


def npm_server(name: str, *args: str) -> list[str]:
    """``@modelcontextprotocol/server-NAME`` as ``npm ci`` installed it."""
    binary = NODE_BIN / f"mcp-server-{name}"
    if not binary.exists():
        missing_system_tool(f"{binary} is missing: run `make mcp-servers` (npm ci in tests/mcp)")
    return [str(binary), *args]


def write_config(path: Path, servers: dict[str, dict[str, Any]], **tables: Any) -> Path:
    """A config file with ``[mcp.servers.NAME]`` for each of ``servers`` and the other
    top-level tables given (``tools={...}``, ``restart={...}``)."""
    document: dict[str, Any] = {**tables, "mcp": {"servers": servers}}
    path.write_text(tomli_w.dumps(document))
    return path


def mcp_config(tmp_path: Path, servers: dict[str, dict[str, Any]], **tables: Any) -> Config:
    return load_config(write_config(tmp_path / "agentd.toml", servers, **tables))
