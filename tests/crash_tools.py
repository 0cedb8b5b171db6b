"""User tools for the supervisor's fault tests, loaded by workers through ``[tools] modules``
(``modules = ["tests.crash_tools"]``, with the repository on ``PYTHONPATH``).

Both are declared ``idempotent``, so a dangling call of them is re-run on resume: a
crash tool then crashes its worker again on the same turn, which is what a crash loop is.
Their ``unless``/``once`` files let a test end the fault.
"""

from __future__ import annotations

import os
import signal
import time

from worker.tools.registry import Effect, ToolContext, tool


@tool(effect=Effect.IDEMPOTENT)
def crash(ctx: ToolContext, unless: str = "") -> str:
    """Kill this worker with SIGKILL, unless the workspace holds the file ``unless``."""
    if unless and (ctx.workspace / unless).exists():
        return f"{unless} exists: not crashing"
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"  # pragma: no cover


@tool(effect=Effect.IDEMPOTENT)
def stall(ctx: ToolContext, seconds: float, once: str = "") -> str:
    """Block the worker in Python for ``seconds``, ignoring every deadline (a hung network
    call, say). With ``once``, only the first call blocks: it leaves that workspace file."""
    if once:
        marker = ctx.workspace / once
        if marker.exists():
            return f"{once} exists: not stalling"
        marker.touch()
    time.sleep(seconds)
    return f"slept {seconds} s"
