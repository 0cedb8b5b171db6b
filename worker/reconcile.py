"""What to do with a dangling call on resume: a pure function of its inputs.

The rules of docs/design.md section 5, in order of precedence:

1. an operator decision for this attempt of the call (re-run, skip, or a supplied result);
   a call that waits for approval before it runs (``asked``: docs/guides/tools.md)
   holds without one, whatever its effect class: it never ran, and it runs only on a
   decision;
2. the tool's reconcile check, where it answers (the caller runs it: it is I/O);
3. a ``[tools.policy]`` override (``rerun`` or ``hold``);
4. the effect class: ``read_only``, ``idempotent`` and ``keyed`` re-run (``keyed`` with
   the same idempotency key, which the ledger keeps), ``unsafe`` holds.

A call whose tool is no longer known (a user module was removed) holds: nobody can tell
whether re-running it is safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from worker.state import Call
from worker.tools.effect import Effect
from worker.tools.tool import Tool


class Action(StrEnum):
    RERUN = "rerun"
    SKIP = "skip"
    SUPPLIED = "result"
    HOLD = "hold"


#: Why a call that waits for approval before it runs is held.
ASKED_WHY = "waits for approval before it runs"


@dataclass(frozen=True)
class Plan:
    action: Action
    try_reconcile: bool  # ask the tool's reconcile check first
    why: str


def plan(call: Call, tool: Tool | None, policy: Mapping[str, str]) -> Plan:
    if call.decision is not None:
        action = Action(call.decision["action"])
        return Plan(action, False, f"operator decided {action.value}")
    if call.asked:
        return Plan(Action.HOLD, False, ASKED_WHY)
    if tool is None:
        return Plan(Action.HOLD, False, f"tool {call.tool!r} is no longer available")
    can_reconcile = tool.reconcile is not None
    override = policy.get(call.tool)
    if override == "rerun":
        return Plan(Action.RERUN, can_reconcile, "tools.policy says rerun")
    if override == "hold":
        return Plan(Action.HOLD, can_reconcile, "tools.policy says hold")
    effect = Effect(call.effect or tool.effect)
    if effect.rerun_safe:
        return Plan(Action.RERUN, can_reconcile, f"{effect.value} tools are safe to re-run")
    return Plan(Action.HOLD, can_reconcile, "unsafe: its outcome is unknown")
