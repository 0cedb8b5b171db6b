"""Declaring a tool for ``[tools] modules`` (docs/guides/tools.md)::

    from agentd.tools import Effect, ToolContext, tool

    @tool(effect=Effect.KEYED)
    def charge(ctx: ToolContext, customer: str, cents: int) -> str:
        "Charge a customer."
        ...

The input schema comes from the type hints; the effect class says what a call whose
outcome is unknown may do on resume (docs/design.md section 5).
"""

from __future__ import annotations

from worker.tools.effect import Effect
from worker.tools.tool import (
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
    "ToolResult",
    "tool",
]
