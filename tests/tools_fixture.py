"""A user tool module, as a config's ``[tools] modules`` would name it (``tests.tools_fixture``)."""

from __future__ import annotations

import os
import sys

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


@tool(effect=Effect.IDEMPOTENT)
def chatter(ctx: ToolContext, megabytes: int) -> str:
    """Write ``megabytes`` MiB to the worker's stdout and as many to its stderr, through
    Python's streams and straight to the descriptors (a tool that prints too much)."""
    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 512):
        sys.stdout.write(line)
        os.write(2, line.encode())
    sys.stdout.flush()
    return f"wrote {2 * megabytes} MiB"
