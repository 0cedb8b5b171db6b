"""A user tool module, as a config's ``[tools] modules`` would name it (``tests.tools_fixture``)."""

from __future__ import annotations

from worker.tools.registry import Effect, ToolContext, ToolError, tool

NOT_A_TOOL = "module globals that are not tools are left alone"


@tool(effect=Effect.IDEMPOTENT)
def shout(ctx: ToolContext, text: str, times: int = 1) -> str:
    """Repeat a text in capitals."""
    return " ".join([text.upper()] * times)


@tool(effect=Effect.UNSAFE)
def explode(ctx: ToolContext, message: str = "boom") -> str:
    """Fail with an unexpected exception (a bug in a user tool)."""
    raise RuntimeError(message)


@tool("fixture_refuse", effect=Effect.READ_ONLY)
def refuse(ctx: ToolContext, why: str) -> str:
    """Fail the way a tool reports an expected error."""
    raise ToolError(f"refused: {why}")
