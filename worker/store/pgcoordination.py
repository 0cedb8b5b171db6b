"""What the nodes of a cluster and the operator's commands tell each other through the
PostgreSQL store (docs/design.md section 10): the operator lock (a session advisory lock),
a pause (``paused_until`` on the task row, which every claim respects), and the wake (a
NOTIFY that every node's listener hears)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from worker.errors import LockBusyError, StorageError
from worker.spool import validate_task_id

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database

#: The NOTIFY channel that wakes nodes (``SharedStore.wake``), and how often a listener
#: looks whether it is to stop.
WAKE_CHANNEL = "agentd_wake"
LISTEN_POLL = 1.0
#: The advisory-lock key space of operator locks (``operator_lock``): "op" in ASCII.
OPERATOR_LOCKS = 0x6F70


class Coordination:
    """The operator lock, pauses and wakes of the tasks in ``db``."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @contextlib.contextmanager
    def operator_lock(self, task_id: str, wait: float) -> Iterator[None]:
        """A session advisory lock on a connection of its own: closing it (a killed
        command's too, once the server sees it gone) releases the lock."""
        key = validate_task_id(task_id)
        conn = self._db.connect()
        try:
            deadline = time.monotonic() + wait
            while True:
                with self._db.faults():
                    row = conn.execute(
                        "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (OPERATOR_LOCKS, key)
                    ).fetchone()
                if row is not None and row[0]:
                    break
                if time.monotonic() >= deadline:
                    raise LockBusyError(f"another command holds task {task_id}'s operator lock")
                time.sleep(0.05)
            yield
        finally:
            conn.close()

    def request_pause(self, task_id: str, seconds: float) -> None:
        self._db.row(
            "UPDATE tasks SET paused_until = now() + make_interval(secs => %(secs)s) "
            "WHERE id = %(task)s RETURNING 1",
            task_id,
            secs=seconds,
        )

    def end_pause(self, task_id: str) -> None:
        self._db.row(
            "UPDATE tasks SET paused_until = NULL WHERE id = %(task)s RETURNING 1", task_id
        )

    def pause_requested(self, task_id: str) -> bool:
        (paused,) = self._db.row(
            "SELECT coalesce(paused_until > now(), false) FROM tasks WHERE id = %(task)s", task_id
        )
        return bool(paused)

    def wake(self, task_id: str) -> None:
        with self._db.step() as conn:
            conn.execute("SELECT pg_notify(%s, %s)", (WAKE_CHANNEL, validate_task_id(task_id)))

    def listen(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._listen, args=(on_wake, stop), name="agentd-listen", daemon=True
        )
        thread.start()
        return stop.set

    def _listen(self, on_wake: Callable[[], None], stop: threading.Event) -> None:
        """LISTEN on a connection of its own; a lost one is made again a second later, and
        wakes the node once (what it missed meanwhile is the poll's, as always)."""
        while not stop.is_set():
            try:
                with self._db.connect() as conn, self._db.faults():
                    conn.execute(f"LISTEN {WAKE_CHANNEL}")
                    on_wake()
                    while not stop.is_set():
                        for _ in conn.notifies(timeout=LISTEN_POLL):
                            on_wake()
            except StorageError:
                stop.wait(1.0)
