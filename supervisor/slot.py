"""The daemon's view of one task (``TaskSlot``): shared by the daemon and its roles
(``supervisor.placement``), which each read and move it on the daemon's loop."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.record import TaskRecord
from supervisor.workers import WorkerProcess
from worker.spool import TaskDir
from worker.store.base import Owner


@dataclass
class TaskSlot:
    """The daemon's view of one task between reads of its record."""

    task: TaskDir
    record: TaskRecord
    worker: WorkerProcess | None = None
    due: float = 0.0  # monotonic time a backoff ends
    waiting_lock: bool = False  # an unknown process holds the task lock: wait for it
    paused: bool = False  # an operator command holds the task for a moment (rewind)
    starting: bool = False  # a worker was asked of the fork server; its pid is to come
    resource_waits: int = 0  # starts refused for want of processes or memory, in a row
    storage_waits: int = 0  # storage faults in a row (exit 7 without progress): the backoff
    owner: Owner | None = None  # on a shared store: this node's claim of the task
