"""Operator decisions on held calls, taken under the task's operator lock
(``supervisor.coordination``).

* Decisions on held calls and a cancel are files written exclusively, so of two operators
  deciding one call exactly one wins.
* The commands that settle what becomes of a task (a decision, cancel, rewind, retry)
  check and write under the task's operator lock, one at a time: each sees what the one
  before it did. So a cancel and a decision that race have exactly one winner, and a
  cancel is final: no decision, rewind or retry is taken after it.
* ``pending_decisions`` tells the daemon when a held task may go back to the queue: every
  held call has a decision its worker will apply (``worker.protocol.usable_decision``).
"""

from __future__ import annotations

import os

from supervisor.coordination import operator_lock
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from supervisor.status import held_calls, load_state
from supervisor.stores import store_of
from worker.errors import AgentdError, NotFoundError, StateConflictError
from worker.events import Event, record_event, utc_now
from worker.protocol import ENDED, Decision, TaskStatus, decision_fields
from worker.spool import TaskDir
from worker.store.base import Unreadable


def cancelled(task: TaskDir, record: TaskRecord | None = None) -> bool:
    """Whether an operator cancelled ``task`` (the daemon may not have applied it yet). A
    cancel record of a task that ended ``done`` or ``failed`` before the daemon could
    apply it is moot (``drop_moot_cancel``)."""
    state = (record or TaskRecord.load(task)).state
    return state == TaskStatus.CANCELLED or (
        state not in ENDED and store_of(task).cancel_requested(task.id)
    )


def refuse_if_cancelled(task: TaskDir, verb: str) -> None:
    """A cancel is final: StateConflictError for any command that would revive the task."""
    if cancelled(task):
        raise StateConflictError(
            f"task {task.id} was cancelled; a cancelled task takes no {verb}. "
            f"`agentd fork {task.id} --at TURN` starts a new task from it."
        )


def record_cancel(task: TaskDir, operator: Operator | None = None) -> None:
    """Durably record the operator's cancel of ``task`` (``TaskStore.request_cancel``: one
    winner), for the daemon to apply; the caller holds the operator lock. Refused
    when the task has ended, and when a call of it was decided and the decision is not
    carried out yet: that decision won the race, and the cancel would cut it off. The
    record names ``operator`` (``cancelled_by`` reads it back for the cancel's event)."""
    record = TaskRecord.load(task)
    if cancelled(task, record):
        raise StateConflictError(f"task {task.id} is already cancelled; nothing to cancel.")
    record.check_cancel(task.id)
    decided = _decided_calls(task)
    if decided:
        raise StateConflictError(
            f"call {decided[0]} of task {task.id} was already decided and is not carried out "
            "yet; cancel the task once its result is recorded (`agentd logs`)."
        )
    stamp = {"cancelled_at": utc_now(), "pid": os.getpid(), **fields_of(operator)}
    if not store_of(task).request_cancel(task.id, stamp):
        raise StateConflictError(f"task {task.id} is already cancelled; nothing to cancel.")


def cancelled_by(task: TaskDir) -> Operator | None:
    """Who asked for the task's cancel (its cancel record), or None: none asked, or the
    record names nobody (one of an earlier release), or it cannot be read."""
    try:
        return Operator.of(store_of(task).read_cancel(task.id))
    except (AgentdError, OSError, ValueError):
        return None


def drop_moot_cancel(task: TaskDir, record: TaskRecord) -> None:
    """Remove the cancel record of a task that ended ``done`` or ``failed`` before it was
    applied, so that a rewind or retry of it is not cancelled afterwards. Only under the
    operator lock: no other command can be reading it then."""
    if record.state in ENDED:
        store_of(task).withdraw_cancel(task.id)


def _decided_calls(task: TaskDir) -> list[str]:
    """Calls of ``task`` whose operator decision is not carried out yet: held with a
    decision for the held attempt, or being re-run on one (a dangling attempt right after
    a decided one, not held again)."""
    try:
        state = load_state(task)
        held = {h["call_id"]: h.get("attempt") for h in state.held}
        found = []
        for call in state.calls.values():
            if not call.dangling or call.key is None:
                continue
            decided = call.attempt if held.get(call.call_id) == call.attempt else call.attempt - 1
            if decided > 0 and _usable_decision(task, call.key, decided):
                found.append(call.call_id)
        return found
    except (AgentdError, OSError, ValueError, KeyError, TypeError):
        return []  # a journal no worker can replay: nothing of it will be carried out


def decide(
    task: TaskDir,
    call_id: str,
    *,
    action: str,
    reason: str | None = None,
    result: str | None = None,
    operator: Operator | None = None,
    attempt: int | None = None,
) -> Decision:
    """Durably record an operator's decision on one held call of ``task``; refused once
    the task was cancelled (under the operator lock, so a racing cancel has one winner).
    ``operator``: who decided, and through what (docs/design.md section 15), kept in the
    decision (``by`` and ``via``) and its event. ``attempt``: the attempt of the call the
    decision answers (docs/guides/tools.md), refused unless it is the held one
    (None: the held one, whichever it is)."""
    with operator_lock(task):
        refuse_if_cancelled(task, "decision")
        return _decide(
            task,
            call_id,
            action=action,
            reason=reason,
            result=result,
            who=operator,
            attempt=attempt,
        )


def _decide(
    task: TaskDir,
    call_id: str,
    *,
    action: str,
    reason: str | None,
    result: str | None,
    who: Operator | None,
    attempt: int | None,
) -> Decision:
    record = TaskRecord.load(task)
    rows = {row["call_id"]: row for row in held_calls(task)}
    if call_id not in rows:
        raise NotFoundError(
            f"task {task.id} has no held call {call_id!r} (state {record.state}); "
            f"`agentd dangling {task.id}` lists the calls that wait for a decision."
        )
    row = rows[call_id]
    if attempt is not None and attempt != row["attempt"]:
        raise StateConflictError(
            f"call {call_id} of task {task.id} is at attempt {row['attempt']} now, not "
            f"{attempt}: it was held again since that decision was made; `agentd dangling "
            f"{task.id}` shows it as it is now."
        )
    decision: Decision = {
        "call_id": call_id,
        "attempt": row["attempt"],
        "action": action,
        "reason": reason,
        "result": result,
        "decided_at": utc_now(),
        **fields_of(who),
    }
    store = store_of(task)
    key, attempt = row["idempotency_key"], row["attempt"]
    if not store.record_decision(task.id, key, attempt, decision):
        raise StateConflictError(
            f"call {call_id} of task {task.id} was already decided by someone else "
            f"({store.decision_name(task.id, key, attempt)}); `agentd dangling {task.id}` "
            "shows what still waits."
        )
    record_event(
        store,
        task.id,
        Event.DANGLING_DECIDED,
        task=task.id,
        call_id=call_id,
        action=action,
        **fields_of(who),
        attempt=row["attempt"],
    )
    return decision


def pending_decisions(task: TaskDir) -> bool:
    """True when every held call of a held task has a decision file."""
    rows = held_calls(task)
    return bool(rows) and all(
        _usable_decision(task, r["idempotency_key"], r["attempt"]) for r in rows
    )


def _usable_decision(task: TaskDir, key: str, attempt: int) -> bool:
    """Whether the worker can apply the decision on that attempt
    (``worker.protocol.usable_decision``); one the store cannot read (a decisions folder
    that is a symlink is never read through, by the worker either) is not."""
    try:
        decision = store_of(task).read_decision(task.id, key, attempt)
        if decision is None:
            return False
        decision_fields(decision)
    except (Unreadable, ValueError):
        return False
    return True
