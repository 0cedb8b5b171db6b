"""The names of MCP tools, and the names and globs that offer tools to a task.

The model sees an MCP server's tool as ``mcp__NAME__TOOL`` (``NAME`` the server's name in
``[mcp.servers]``). The Messages API takes tool names of ``^[a-zA-Z0-9_-]{1,64}$`` only, so a
name that is not one becomes ``mcp__NAME__`` + the longest prefix of the tool's own name
that is valid and fits + ``_`` + the first 6 hex digits of the SHA-256 of the tool's own
name (docs/design.md section 11): stable, distinct for distinct names in practice, and still
readable. The mapping is recorded with the task's tool list (``worker.mcp.catalog``).

``--tools`` and ``[tools] default`` name tools by name or by glob (``*``, ``?``, ``[...]``).
An MCP tool is offered only where a pattern names it: a pattern reaches MCP tools only when
it begins with ``mcp__``, so ``*`` is every built-in and module tool and no server's, while
``mcp__git__*`` is every tool of the server ``git`` and ``mcp__*`` every server's.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

#: What the model sees before a server's name.
PREFIX = "mcp__"
#: Between the server's name and the tool's.
SEPARATOR = "__"
#: A server's name in ``[mcp.servers.NAME]``.
SERVER_NAME = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)*")
SERVER_NAME_MAX = 32
#: The Messages API's rule for a tool's name.
API_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
API_TOOL_NAME_MAX = 64
#: What a name or glob of ``--tools`` and ``[tools] default`` may hold.
TOOL_PATTERN = re.compile(r"[a-zA-Z0-9_*?\[\]!-]{1,128}")
_VALID = re.compile(r"[a-zA-Z0-9_-]*")
_HASH_DIGITS = 6


def is_server_name(name: str) -> bool:
    return len(name) <= SERVER_NAME_MAX and SERVER_NAME.fullmatch(name) is not None


def model_name(server: str, tool: str) -> str:
    """The name the model sees for ``server``'s tool ``tool``."""
    name = f"{PREFIX}{server}{SEPARATOR}{tool}"
    if API_TOOL_NAME.fullmatch(name):
        return name
    import hashlib  # noqa: PLC0415  (only a name past the API's limit needs it; OpenSSL loads slowly)

    head = f"{PREFIX}{server}{SEPARATOR}"
    tail = "_" + hashlib.sha256(tool.encode()).hexdigest()[:_HASH_DIGITS]
    valid = _VALID.match(tool)
    prefix = valid.group() if valid else ""
    return head + prefix[: API_TOOL_NAME_MAX - len(head) - len(tail)] + tail


def plain_name(server: str, tool: str) -> str:
    """``mcp__NAME__TOOL`` as written, valid or not: what a glob may also match."""
    return f"{PREFIX}{server}{SEPARATOR}{tool}"


def is_mcp_pattern(pattern: str) -> bool:
    return pattern.startswith(PREFIX)


def is_pattern(text: str) -> bool:
    """Whether ``text`` is a glob rather than one tool's name."""
    return any(c in text for c in "*?[")


def matches(pattern: str, name: str, *, mcp: bool) -> bool:
    """Whether ``pattern`` offers the tool ``name`` (an MCP tool's model name or its plain
    name when ``mcp``). An MCP tool is matched only by a pattern that begins with ``mcp__``;
    a built-in or module tool by any pattern."""
    if mcp and not is_mcp_pattern(pattern):
        return False
    return fnmatch.fnmatchcase(name, pattern)


def servers_reached(patterns: Iterable[str], servers: Iterable[str]) -> list[str]:
    """The servers (of ``servers``, in their order) whose tools one of ``patterns`` may
    name: those a task's first start must list. A pattern reaches a server when the part of
    it before its first wildcard and ``mcp__NAME__`` agree as far as both go."""
    heads = [_literal_head(p) for p in patterns if is_mcp_pattern(p)]
    reached = []
    for server in servers:
        own = f"{PREFIX}{server}{SEPARATOR}"
        if any(own.startswith(head) or head.startswith(own) for head in heads):
            reached.append(server)
    return reached


def _literal_head(pattern: str) -> str:
    cut = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    return pattern[:cut]


def server_of(name: str) -> str | None:
    """The server a model name ``mcp__NAME__...`` is of (None for another name)."""
    if not name.startswith(PREFIX):
        return None
    server, separator, _ = name[len(PREFIX) :].partition(SEPARATOR)
    return server if separator and is_server_name(server) else None
