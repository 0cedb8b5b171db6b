"""The tools a task is offered, as its journal records them, and where each effect class
comes from. Pure: no SDK, no I/O.

At a task's first start the worker lists the tools of every server a pattern of its
``--tools`` (or ``[tools] default``) may name, and records one ``tools`` record::

    {"k": "tools", "local": ["read_file", ...],
     "mcp": [{"name": "mcp__git__git_status", "server": "git", "tool": "git_status",
              "description": "...", "input_schema": {...}, "effect": "read_only",
              "effect_from": "annotation"}, ...],
     "listed": {"git": ["git_status", "git_log", ...]}}

``local`` names the built-in and module tools offered; ``mcp`` each MCP tool offered, with
the name the model sees (``worker.mcp.naming.model_name``), its server's own name for it,
its schema and its effect class; ``listed`` every tool each server listed then, offered
or not. Resume, rewind and fork offer exactly that list
(``TaskState.tools``), so a task's tools never change under it: a server that lists other
tools later is reported (``mcp_tools_changed``), and a call of a tool it no longer has gets
an error result.

The effect class of an MCP tool (docs/design.md section 11): ``effects`` of its server
first; else, with ``trust = true``, ``readOnlyHint`` makes it ``read_only``, else
``idempotentHint`` ``idempotent``, else ``unsafe``; without trust (the MCP specification
calls annotations untrusted hints) ``unsafe``. ``EffectFrom`` says which rule decided, as
``agentd tools`` shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from worker.errors import TaskSpecError
from worker.mcp.naming import (
    TOOL_PATTERN,
    is_mcp_pattern,
    matches,
    model_name,
    plain_name,
    servers_reached,
)
from worker.mcp.settings import McpServer
from worker.records import RemoteTool, ToolList
from worker.tools.effect import Effect


class EffectFrom(StrEnum):
    """Where a tool's effect class came from (``effect_from`` of ``agentd tools``)."""

    DECLARED = "declared"  # the tool's own code (@tool(effect=...)): built-in and module tools
    ANNOTATION = "annotation"  # the server's annotations, under trust = true
    EFFECTS = "effects"  # [mcp.servers.NAME] effects
    POLICY = "policy"  # [tools.policy] decides its dangling calls
    DEFAULT = "default"  # nothing said more: unsafe


def effect_of(
    tool: str, annotations: Mapping[str, Any] | None, server: McpServer
) -> tuple[Effect, EffectFrom]:
    """The effect class of ``server``'s tool ``tool``, whose listing gave ``annotations``
    (the MCP ``annotations`` object, camelCase keys, or None)."""
    if tool in server.effects:
        return server.effects[tool], EffectFrom.EFFECTS
    if not server.trust or not annotations:
        return Effect.UNSAFE, EffectFrom.DEFAULT
    if annotations.get("readOnlyHint") is True:
        return Effect.READ_ONLY, EffectFrom.ANNOTATION
    if annotations.get("idempotentHint") is True:
        return Effect.IDEMPOTENT, EffectFrom.ANNOTATION
    return Effect.UNSAFE, EffectFrom.ANNOTATION


def with_policy(effect: Effect, effect_from: EffectFrom, policy: str | None) -> tuple[Effect, str]:
    """The class a tool behaves as on resume once ``[tools.policy]`` has its say: ``hold``
    is ``unsafe``, ``rerun`` keeps a class that re-runs (``idempotent`` for an unsafe one)."""
    if policy == "hold":
        return Effect.UNSAFE, EffectFrom.POLICY
    if policy == "rerun":
        return (effect if effect.rerun_safe else Effect.IDEMPOTENT), EffectFrom.POLICY
    return effect, effect_from


def remote_tools(
    server_name: str, server: McpServer, listing: Iterable[Mapping[str, Any]]
) -> list[RemoteTool]:
    """A server's ``tools/list`` answer (each tool as its JSON: ``name``, ``description``,
    ``inputSchema``, ``annotations``) as entries of a task's list, in the server's order. A
    second tool whose model name is taken is left out (it could not be told apart)."""
    found: dict[str, RemoteTool] = {}
    for entry in listing:
        tool = str(entry.get("name", ""))
        if not tool:
            continue
        name = model_name(server_name, tool)
        if name in found:
            continue
        annotations = entry.get("annotations")
        effect, effect_from = effect_of(
            tool, annotations if isinstance(annotations, Mapping) else None, server
        )
        found[name] = RemoteTool(
            name=name,
            server=server_name,
            tool=tool,
            description=str(entry.get("description") or entry.get("title") or tool),
            input_schema=_object_schema(entry.get("inputSchema")),
            effect=effect.value,
            effect_from=effect_from.value,
        )
    return list(found.values())


def _object_schema(schema: Any) -> dict[str, Any]:
    """An input schema as the Messages API takes it: a JSON object of type "object"."""
    if not isinstance(schema, dict):
        return {"type": "object", "properties": {}}
    return schema if schema.get("type") == "object" else {**schema, "type": "object"}


def offered(
    patterns: Sequence[str], local: Iterable[str], remote: Iterable[RemoteTool]
) -> ToolList:
    """The tools ``patterns`` (names and globs, ``worker.mcp.naming``) offer, of the local
    tools ``local`` (built-in and module tools, by name) and the MCP tools ``remote``, each
    list in its own order."""
    return ToolList(
        listed={},
        local=[name for name in local if any(matches(p, name, mcp=False) for p in patterns)],
        mcp=[
            tool
            for tool in remote
            if any(
                matches(p, tool["name"], mcp=True)
                or matches(p, plain_name(tool["server"], tool["tool"]), mcp=True)
                for p in patterns
            )
        ],
    )


def tool_list(record: Mapping[str, Any]) -> ToolList:
    """The ``ToolList`` a ``tools`` record holds; ValueError if it is not one's shape."""
    local = record.get("local")
    remote = record.get("mcp")
    if not isinstance(local, list) or not all(isinstance(n, str) for n in local):
        raise ValueError("a tools record's local is a list of names")
    if not isinstance(remote, list) or not all(_is_remote(t) for t in remote):
        raise ValueError("a tools record's mcp is a list of tools")
    listed = record.get("listed", {})
    if not isinstance(listed, dict) or not all(
        isinstance(names, list) and all(isinstance(n, str) for n in names)
        for names in listed.values()
    ):
        raise ValueError("a tools record's listed is a table of lists of names")
    return ToolList(local=list(local), mcp=list(remote), listed=dict(listed))


def _is_remote(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), str) for k in ("name", "server", "tool", "effect"))
        and isinstance(entry.get("input_schema"), dict)
        and entry["effect"] in {e.value for e in Effect}
    )


def check_patterns(patterns: Sequence[str], local: Sequence[str], servers: Sequence[str]) -> None:
    """Refuse (``TaskSpecError``) a pattern of ``--tools`` that is no name or glob, or that
    can name no tool: a pattern that matches none of the ``local`` tools, or one beginning
    ``mcp__`` that reaches none of the configured ``servers`` (whose tools are listed only
    at the task's first start)."""
    for pattern in patterns:
        if not TOOL_PATTERN.fullmatch(pattern):
            raise TaskSpecError(
                f"{pattern!r} is not a tool name or glob (letters, digits, _, -, *, ?, [...])."
            )
    unknown = [
        p
        for p in patterns
        if not (
            servers_reached([p], servers)
            if is_mcp_pattern(p)
            else any(matches(p, name, mcp=False) for name in local)
        )
    ]
    if unknown:
        mcp = (
            f"; MCP servers: {', '.join(servers)} (their tools: mcp__NAME__TOOL, or a glob "
            f"such as mcp__{servers[0]}__*)"
            if servers
            else ""
        )
        raise TaskSpecError(
            f"unknown tool(s) {', '.join(unknown)}; available: {', '.join(local)}{mcp}."
        )
