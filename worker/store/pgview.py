"""One read of every task, for status (``TaskStore.read_all``): the whole cluster in one
statement and one round trip, not six a task.

While a thread's ``TaskView.reading`` block lasts, what status shows of a task (its spec,
record, heartbeat, snapshot and the journal after it) is answered from the rows that one
statement read first. The view is of the moment it was read; writes, and reads of
anything else, go to the database as ever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database


@dataclass(frozen=True)
class SeenTask:
    """One task as ``read_all`` saw it: ``records`` are the journal's after seq ``after``
    (the snapshot's, else 0); None for a running task with a heartbeat, which status shows
    from its beat."""

    spec: Any
    record: Any
    version: int
    beat: Any
    beat_age: float | None  # the database's: now() less when it took the beat
    snapshot: bytes | None
    after: int
    records: list[bytes] | None
    seq: int  # the task's: what the journal holds


#: What ``read_all`` reads: every task, in one statement.
_READ_ALL = """
SELECT t.id, t.spec, t.record, t.version, h.beat, extract(epoch FROM now() - h.at)::float8,
    s.state, coalesce(s.seq, 0),
    CASE WHEN t.state = 'running' AND h.beat IS NOT NULL THEN NULL ELSE ARRAY(
        SELECT j.record FROM journal j
        WHERE j.task = t.id AND j.seq > coalesce(s.seq, 0) ORDER BY j.seq
    ) END, t.seq
FROM tasks t
LEFT JOIN heartbeats h ON h.task = t.id
LEFT JOIN snapshots s ON s.task = t.id
"""


class TaskView:
    """Every task as one statement saw it, for the thread that read it, while its
    ``reading`` block lasts."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._reading = threading.local()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """For the block, this thread's ``seen`` answers from one read of every task."""
        with self._db.step() as conn:
            rows = conn.execute(_READ_ALL).fetchall()
        self._reading.view = {row[0]: SeenTask(*row[1:]) for row in rows}
        try:
            yield
        finally:
            self._reading.view = None

    def _view(self) -> dict[str, SeenTask] | None:
        view: dict[str, SeenTask] | None = getattr(self._reading, "view", None)
        return view

    def seen(self, task_id: str) -> SeenTask | None:
        """The task as the read saw it; None outside a ``reading`` block, or for a task
        the read did not see."""
        view = self._view()
        return None if view is None else view.get(task_id)

    def task_ids(self) -> list[str] | None:
        """The tasks the read saw, sorted; None outside a ``reading`` block."""
        view = self._view()
        return None if view is None else sorted(view)
