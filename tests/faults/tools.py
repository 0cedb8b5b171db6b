"""A user tool module for the fault campaign (``[tools] modules = ["tests.faults.tools"]``,
with the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import ctypes
import os
import signal

from worker.tools.registry import Effect, ToolContext, tool


@tool(effect=Effect.UNSAFE)
def die_once(ctx: ToolContext, marker: str) -> str:
    """SIGKILL this worker the first time (leaving ``marker`` in the workspace), so the call
    dangles and the task holds; on a re-run the marker is there and the call returns."""
    path = ctx.workspace / marker
    if path.exists():
        return f"{marker} exists: survived"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"  # pragma: no cover


@tool(effect=Effect.READ_ONLY)
def dumpable(ctx: ToolContext) -> str:
    """This worker's ``PR_GET_DUMPABLE``: "0" when its ``/proc/PID/environ`` and memory are
    closed to other processes of its user (its tools among them)."""
    return str(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))
