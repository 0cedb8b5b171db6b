"""The relay of task events that other processes made into the daemon's own log.

A task's ``events.jsonl`` is written by three kinds of process: the daemon
(``Supervisor.emit``, which logs the same event itself), its workers (``dangling_held``,
``task_resumed``, ``processes_killed``, ...) and CLI commands (``task_submitted``,
``dangling_decided``, ``task_rewound``, ...). An operator who reads only the daemon's
stream (``journalctl -u agentd``) must see all of them (DESIGN.md section 8), so the
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

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from structlog.typing import FilteringBoundLogger

from worker.events import read_events_from

#: The field and value the daemon puts in the event lines it writes itself.
DAEMON_MARK = ("by", "daemon")

_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Fields of a line that the daemon's log sets for itself.
_OWN_FIELDS = ("event", "level", "timestamp")


class EventRelay:
    """Each task's events file, read from where the last read ended."""

    def __init__(
        self, log: FilteringBoundLogger, on_event: Callable[[str], None] | None = None
    ) -> None:
        self._log = log
        self._on_event = on_event  # told each relayed event's name (the daemon's counters)
        self._offsets: dict[str, int] = {}

    def track(self, task: str, path: Path, *, from_end: bool) -> None:
        """Start tailing ``task``'s events at the file's end (a task found at start) or
        at its first line."""
        self._offsets[task] = _size(path) if from_end else 0

    def pull(self, task: str, path: Path) -> None:
        """Log the lines of ``task`` written since the last pull by any other process."""
        offset = self._offsets.get(task)
        if offset is None:
            return
        size = _size(path)
        if size == offset:
            return
        if size < offset:  # the file was replaced (a folder restored): read it anew
            offset = 0
        events, self._offsets[task] = read_events_from(path, offset)
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
        self._offsets.pop(task, None)


def _size(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0
