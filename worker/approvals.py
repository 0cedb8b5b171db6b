"""Approvals (docs/guides/tools.md): which calls wait for an operator before they run
at all (``AskPolicy``), and whether a decision is still good (``expired``).

A call that the policy names is not run when the model asks for it: its intent is
recorded with ``"asked": true`` and it is held like a dangling call
(``worker.dangling``), with stage ``before``; an operator's decision runs it (for the first
time), refuses it or supplies its result. The decision names the call's attempt, and its
file is read for that attempt alone, so a decision is used once: a call run on one and
cut off is a new attempt, held again whatever its effect class says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from worker.mcp.naming import matches
from worker.tools.tool import Tool

#: How the reason of a task held for a call that waits for approval begins:
#: ``approval: TOOL``.
APPROVAL_REASON = "approval: "


@dataclass(frozen=True)
class AskPolicy:
    """The tools whose calls wait for approval: ``patterns`` (names and globs, as
    ``--tools`` takes them) and the effect classes ``effects``."""

    patterns: tuple[str, ...] = ()
    effects: frozenset[str] = frozenset()

    @classmethod
    def of(cls, patterns: Iterable[str], effects: Iterable[str]) -> AskPolicy:
        return cls(tuple(dict.fromkeys(patterns)), frozenset(effects))

    def asks(self, tool: Tool) -> bool:
        if tool.effect.value in self.effects:
            return True
        remote = tool.name.startswith("mcp__")
        return any(matches(pattern, tool.name, mcp=remote) for pattern in self.patterns)


#: No call waits for approval (the default of a task without ``ask``).
ASK_NOTHING = AskPolicy()


def expired(decided_at: object, now: float, expire_after: float | None) -> bool:
    """Whether a decision made at ``decided_at`` (an ISO 8601 UTC stamp) is void at
    ``now`` (seconds since the epoch) under ``[approvals] expire_after`` (None: never).
    One whose time cannot be read never expires: its file says nothing of its age."""
    if expire_after is None or not isinstance(decided_at, str):
        return False
    try:
        made = datetime.fromisoformat(decided_at).timestamp()
    except ValueError:
        return False
    return now - made > expire_after
