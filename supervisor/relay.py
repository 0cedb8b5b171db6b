"""The relay of task events that other processes made into the daemon's own log.

A task's ``events.jsonl`` is written by three kinds of process: the daemon
(``Supervisor.emit``, which logs the same event itself), its workers (``dangling_held``,
``task_resumed``, ``processes_killed``, ...) and CLI commands (``task_submitted``,
``dangling_decided``, ``task_rewound``, ...). An operator who reads only the daemon's
stream (``journalctl -u agentd``) must see all of them (docs/design.md section 8), so the
daemon tails each task's file and logs, once and in the file's order, every line it did
not write itself: the daemon marks its own lines with ``"by": "daemon"``
(``DAEMON_MARK``), and skips them here.

The tail is cheap: a ``stat`` tells whether the file grew past the remembered offset,
and only then is the new part read (``read_events_from``: an unfinished last line waits
for the next read). The daemon reads a task's tail before it logs an event of that task
(so its own lines follow the ones that led to them), for every task at each rescan
(the doorbell of a CLI command, or every few seconds), and for each running task at
each tick.

Offsets are kept in memory only. A task the daemon finds when it starts is tailed from
the end of its file: a restart never logs a task's history again (the events are in the
file, for ``agentd logs``). A task found later (submitted, forked) is tailed from its
first line. What a worker wrote while no daemon ran is therefore not relayed; a worker
that held then holds again when it is resumed, and that hold is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from structlog.typing import FilteringBoundLogger

from worker.errors import StorageError
from worker.store.base import JSON, START, Cursor

#: The field and value the daemon puts in the event lines it writes itself.
DAEMON_MARK = ("by", "daemon")

_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Fields of a line that the daemon's log sets for itself.
_OWN_FIELDS = ("event", "level", "timestamp")


class TaskEvents(Protocol):
    """Where the relay reads events: a ``TaskStore``'s."""

    def events_end(self, task_id: str) -> Cursor: ...

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]: ...


class EventRelay:
    """Each task's events, read from where the last read ended."""

    def __init__(
        self,
        log: FilteringBoundLogger,
        store: TaskEvents,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self._log = log
        self._store = store
        self._on_event = on_event  # told each relayed event's name (the daemon's counters)
        self._cursors: dict[str, Cursor] = {}

    def track(self, task: str, *, from_end: bool) -> None:
        """Start tailing ``task``'s events at their end (a task found at start) or at the
        first one."""
        try:
            self._cursors[task] = self._store.events_end(task) if from_end else START
        except StorageError:  # a shared store away: this task's events are not relayed
            self._cursors.pop(task, None)

    def pull(self, task: str) -> None:
        """Log the events of ``task`` written since the last pull by any other process."""
        cursor = self._cursors.get(task)
        if cursor is None:
            return
        try:
            end = self._store.events_end(task)  # one stat when there is nothing new
            if end == cursor:
                return
            if end < cursor:  # the file was replaced (a folder restored): read it anew
                cursor = START
            events, self._cursors[task] = self._store.read_events(task, cursor)
        except StorageError:  # a shared store away: the next pull catches up
            return
        mark, value = DAEMON_MARK
        for event in events:
            if event.get(mark) == value:
                continue
            name = event.get("event")
            level = event.get("level")
            fields: dict[str, Any] = {k: v for k, v in event.items() if k not in _OWN_FIELDS}
            fields.setdefault("task", task)
            method = level if isinstance(level, str) and level in _LEVELS else "info"
            getattr(self._log, method)(str(name), **fields)
            if self._on_event is not None:
                self._on_event(str(name))

    def forget(self, task: str) -> None:
        self._cursors.pop(task, None)
