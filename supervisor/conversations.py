"""Conversations (docs/design.md section 19): ``agentd continue``, a done task given a new
instruction that it runs on in the same journal.

A continue is a ``user`` record appended to the task's journal after its last turn, under
the task's operator lock and with the task owned (``control.paused``), so no worker and no
other operator acts meanwhile. The record is queued first and the message appended after:
a kill between the two leaves a queued task on its old scene, which a worker ends again
at once (the command failed, and says nothing was continued), never a message that no
daemon would ever run. The worker's fold treats a ``user`` record after the end as the
conversation going on (``TaskState._apply_user``): its turns, spend, budget and trace go
on, and a scripted task answers it with its script's next response.
"""

from __future__ import annotations

from supervisor.control import REQUEUE_REQUEST, change_record, paused
from supervisor.coordination import operator_lock, ring
from supervisor.decisions import drop_moot_cancel, refuse_if_cancelled
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from supervisor.stores import store_of
from supervisor.submit import checked_text, existing_task
from worker.config import Config
from worker.errors import StateConflictError, UsageError
from worker.events import Event, record_event, utc_now
from worker.protocol import TaskStatus
from worker.records import RecordKind, UserRecord
from worker.spool import Spool, TaskDir


def check_continue(task: TaskDir, record: TaskRecord) -> None:
    """Refuse a continue of a task that is not ``done`` (exit 3), naming what to do."""
    state = record.state
    if state == TaskStatus.DONE:
        return
    if state == TaskStatus.FAILED:
        raise StateConflictError(
            f"task {task.id} failed ({record.reason}); `agentd retry {task.id}` runs it again, "
            f"`agentd fork {task.id} --at TURN --prompt TEXT` starts a new task from a turn."
        )
    if state == TaskStatus.CANCELLED:
        raise StateConflictError(
            f"task {task.id} was cancelled; a cancelled task takes no continue. "
            f"`agentd fork {task.id} --at TURN --prompt TEXT` starts a new task from it."
        )
    raise StateConflictError(f"task {task.id} is {state}, not done; only a done task is continued.")


def continue_task(
    spool: Spool, config: Config, task_id: str, prompt: str, *, operator: Operator | None = None
) -> tuple[int, bool]:
    """Give the done task ``task_id`` the new user message ``prompt`` and queue it again
    (module docstring); ``operator``: who did, in the record and the ``task_continued``
    event. Returns the turn it goes on after, and whether the task is ``agentd run``'s
    (which a daemon never starts by itself: ``run --resume`` or ``retry`` does)."""
    task = existing_task(spool, task_id)
    text = checked_text(prompt, "--prompt")
    if text is None or not text.strip():
        raise UsageError("--prompt is empty; give the new instruction for the task.")
    grace = config.restart.stop_grace
    with operator_lock(task, wait=grace + 10):
        refuse_if_cancelled(task, "continue")
        check_continue(task, TaskRecord.load(task))
        with paused(spool, task, wait=grace + 5) as pause:
            record = TaskRecord.load(task)
            check_continue(task, record)
            from supervisor.status import load_state  # noqa: PLC0415  (a replay: only here)

            turn = load_state(task).turn
            foreground = record.foreground
            drop_moot_cancel(task, record)
            change_record(spool, task, REQUEUE_REQUEST, TaskRecord.requeue)
            message: UserRecord = {
                "k": RecordKind.USER,
                "content": [{"type": "text", "text": text}],
                **fields_of(operator),
            }
            journal, _ = store_of(task).open_journal(pause.owner, header={"task": task.id})
            try:
                journal.append([{**message, "at": utc_now()}])
            finally:
                journal.close()
    record_event(
        store_of(task),
        task.id,
        Event.TASK_CONTINUED,
        task=task.id,
        turn=turn,
        **fields_of(operator),
    )
    ring(spool, task.id)
    return turn, foreground
