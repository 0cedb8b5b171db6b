"""Declaring tools: the ``@tool`` decorator, the ``Tool`` it makes, effect classes.

A tool is a plain function whose first parameter is a ``ToolContext`` and whose other
parameters are its input; the JSON schema the model sees is built from their type hints::

    @tool(effect=Effect.IDEMPOTENT)
    def write_file(ctx: ToolContext, path: str, content: str) -> str:
        "Write a file in the workspace."

The effect class says what happens to a *dangling* call (started, never recorded as
finished) on resume (docs/design.md section 5). A tool may add a reconcile check,
``reconcile(ctx, input) -> str | None``: it returns the call's result when it can tell
that the call already took effect, and None when it cannot tell.

A tool returns its result's text; one with more to say (content blocks, an error flag: an
MCP server's result, ``worker.mcp.tools``) overrides ``Tool.result`` to return a
``ToolResult``. A tool that cannot tell whether its call took
effect (an MCP server that died mid-call, a call past its timeout) raises
``OutcomeUnknown``: the loop records no result, and the call is settled as a dangling one,
by the rules of docs/design.md section 5, as after a crash.

The tools of a task are gathered by ``worker.tools.registry`` (the built-in ones of
``worker.tools.builtin`` and the user modules of ``[tools] modules``); both import this
module, which imports neither.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from worker.tools.beneath import Root
from worker.tools.sandbox import Sandbox


class Effect(StrEnum):
    READ_ONLY = "read_only"
    IDEMPOTENT = "idempotent"
    KEYED = "keyed"
    UNSAFE = "unsafe"

    @property
    def rerun_safe(self) -> bool:
        return self is not Effect.UNSAFE


class ToolError(Exception):
    """Raised by a tool to give the model an error result with this message."""


class OutcomeUnknown(Exception):
    """Raised by a tool whose call may or may not have taken effect: the call is left
    dangling, for the dangling-call rules (re-run when safe, held when unsafe)."""


#: A tool_result's content: its text, or content blocks (text and image blocks).
Content = str | list[dict[str, Any]]


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns besides plain text: content blocks, and whether the tool itself
    reported an error (``is_error`` of the tool_result)."""

    content: Content
    is_error: bool = False


@dataclass(frozen=True)
class ToolContext:
    """What one call of a tool is given. ``env`` is the scrubbed environment a tool's
    processes get; ``sandbox`` how ``run_command`` contains them (``worker.tools.sandbox``);
    ``root`` the workspace as the worker opened it once (``worker.tools.beneath``), which
    the file tools resolve every path beneath."""

    workspace: Path
    task_id: str
    call_id: str
    idempotency_key: str
    timeout: float
    env: Mapping[str, str] = field(default_factory=dict)
    sandbox: Sandbox = field(default_factory=Sandbox)
    root: Root | None = None

    @functools.cached_property
    def workspace_root(self) -> Root:
        """``root``, or for a context made without one, the workspace opened on first use."""
        return self.root if self.root is not None else Root(self.workspace)


Reconcile = Callable[[ToolContext, dict[str, Any]], str | None]

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
}


def _schema_of(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _schema_of(args[0]) if len(args) == 1 else {}
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        items = _schema_of(item)
        return {"type": "array", "items": items} if items else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    effect: Effect
    input_schema: dict[str, Any]
    func: Callable[..., str]
    reconcile: Reconcile | None = None

    def api_definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }

    def check_input(self, data: Any) -> dict[str, Any]:
        """Validate ``data`` against the schema; raise ToolError saying what is wrong."""
        if not isinstance(data, dict):
            raise ToolError(f"{self.name}: input must be a JSON object")
        props: dict[str, Any] = self.input_schema["properties"]
        for key in self.input_schema.get("required", []):
            if key not in data:
                raise ToolError(f"{self.name}: missing required input {key!r}")
        for key, value in data.items():
            if key not in props:
                raise ToolError(f"{self.name}: unknown input {key!r}; allowed: {sorted(props)}")
            expected = props[key].get("type")
            if expected and not _matches(value, expected):
                raise ToolError(f"{self.name}: input {key!r} must be of type {expected}")
        return data

    def run(self, ctx: ToolContext, data: dict[str, Any]) -> str:
        return str(self.func(ctx, **data))

    def result(self, ctx: ToolContext, data: dict[str, Any]) -> str | ToolResult:
        """What the loop records of a call: ``run``'s text, unless the tool has more to
        say (content blocks, an error of its own: an MCP tool)."""
        return self.run(ctx, data)


def _matches(value: Any, expected: str) -> bool:
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list}
    return isinstance(value, kinds.get(expected, object))


def tool(
    name: str | None = None,
    *,
    effect: Effect,
    description: str | None = None,
    reconcile: Reconcile | None = None,
) -> Callable[[Callable[..., str]], Tool]:
    """Turn a function into a ``Tool``; see the module docstring."""

    def wrap(func: Callable[..., str]) -> Tool:
        hints = typing.get_type_hints(func)
        params = list(inspect.signature(func).parameters.values())[1:]
        properties: dict[str, Any] = {}
        required: list[str] = []
        for param in params:
            properties[param.name] = _schema_of(hints.get(param.name, Any))
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        if required:
            schema["required"] = required
        doc = description or inspect.getdoc(func) or func.__name__
        return Tool(name or func.__name__, doc, Effect(effect), schema, func, reconcile)

    return wrap
