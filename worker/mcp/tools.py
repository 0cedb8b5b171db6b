"""MCP tools as tools of a task: ``McpTool``, and the offer of a task's tools.

An ``McpTool`` is a ``Tool`` like any other for the loop, the dangling-call rules and the
operator: its effect class is the one recorded in the task's tool list, it has no
reconcile check, and ``[tools.policy]`` applies to it by its model name. Running it is a
call of its server through ``worker.mcp.servers.ToolServers``; the result comes back as a
``ToolResult`` (``worker.mcp.results``).

``offer`` decides a task's tools at its first start: the built-in and module tools its
patterns name, and the tools of each server a pattern may reach, which it lists (starting
the server). ``registry`` makes the tools of a recorded list, the same on every later
start, rewind and fork.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.mcp import catalog
from worker.mcp.naming import servers_reached
from worker.mcp.servers import ToolServers
from worker.records import RemoteTool, ToolList
from worker.tools.effect import Effect
from worker.tools.registry import ToolRegistry
from worker.tools.tool import Tool, ToolContext, ToolError, ToolResult


def _never_called(ctx: ToolContext, **data: Any) -> str:
    raise AssertionError("an MCP tool runs through McpTool.run")


@dataclass(frozen=True)
class McpTool(Tool):
    """Server ``server``'s tool ``remote``, as the model sees it (``name``)."""

    server: str = ""
    remote: str = ""
    servers: ToolServers | None = field(default=None, compare=False, repr=False)

    def check_input(self, data: Any) -> dict[str, Any]:
        """An object; the rest of the schema is the server's to check."""
        if not isinstance(data, dict):
            raise ToolError(f"{self.name}: input must be a JSON object")
        return data

    def run(self, ctx: ToolContext, data: dict[str, Any]) -> str:
        """The result's text (its blocks' text, an error's message), for callers that
        want text; the loop records ``result``."""
        output = self.result(ctx, data)
        if isinstance(output.content, str):
            return output.content
        return "\n".join(str(b.get("text", "")) for b in output.content if b.get("type") == "text")

    def result(self, ctx: ToolContext, data: dict[str, Any]) -> ToolResult:
        from worker.mcp.results import tool_result  # noqa: PLC0415  (a worker that calls a server only)

        servers = self.servers
        if servers is None or self.server not in servers.names:
            raise ToolError(
                f"mcp: {self.server}: no such server in [mcp.servers] any more; "
                "the call was not made"
            )
        timeout = servers.settings(self.server).timeout or ctx.timeout
        result = servers.call(
            self.server, self.remote, data, ctx.idempotency_key, timeout, budget=ctx.timeout
        )
        return tool_result(result.model_dump(by_alias=True, mode="json", exclude_none=True))


def offer(patterns: Sequence[str], local: ToolRegistry, servers: ToolServers | None) -> ToolList:
    """The tools ``patterns`` offer a task at its first start: the local tools they name,
    and the tools of every server they may reach, each of which is listed now
    (``ServerFailed`` when one cannot be: the task must not start without its list)."""
    remote: list[RemoteTool] = []
    listed: dict[str, list[str]] = {}
    if servers is not None:
        for name in servers_reached(patterns, servers.names):
            listing = servers.listing(name)
            listed[name] = [str(t.get("name")) for t in listing]
            remote += catalog.remote_tools(name, servers.settings(name), listing)
    chosen = catalog.offered(patterns, local.names(), remote)
    return ToolList(local=chosen["local"], mcp=chosen["mcp"], listed=listed)


def registry(tools: ToolList, local: ToolRegistry, servers: ToolServers | None) -> ToolRegistry:
    """The tools of a recorded list: its local tools still available (one that is gone is
    unknown to the loop, as any removed tool is), and its MCP tools, calling ``servers``."""
    offered: list[Tool] = [t for name in tools["local"] if (t := local.get(name)) is not None]
    for entry in tools["mcp"]:
        offered.append(
            McpTool(
                name=entry["name"],
                description=entry["description"],
                effect=Effect(entry["effect"]),
                input_schema=entry["input_schema"],
                func=_never_called,
                server=entry["server"],
                remote=entry["tool"],
                servers=servers,
            )
        )
    if servers is not None:
        for name, listed in tools["listed"].items():
            if name in servers.names:
                servers.expect(name, set(listed))
    return ToolRegistry(offered)
