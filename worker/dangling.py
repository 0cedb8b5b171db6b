"""Dangling calls as the agent loop settles them: a call with an intent and no result.

A call that started and never finished (the worker was killed during it, or its MCP
server died, or it ran past its timeout) is never run again blindly: ``worker.reconcile``
plans what to do from the tool's effect class, the policy and an operator's decision
(``DanglingCalls.settle``), and this carries the plan out. The tool's ``reconcile`` is
asked first where it has one; then the call is re-run (safe), skipped or given the
operator's result (decided), or held for an operator (``hold`` record, exit ``HELD``).

A call that waits for approval before it runs (``asked``: docs/guides/tools.md) is
held the same way, with the event ``approval_requested`` and the task's reason
``approval: TOOL``; a decision runs it (for the first time), refuses it or gives its
result. Run on a decision and cut off, it is an ordinary dangling call.

An operator's decision is a file of the task's store (``read_decision``, one per call
attempt); it is recorded (a ``decision`` record) before it is acted on, and never read for
a task that was cancelled (a cancel is final: the call stays held). Once recorded it is
this attempt's alone: the re-run is a new attempt, which no decision file names yet, so
a decision is used once across any crash. One older than ``[approvals] expire_after``
when a worker first reads it is void: the call is held again as a new attempt (an
``intent`` record marked ``renewed``: no start), event ``approval_expired``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from worker.approvals import APPROVAL_REASON, expired
from worker.errors import InvalidIdError
from worker.events import Event
from worker.outcome import Outcome
from worker.protocol import ExitCode, decision_fields
from worker.reconcile import Action, plan
from worker.recorder import Recorder
from worker.records import CallOutcome, DecisionRecord, HeldCall, RecordKind
from worker.state import Call
from worker.store.base import Owner, Unreadable
from worker.tool_calls import ToolCalls


class DanglingCalls:
    """Settles the task's dangling calls through ``calls`` (the loop's ``ToolCalls``),
    recording on ``recorder``, under ``[tools] policy``."""

    def __init__(
        self,
        recorder: Recorder,
        calls: ToolCalls,
        policy: Mapping[str, str],
        *,
        expire_after: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.expire_after = expire_after
        self.clock = clock
        self.recorder = recorder
        self.store = recorder.store
        self.task_id = recorder.task_id
        self.calls = calls
        self.policy = policy

    def settle(self, call: Call, owner: Owner | None) -> Outcome | None:
        """Reconcile a call that started and never finished; an Outcome if the task holds.
        ``owner`` is the worker's ownership of the task (a claim names whose it was)."""
        recorder, calls = self.recorder, self.calls
        tool = calls.tools.get(call.tool)
        if call.decision is None:
            self._load_decision(call)
        step = plan(call, tool, self.policy)
        fields: dict[str, Any] = {
            "call_id": call.call_id,
            "tool": call.tool,
            "attempt": call.attempt,
        }
        if step.try_reconcile and tool is not None and tool.reconcile is not None:
            begun = time.time_ns()
            try:
                answer = tool.reconcile(
                    calls.context(call, calls.key_of(call)), dict(call.input or {})
                )
            except Exception as exc:
                answer = None
                recorder.event(Event.RECONCILE_FAILED, level="warning", error=str(exc), **fields)
            if answer is not None:
                recorder.record(
                    {
                        "k": RecordKind.RESULT,
                        "call_id": call.call_id,
                        "content": answer,
                        "is_error": False,
                        "outcome": CallOutcome.RECONCILED,
                    }
                )
                effect = tool.effect.value
                calls.span(call, begun, effect, CallOutcome.RECONCILED, None, answer, call.attempt)
                recorder.event(Event.DANGLING_RECONCILED, **fields)
                return None
        if step.action is Action.RERUN and call.asked:
            calls.run(call, attempt=call.attempt + 1)  # approved: it runs for the first time
        elif step.action is Action.RERUN:
            recorder.event(Event.DANGLING_RERUN, why=step.why, **fields)
            calls.run(call, attempt=call.attempt + 1, outcome=CallOutcome.RERUN)
        elif step.action is Action.SKIP:
            reason = (call.decision or {}).get("reason") or "no reason given"
            told = (
                f"not executed: this call was not approved ({reason})"
                if call.asked
                else f"not executed: an operator skipped this call after a crash ({reason}); "
                "it may or may not have taken effect before the crash"
            )
            calls.error_result(call, told, outcome=CallOutcome.SKIPPED)
        elif step.action is Action.SUPPLIED:
            recorder.record(
                {
                    "k": RecordKind.RESULT,
                    "call_id": call.call_id,
                    "content": str((call.decision or {}).get("result", "")),
                    "is_error": False,
                    "outcome": CallOutcome.OPERATOR,
                }
            )
        elif call.asked:
            asked: HeldCall = {
                "call_id": call.call_id,
                "attempt": call.attempt,
                "tool": call.tool,
                "why": step.why,
            }
            recorder.record({"k": RecordKind.HOLD, "calls": [asked]})
            recorder.event(Event.APPROVAL_REQUESTED, level="warning", **fields)
            return Outcome("held", f"{APPROVAL_REASON}{call.tool}", ExitCode.HELD)
        else:
            why = step.why
            taken = owner.previous if owner is not None else None
            if taken is not None:  # (a claim took the task from a node that stopped renewing)
                why = f"{why}; {taken.told()}"
            held: HeldCall = {
                "call_id": call.call_id,
                "attempt": call.attempt,
                "tool": call.tool,
                "why": why,
            }
            recorder.record({"k": RecordKind.HOLD, "calls": [held]})
            recorder.event(Event.DANGLING_HELD, level="warning", why=why, **fields)
            told = f"dangling {call.tool} call {call.call_id}: {why}"
            return Outcome("held", told, ExitCode.HELD)
        return None

    def _load_decision(self, call: Call) -> None:
        """Apply an operator's decision file for this attempt, if one was written (and
        the task was not cancelled: a cancel is final, so the call stays held)."""
        if call.key is None or self.store.cancel_requested(self.task_id):
            return
        try:
            data = self.store.read_decision(self.task_id, call.key, call.attempt)
        except InvalidIdError:
            return  # no decision can name this call: it stays held
        except Unreadable as exc:
            self.recorder.event(
                Event.DECISION_INVALID, level="error", file=exc.where, error=exc.reason
            )
            return
        if data is None:
            return
        if expired(data.get("decided_at"), self.clock(), self.expire_after):
            self._held_again(call, data.get("decided_at"))
            return
        try:
            decision = decision_fields(data)
        except ValueError as exc:
            where = f"decisions/{call.key}.{call.attempt}.json"
            self.recorder.event(Event.DECISION_INVALID, level="error", file=where, error=str(exc))
            return
        action = decision["action"]
        record: DecisionRecord = {
            "k": RecordKind.DECISION,
            "call_id": call.call_id,
            "attempt": call.attempt,
            **decision,
        }
        self.recorder.record(record)
        # who decided (docs/design.md section 15), as the decision names them
        who = {k: decision[k] for k in ("by", "via") if k in decision}
        self.recorder.event(Event.DANGLING_DECIDED, call_id=call.call_id, action=action, **who)

    def _held_again(self, call: Call, decided_at: object) -> None:
        """Void a decision that expired before a worker used it: the call becomes a new
        attempt (a ``renewed`` intent: nothing started), which no decision names yet."""
        attempt = call.attempt + 1
        self.recorder.record(
            {
                "k": RecordKind.INTENT,
                "call_id": call.call_id,
                "tool": call.tool,
                "effect": call.effect or "",
                "key": self.calls.key_of(call),
                "attempt": attempt,
                "asked": call.asked,
                "renewed": True,
            }
        )
        self.recorder.event(
            Event.APPROVAL_EXPIRED,
            level="warning",
            call_id=call.call_id,
            tool=call.tool,
            attempt=attempt,
            decided_at=decided_at,
        )
