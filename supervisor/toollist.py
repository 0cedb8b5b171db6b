"""``agentd tools [TASK]`` and the servers' part of ``agentd config check``
(docs/design.md section 11).

A row a tool::

    {"name": "mcp__git__git_status", "source": "mcp", "server": "git", "tool": "git_status",
     "effect": "read_only", "effect_from": "annotation"}

``source`` is ``builtin``, ``module`` (``[tools] modules``) or ``mcp``; ``effect`` the class
a dangling call of it is settled by, ``effect_from`` where that came from: ``declared``
(the tool's own code), ``annotation``, ``effects`` or ``default`` (an MCP tool's,
``worker.mcp.catalog``), or ``policy`` when ``[tools.policy]`` names the tool.

Without TASK, every tool a task could be given: the built-in and module tools, and every
configured server's, each server started once (in a workspace of its own: the current
folder, or an empty temporary one where that is the root or the spool) and listed. With
TASK, the list recorded for that task; a task that has not started on a config with
servers, or whose config has none, shows the local tools its patterns name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from worker.config import Config
from worker.errors import ConfigError
from worker.mcp import catalog
from worker.mcp.catalog import EffectFrom
from worker.mcp.servers import Placement, ServerFailed, ToolServers
from worker.records import RemoteTool
from worker.spool import Spool, TaskDir
from worker.tool_calls import tool_environment, tool_secret_files
from worker.tools.builtin import BUILTIN_TOOLS
from worker.tools.effect import Effect
from worker.tools.registry import ToolRegistry
from worker.tools.sandbox import mode_for, sandbox_for

#: The FROM of a server's row in ``table`` when it could not start or list here.
NOT_STARTED = "could not start here"


class ToolRow(TypedDict):
    name: str
    source: str
    server: str | None
    tool: str
    effect: str
    effect_from: str


def local_rows(
    registry: ToolRegistry, names: list[str], policy: Mapping[str, str]
) -> list[ToolRow]:
    builtin = {t.name for t in BUILTIN_TOOLS}
    rows = []
    for name in names:
        found = registry.get(name)
        if found is None:
            continue
        effect, effect_from = catalog.with_policy(
            found.effect, EffectFrom.DECLARED, policy.get(name)
        )
        rows.append(
            ToolRow(
                name=name,
                source="builtin" if name in builtin else "module",
                server=None,
                tool=name,
                effect=effect.value,
                effect_from=str(effect_from),
            )
        )
    return rows


def remote_rows(tools: list[RemoteTool], policy: Mapping[str, str]) -> list[ToolRow]:
    rows = []
    for entry in tools:
        effect, effect_from = catalog.with_policy(
            Effect(entry["effect"]), EffectFrom(entry["effect_from"]), policy.get(entry["name"])
        )
        rows.append(
            ToolRow(
                name=entry["name"],
                source="mcp",
                server=entry["server"],
                tool=entry["tool"],
                effect=effect.value,
                effect_from=str(effect_from),
            )
        )
    return rows


def every_tool(config: Config, spool: Spool) -> tuple[list[ToolRow], dict[str, str]]:
    """Every tool a task could be offered: each server started once and listed; and the
    servers that could not be, each with why (``Listed.failed``)."""
    registry = ToolRegistry.standard(config.tools.modules, source=config.source)
    rows = local_rows(registry, registry.names(), config.tools.policy)
    listed = list_servers(config, spool)
    for name, listing in listed.listings.items():
        tools = catalog.remote_tools(name, config.mcp.servers[name], listing)
        rows += remote_rows(tools, config.tools.policy)
    return rows, listed.failed


def task_tools(task: TaskDir, config: Config) -> list[ToolRow]:
    """The tools recorded for ``task`` (the local ones its patterns name, when it has no
    list recorded)."""
    from supervisor.status import load_state  # noqa: PLC0415  (a replay: only this command)
    from supervisor.stores import store_of  # noqa: PLC0415  (the same)

    spec = store_of(task).load_spec(task.id)
    registry = ToolRegistry.standard(config.tools.modules, source=config.source)
    recorded = load_state(task, full=False, spec=spec).tools
    if recorded is None:
        patterns = spec.tools if spec.tools is not None else config.tools.default
        chosen = catalog.offered(patterns, registry.names(), [])
        return local_rows(registry, chosen["local"], config.tools.policy)
    tools = catalog.tool_list(recorded)
    return local_rows(registry, tools["local"], config.tools.policy) + remote_rows(
        tools["mcp"], config.tools.policy
    )


@dataclass(frozen=True)
class Listed:
    """What ``list_servers`` found: the listings by server, and the servers that could not
    start or list here, each with a line that says why and where it was started."""

    listings: dict[str, list[dict[str, object]]]
    failed: dict[str, str]


def list_servers(config: Config, spool: Spool) -> Listed:
    """Start each configured server once, list its tools, stop it. A server that cannot
    start or list here is told in ``failed`` (it may start in a task's workspace: the
    README's ``mcp-server-git --repository .`` does only in a repository), the others
    listed all the same; ``ConfigError`` (one line, the server named) when a server's
    ``effects`` names a tool it does not list."""
    listings: dict[str, list[dict[str, object]]] = {}
    failed: dict[str, str] = {}
    if not config.mcp.servers:
        return Listed(listings, failed)
    source = config.source or "built-in defaults"
    with _workspace(spool) as workspace:
        sandbox = sandbox_for(
            mode_for(config.tools.sandbox, store=config.store is not None),
            config.tools.network,
            spool=spool.root,
            config=config.source,
            secret_files=tool_secret_files(os.environ),
        )
        env = tool_environment(os.environ, "agentd-tools", str(workspace))
        servers = ToolServers(
            config.mcp.servers,
            Placement(workspace, env, sandbox, config.restart.stop_grace, echo=False),
        )
        try:
            for name, settings in config.mcp.servers.items():
                try:
                    listing = servers.listing(name)
                except ServerFailed as exc:
                    failed[name] = (
                        f"{source}: mcp.servers.{name}: {exc.why}; its tools are not listed. "
                        f"Check its command (or url), which starts in {workspace} here (a "
                        "task's: its workspace)."
                    )
                    continue
                listed = {str(t.get("name")) for t in listing}
                for tool in settings.effects:
                    if tool not in listed:
                        raise ConfigError(
                            f"{source}: mcp.servers.{name}.effects names {tool!r}, which the "
                            f"server does not list; it lists {', '.join(sorted(listed))}."
                        )
                listings[name] = listing
        finally:
            servers.close()
    return Listed(listings, failed)


@contextlib.contextmanager
def _workspace(spool: Spool) -> Iterator[Path]:
    """Where servers are started to be listed: the current folder, as an operator who runs
    ``agentd tools`` in a repository expects (``mcp-server-git --repository .``), unless it
    is the root or the spool, never handed to a server: an empty temporary folder then."""
    here = Path.cwd().resolve()
    spool_root = spool.root.resolve()
    if here != Path("/") and not here.is_relative_to(spool_root):
        yield here
        return
    with tempfile.TemporaryDirectory(prefix="agentd-tools-") as folder:
        yield Path(folder)


def table(rows: list[ToolRow], failed: Mapping[str, str] | None = None) -> str:
    """``rows`` for a terminal, and a row for each server in ``failed``: its tools, not
    listed, marked as such."""
    head = ("NAME", "SOURCE", "SERVER", "TOOL", "EFFECT", "FROM")
    lines = [
        (r["name"], r["source"], r["server"] or "-", r["tool"], r["effect"], r["effect_from"])
        for r in rows
    ]
    lines += [(f"mcp__{name}__*", "mcp", name, "-", "-", NOT_STARTED) for name in failed or {}]
    widths = [max(len(str(line[i])) for line in [head, *lines]) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [head, *lines]
    )
