"""The tools one task may use: ``ToolRegistry``, made of the built-in tools
(``worker.tools.builtin``) and the ``Tool`` objects of the user modules that
``[tools] modules`` names.

Tools are declared with ``worker.tools.tool`` (``@tool``, ``Effect``, ``ToolContext``);
those names are re-exported here, the import path the docs give to users who write
tools.
"""

from __future__ import annotations

import importlib
import importlib.util
import typing
from collections.abc import Iterable
from pathlib import Path

from worker.errors import ConfigError, TaskSpecError
from worker.tools import builtin
from worker.tools.tool import (
    Effect,
    OutcomeUnknown,
    Reconcile,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    tool,
)

__all__ = [
    "Effect",
    "OutcomeUnknown",
    "Reconcile",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "find_tool_modules",
    "tool",
]


class ToolRegistry:
    """The tools one task may use, by name."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, t: Tool) -> None:
        self._tools[t.name] = t

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def __iter__(self) -> typing.Iterator[Tool]:
        return iter(self._tools.values())

    def narrowed(self, names: Iterable[str] | None) -> ToolRegistry:
        if names is None:
            return self
        names = list(names)
        unknown = [n for n in names if n not in self._tools]
        if unknown:
            raise TaskSpecError(
                f"unknown tool(s) {', '.join(unknown)}; available: {', '.join(self.names())}."
            )
        return ToolRegistry(self._tools[n] for n in names)

    @classmethod
    def standard(cls, modules: Iterable[str] = (), *, source: Path | None = None) -> ToolRegistry:
        """The built-in tools plus every ``Tool`` defined in the user modules; ``source``
        is the config file that lists them, named in the error when one fails."""
        registry = cls(builtin.BUILTIN_TOOLS)
        for i, module_name in enumerate(modules):
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise _module_error(
                    source, i, module_name, f"{type(exc).__name__}: {exc}"
                ) from None
            for value in vars(module).values():
                if isinstance(value, Tool):
                    registry.add(value)
        return registry


def find_tool_modules(modules: Iterable[str], *, source: Path | None = None) -> None:
    """Fail as ``standard`` would when a module of ``[tools] modules`` cannot be found,
    without running it: ``agentd start`` checks its config this way, so a misspelt
    module is exit 78 at start rather than a failed task at the first submit, while the
    user's code runs only in workers (and in ``agentd config check``, which imports)."""
    for i, module_name in enumerate(modules):
        try:
            found = importlib.util.find_spec(module_name) is not None
        except Exception as exc:  # a parent package that fails to import, say
            raise _module_error(source, i, module_name, f"{type(exc).__name__}: {exc}") from None
        if not found:
            raise _module_error(source, i, module_name, "no such module")


def _module_error(source: Path | None, index: int, name: str, why: str) -> ConfigError:
    where = f"{source}: " if source is not None else ""
    return ConfigError(
        f"{where}tools.modules[{index}]: cannot import {name!r} ({why}); check the module "
        "name and that it is installed in agentd's environment or on PYTHONPATH."
    )
