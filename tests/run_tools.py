"""Slow tools of every effect class, for ``agentd run``'s tests (``modules =
["tests.run_tools"]``, with the repository on ``PYTHONPATH``).

Each sleeps ``seconds`` (so a signal can land while it runs), then appends one line to
the workspace's ``ledger``: ``TOOL TAG``. For the ``unsafe`` and ``keyed`` ones the line
is the effect that must happen exactly once; the keyed one does nothing for a key it
has seen (the service deduplicates).
"""

from __future__ import annotations

import os
import time

from worker.tools.registry import Effect, ToolContext, tool


def _append(ctx: ToolContext, line: str) -> None:
    fd = os.open(ctx.workspace / "ledger", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{line}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@tool(effect=Effect.READ_ONLY)
def slow_read(ctx: ToolContext, seconds: float, tag: str) -> str:
    """Look something up, slowly."""
    time.sleep(seconds)
    _append(ctx, f"slow_read {tag}")
    return f"read {tag}"


@tool(effect=Effect.IDEMPOTENT)
def slow_set(ctx: ToolContext, seconds: float, tag: str) -> str:
    """Set a value, slowly."""
    time.sleep(seconds)
    _append(ctx, f"slow_set {tag}")
    return f"set {tag}"


@tool(effect=Effect.KEYED)
def slow_send(ctx: ToolContext, seconds: float, tag: str) -> str:
    """Send a message through a service that deduplicates by the call's key, slowly."""
    time.sleep(seconds)
    seen = ctx.workspace / f"key-{ctx.idempotency_key}"
    if seen.exists():
        return f"sent {tag} (duplicate suppressed)"
    _append(ctx, f"slow_send {tag}")
    seen.touch()
    return f"sent {tag}"


@tool(effect=Effect.UNSAFE)
def slow_charge(ctx: ToolContext, seconds: float, tag: str) -> str:
    """Charge a card, slowly."""
    time.sleep(seconds)
    _append(ctx, f"slow_charge {tag}")
    return f"charged {tag}"
