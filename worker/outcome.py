"""How a worker's run of its task ends: ``Outcome``, and ``storage_outcome`` for a
write's error.

The outcome is what the worker tells the supervisor (its exit record, ``write_exit``, and
its exit code): done, failed, held or stopped, with a one-line reason.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from worker.errors import FencedError, StorageError, storage_fault
from worker.events import utc_now
from worker.protocol import ExitCode, exit_record
from worker.store.base import TaskStore


@dataclass(frozen=True)
class Outcome:
    state: str  # done, failed, held, stopped
    reason: str
    exit_code: ExitCode
    fenced: bool = False  # the task has a new owner: it, not this worker, speaks for it


def storage_outcome(exc: BaseException) -> Outcome:
    """How a worker ends on ``exc``, a write's error: a storage fault is a wait (exit 7,
    nothing recorded was changed); any other error is re-raised, except a StorageError of
    ours, which is a crash with a one-line reason (a restart re-reads what is on disk). A
    step refused by the fence (``FencedError``: ownership moved) stops the worker at once,
    with nothing recorded and no tool run: ``lease_lost``, never a crash."""
    if isinstance(exc, FencedError):
        return Outcome("stopped", f"lease_lost: {exc}", ExitCode.STOPPED, fenced=True)
    fault = storage_fault(exc)
    if fault is not None:
        return Outcome("stopped", str(fault), ExitCode.STORAGE)
    if isinstance(exc, StorageError):
        return Outcome("stopped", str(exc), ExitCode.ERROR)
    raise exc


def write_exit(store: TaskStore, task_id: str, outcome: Outcome) -> None:
    """The worker's last words for the supervisor (best effort: a crash writes none; a
    fenced worker writes none either, the exit record is its task's new owner's)."""
    if outcome.fenced:
        return
    data = exit_record(
        outcome.exit_code, outcome.state, outcome.reason, pid=os.getpid(), at=utc_now()
    )
    with contextlib.suppress(StorageError, OSError):  # a full disk: the exit code says it
        store.publish_exit(task_id, data)
