"""Conversations (docs/design.md section 19): ``agentd continue``, a done task given a new
instruction that it runs on in the same journal; ``agentd say``, a message to a live task
that joins its transcript before its next model call (``worker.messages``).

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
from worker.messages import MESSAGE_KEY, MESSAGE_LIMIT, Said
from worker.protocol import TaskStatus
from worker.records import RecordKind
from worker.spool import Spool, TaskDir
from worker.store.base import TaskStore


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
    raise StateConflictError(
        f"task {task.id} is {state}, not done; only a done task is continued "
        f"(`agentd say {task.id} TEXT` adds a message to a live one)."
    )


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
            content = [{"type": "text", "text": text}]
            message = {"k": RecordKind.USER, "content": content, "at": utc_now()}
            journal, _ = store_of(task).open_journal(pause.owner, header={"task": task.id})
            try:
                journal.append([{**message, **fields_of(operator)}])
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


#: The states a task takes ``agentd say`` in: its worker will call the model again.
LIVE = (TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.BACKOFF, TaskStatus.HELD)


def say(spool: Spool, task_id: str, text: str, *, operator: Operator | None = None) -> int:
    """Add ``text`` as a message to the live task ``task_id``, durable when this returns;
    its worker joins it to the transcript before its next model call. Returns the
    message's number. Refused (exit 3) for a task that has ended: ``continue`` a done one."""
    task = existing_task(spool, task_id)
    checked = checked_text(text, "the message")
    if checked is None or not checked.strip():
        raise UsageError("the message is empty; give the text to add to the task.")
    if len(checked.encode()) > MESSAGE_LIMIT:
        raise UsageError(f"the message is over {MESSAGE_LIMIT // 1024**2} MiB; say less.")
    store = store_of(task)
    with operator_lock(task):
        refuse_if_cancelled(task, "message")
        record = TaskRecord.load(task)
        if record.state == TaskStatus.DONE:
            raise StateConflictError(
                f"task {task.id} is done; `agentd continue {task.id} --prompt TEXT` gives it "
                "a new instruction."
            )
        if record.state not in LIVE:
            check_continue(task, record)  # (failed: names retry and fork)
        number = _said_so_far(store, task.id) + 1
        said: Said = {"text": checked, "at": utc_now(), **fields_of(operator)}
        while not store.record_decision(task.id, MESSAGE_KEY, number, dict(said)):
            number += 1  # (another operator's message took that number)
    record_event(
        store,
        task.id,
        Event.MESSAGE_ADDED,
        task=task.id,
        message=number,
        state=str(record.state),
        **fields_of(operator),
    )
    ring(spool, task.id)
    return number


def _said_so_far(store: TaskStore, task_id: str) -> int:
    """How many messages the task was given (they are numbered 1, 2, ... with no gap)."""
    number = 0
    while store.read_decision(task_id, MESSAGE_KEY, number + 1) is not None:
        number += 1
    return number
