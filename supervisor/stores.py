"""Which ``TaskStore`` the supervisor works on: chosen here, and nowhere else.

Every other module of the supervisor reaches a task's durable bytes through the store
this module hands out, typed as the ``TaskStore`` Protocol (``worker.store.base``), so a
backend other than the spool's files can be chosen here alone. Today it is always the
file store of the spool (one per spool in a process: ``spool_store``), so that the daemon
and the commands it runs share its ownership epochs.
"""

from __future__ import annotations

from pathlib import Path

from worker.spool import TaskDir
from worker.store.base import TaskStore
from worker.store.files import spool_store


def store_for(root: Path) -> TaskStore:
    """The store of the tasks of the spool at ``root``."""
    return spool_store(root)


def store_of(task: TaskDir) -> TaskStore:
    """The store ``task`` lives in: its spool's (``store_for``)."""
    return store_for(task.root)
