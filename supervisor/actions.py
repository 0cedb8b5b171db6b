"""An operator's actions on a task, each one function that the CLI command of the same
name and the console's API both call (docs/design.md section 12): the same checks, the
same refusals (raised as ``worker.errors`` classes, which the CLI prints as one line with
their exit code and the console answers with the matching HTTP status), the same writes,
and ``by`` and ``via`` recorded with each (``supervisor.operator``, section 15).

* ``approve``: ``agentd approve-dangling``, a decision on one held call or every one;
* ``cancel``: ``agentd cancel`` (``control.cancel`` under it);
* ``retry``: ``agentd retry``;
* ``rewind`` and ``fork`` are ``supervisor.history``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from supervisor import control
from supervisor.budgets import refuse_decision_on_budget
from supervisor.control import RETRY_REQUEST, change_record, move_record
from supervisor.coordination import offline, operator_lock, ring
from supervisor.decisions import decide, drop_moot_cancel, pending_decisions, refuse_if_cancelled
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from supervisor.status import STAGE_UNKNOWN, held_calls
from supervisor.stores import store_for, store_of
from supervisor.submit import RESULT_FILE_LIMIT, checked_text, existing_task
from worker.errors import StateConflictError, UsageError
from worker.events import Event, record_event
from worker.protocol import DECISION_ACTIONS, DecisionAction
from worker.spool import Spool, validate_call_id
from worker.tools.effect import Effect

#: The call id that stands for every held call of a task (``--all``).
EVERY_CALL = "*"


def unsafe_rerun(row: Mapping[str, Any]) -> bool:
    """Whether re-running the held call of ``row`` (``status.held_calls``) may repeat a
    side effect: it started and its outcome is unknown, and its tool is not known to be
    safe to run twice (``unsafe``, or a tool no longer known). Such a re-run is said
    explicitly (docs/guides/tools.md); a call that waits for approval before it
    runs has never run, and a safe-class call held by ``[tools.policy]`` repeats nothing."""
    if row.get("stage") != STAGE_UNKNOWN:
        return False
    return row.get("effect") not in {e.value for e in Effect if e.rerun_safe}


def check_decision(action: str, reason: str | None, result: str | None) -> None:
    """Refuse a decision whose parts do not go together (a UsageError, exit 2: 400)."""
    if action not in DECISION_ACTIONS:
        raise UsageError(
            f"{action!r} is no decision; a held call is re-run (rerun), skipped (skip, "
            "--skip) or given its result (result, --result)."
        )
    if reason is not None and action != DecisionAction.SKIP:
        raise UsageError("--reason goes with --skip: it tells the model why the call was skipped.")
    if action == DecisionAction.RESULT and result is None:
        raise UsageError("a result decision records a result: give its text (--result).")
    if action != DecisionAction.RESULT and result is not None:
        raise UsageError("--skip and --result are different decisions; give one.")
    checked_text(reason, "--reason")
    checked_text(result, "--result")
    if result is not None and len(result.encode()) > RESULT_FILE_LIMIT:
        raise UsageError(
            f"the result is {len(result.encode())} bytes; a recorded result may have "
            f"{RESULT_FILE_LIMIT // (1024 * 1024)} MiB at most."
        )


def approve(
    spool: Spool,
    task_id: str,
    call_id: str,
    *,
    action: str,
    reason: str | None = None,
    result: str | None = None,
    operator: Operator | None = None,
    attempt: int | None = None,
) -> list[tuple[str, int]]:
    """Decide one held call of the task (``call_id``), or every one (``EVERY_CALL``):
    re-run it, skip it (``reason`` is what the model is told) or record ``result`` as its
    outcome. Each decision is durable at once; the task is queued again once every held
    call has one (by this process when no daemon runs, else by the daemon, which is rung).
    ``attempt``: the attempt of ``call_id`` it answers, refused (StateConflictError) when
    the call was held again since (None: the attempt held now); with ``EVERY_CALL`` each
    call's attempt as listed. Returns the calls decided, each with its attempt."""
    task = existing_task(spool, task_id)
    check_decision(action, reason, result)
    if attempt is not None and (isinstance(attempt, bool) or attempt < 1):
        raise UsageError(f"attempt {attempt!r} is no attempt: give the held call's (1 or more).")
    if attempt is not None and call_id == EVERY_CALL:
        raise UsageError("--attempt names one call's attempt; give a CALL_ID with it, not --all.")
    refuse_if_cancelled(task, "decision")  # checked again as each decision is written
    refuse_decision_on_budget(task)  # a task held on its budget waits for `agentd budget`
    calls: list[tuple[str, int | None]]
    if call_id == EVERY_CALL:
        calls = [(row["call_id"], row["attempt"]) for row in held_calls(task)]
        if not calls:
            raise StateConflictError(f"task {task.id} has no held calls; nothing to decide.")
    else:
        calls = [(validate_call_id(call_id), attempt)]
    decided = []
    for call, asked in calls:
        made = decide(
            task,
            call,
            action=action,
            reason=reason,
            result=result,
            operator=operator,
            attempt=asked,
        )
        decided.append((call, made["attempt"]))
    with offline(spool) as alone, contextlib.suppress(StateConflictError):
        if alone and pending_decisions(task):
            # (one not held, say a worker run by hand left it queued, has no hold to release)
            move_record(task, TaskRecord.release_hold)
    ring(spool, task.id)
    return decided


def cancel(
    spool: Spool, task_id: str, wait: float, *, operator: Operator | None = None
) -> bool | control.Fenced:
    """Cancel the task for good: True once it is cancelled, False while the running daemon
    has not applied the cancel within ``wait`` seconds (it will: it is durable); on a
    shared store, a ``Fenced`` when it was taken from a node that stopped renewing its
    lease (``control.cancel``)."""
    task = existing_task(spool, task_id)
    return control.cancel(spool, task, wait, operator=operator)


def retry(spool: Spool, task_id: str, *, operator: Operator | None = None) -> bool:
    """Give a failed task a fresh restart budget (a foreground task is handed to the
    daemon). True when the task was a foreground one, handed over."""
    task = existing_task(spool, task_id)
    with operator_lock(task):
        refuse_if_cancelled(task, "retry")
        record = TaskRecord.load(task)
        record.check_retry(task.id)  # before a request is left for the daemon
        store = store_for(spool)
        if record.foreground and store.owned(task.id):
            raise StateConflictError(
                f"task {task.id} is running in the foreground (`agentd run`, worker pid "
                f"{store.owner_pid(task.id)}); stop it with Ctrl-C there, "
                "then retry it to hand it to the daemon."
            )
        drop_moot_cancel(task, record)
        who = fields_of(operator)
        if change_record(spool, task, RETRY_REQUEST, TaskRecord.retry, asked=who):
            # no daemon took the request: this process moved the record, and says so
            record_event(store_of(task), task.id, Event.TASK_RETRIED, task=task.id, **who)
    return record.foreground
