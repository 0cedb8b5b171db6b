"""The relay of task events that other processes made into the daemon's own log.

A task's ``events.jsonl`` is written by three kinds of process: the daemon
(``Supervisor.emit``, which logs the same event itself), its workers (``dangling_held``,
``task_resumed``, ``processes_killed``, ...) and CLI commands (``task_submitted``,
``dangling_decided``, ``task_rewound``, ...). An operator who reads only the daemon's
stream (``journalctl -u agentd``) must see all of them (docs/design.md section 8), so the
daemon tails each task's file and logs, once and in the file's order, every line it did
not write itself: the daemon marks its own lines with ``"origin": "daemon"``
(``DAEMON_MARK``), and skips them here. (A release before it marked them ``"by":
"daemon"``, a line with no ``via``; ``by`` now names the person who acted: docs/design.md
section 15. Such a line is skipped too.)

The tail is cheap: a ``stat`` tells whether the file grew past the remembered offset,
and only then is the new part read (``read_events_from``: an unfinished last line waits
for the next read). The daemon reads a task's tail before it logs an event of that task
(so its own lines follow the ones that led to them), and whenever it looks at the task: at
its doorbell (a command's, or a worker's, which rings for each event it appends:
``Spool.ring``), at each rescan, and on a shared store for each running task at each
tick.

Each task's cursor is kept durably in the spool (``CursorFiles``: ``SPOOL/relay/ID.json``,
written after the lines it passes are logged, at the daemon's next tick: ``keep``, off the
path of the event that moved it, which a restart waits on), and a daemon that starts
relays each task from its cursor: what a worker or a command wrote while no daemon ran
reaches the log at the next start, and nothing is logged twice. A task without a cursor
is relayed from its first line; only on a spool that never had cursors (one of a release
before them: no ``SPOOL/relay`` folder) are the tasks found at the first start tailed
from their end, so that an upgrade does not log every task's history again. A daemon
killed between logging lines and writing their cursor (within a tick) logs those lines
again at its next start (never fewer).

With traces on (docs/design.md section 14) every line read also goes to the trace
assembler (``spans``: the daemon's own lines too, whose ``worker_exited`` closes a killed
worker's run), and the span lines workers write go there alone: they are never logged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from worker.errors import StorageError
from worker.spans import SPAN_EVENT
from worker.spool import validate_task_id
from worker.store.base import JSON, START, Cursor
from worker.store.durable import atomic_write_json, private_dir, read_json

if TYPE_CHECKING:  # (structlog imports asyncio: not for `agentd status`, which reads views)
    from structlog.typing import FilteringBoundLogger

#: The field and value the daemon puts in the event lines it writes itself.
DAEMON_MARK = ("origin", "daemon")

#: A line the daemon appended itself, and what logs it (``EventRelay.pull``).
Own = tuple[Mapping[str, Any], Callable[[], None]]


def _same(event: Mapping[str, Any], line: Mapping[str, Any]) -> bool:
    """Whether ``event``, read back, is the daemon's ``line``: its mark, its name, its
    instant (what the redactor never changes)."""
    return daemons_own(event) and all(
        event.get(key) == line.get(key) for key in ("event", "timestamp", "task")
    )


def daemons_own(event: Mapping[str, Any]) -> bool:
    """Whether the daemon wrote ``event`` itself (its mark, or an earlier release's)."""
    mark, value = DAEMON_MARK
    return event.get(mark) == value or earlier_mark(event)


def earlier_mark(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` carries the mark of an earlier release's daemon, ``"by":
    "daemon"`` with no ``via``: no person (a line of the daemon's own today names, in
    ``by``, the operator whose action it carried out)."""
    return event.get("by") == "daemon" and "via" not in event


_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Fields of a line that the daemon's log sets for itself.
_OWN_FIELDS = ("event", "level", "timestamp")


class SpanSink(Protocol):
    """Where the relay hands every line it reads, the daemon's own included, when traces
    are on (``supervisor.traces.TraceAssembler``): span lines are for it alone."""

    def take(self, task: str, event: Mapping[str, Any]) -> None: ...

    def forget(self, task: str) -> None: ...


class TaskEvents(Protocol):
    """Where the relay reads events: a ``TaskStore``'s."""

    def events_end(self, task_id: str) -> Cursor: ...

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]: ...


class CursorFiles:
    """The relay's cursors, one small file per task in ``folder`` (``SPOOL/relay``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        #: the folder was there already (``Spool.ensure`` makes it): the spool keeps cursors
        self.kept_before = folder.is_dir()
        with contextlib.suppress(OSError):
            private_dir(folder)

    def read(self, task: str) -> Cursor | None:
        try:
            data = read_json(self.folder / f"{validate_task_id(task)}.json")
            position = data["position"]
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            return None
        return Cursor(position)

    def write(self, task: str, cursor: Cursor) -> None:
        """Keep ``cursor`` durably; a spool that refuses it (full, read-only) costs at most
        lines logged again at the next start."""
        with contextlib.suppress(OSError, StorageError):
            private_dir(self.folder)
            path = self.folder / f"{validate_task_id(task)}.json"
            atomic_write_json(path, {"position": cursor.position})


class EventRelay:
    """Each task's events, read from where the last read ended."""

    def __init__(
        self,
        log: FilteringBoundLogger,
        store: TaskEvents,
        on_event: Callable[[str, Mapping[str, Any]], None] | None = None,
        *,
        kept: CursorFiles | None = None,
    ) -> None:
        self._log = log
        self._store = store
        self._on_event = on_event  # told each relayed event, with its task (the daemon's counters)
        self._kept = kept  # the durable cursors (None: in memory only)
        self._moved: set[str] = set()  # tasks whose cursor moved since it was last kept
        self._cursors: dict[str, Cursor] = {}
        #: traces on: every line goes to it too; span lines only to it (never logged)
        self.spans: SpanSink | None = None

    def track(self, task: str, *, from_end: bool) -> None:
        """Start tailing ``task``'s events from its kept cursor; without one, at their end
        (``from_end``: a task found at the first start on a spool that never kept
        cursors) or at the first one."""
        kept = self._kept.read(task) if self._kept is not None else None
        if kept is not None:
            self._cursors[task] = kept
            return
        if self._kept is not None and self._kept.kept_before:
            from_end = False  # a task the spool has kept no cursor for is new since
        try:
            self._cursors[task] = self._store.events_end(task) if from_end else START
        except StorageError:  # a shared store away: this task's events are not relayed
            self._cursors.pop(task, None)
            return
        if self._kept is not None and from_end:
            self._kept.write(task, self._cursors[task])

    def pull(self, task: str, own: Own | None = None) -> None:
        """Log the events of ``task`` written since the last pull by any other process.
        ``own``: a line the daemon has just appended itself (``(line, log)``), logged by
        ``log`` where the file has it, so that the log keeps the file's order even when
        another process appended between the daemon's last pull and its line."""
        cursor = self._cursors.get(task)
        if cursor is None:
            if own is not None:
                own[1]()
            return
        try:
            end = self._store.events_end(task)  # one stat when there is nothing new
            if end == cursor:
                if own is not None:
                    own[1]()
                return
            if end < cursor:  # the file was replaced (a folder restored): read it anew
                cursor = START
            events, self._cursors[task] = self._store.read_events(task, cursor)
        except StorageError:  # a shared store away: the next pull catches up
            if own is not None:
                own[1]()
            return
        for event in events:
            if self.spans is not None:
                with contextlib.suppress(Exception):  # traces never cost the daemon a task
                    self.spans.take(task, event)
            if own is not None and _same(event, own[0]):
                own[1]()
                own = None
            if event.get("event") == SPAN_EVENT or daemons_own(event):
                continue
            name = event.get("event")
            level = event.get("level")
            fields: dict[str, Any] = {k: v for k, v in event.items() if k not in _OWN_FIELDS}
            fields.setdefault("task", task)
            method = level if isinstance(level, str) and level in _LEVELS else "info"
            getattr(self._log, method)(str(name), **fields)
            if self._on_event is not None:
                self._on_event(task, event)
        if own is not None:  # (not read back: logged all the same)
            own[1]()
        if self._kept is not None:
            self._moved.add(task)

    def keep(self) -> None:
        """Write the cursors moved since the last call (each tick, and at a stop): two
        fsyncs each, kept off the path of the events that moved them."""
        moved, self._moved = self._moved, set()
        if self._kept is None:
            return
        for task in moved:
            cursor = self._cursors.get(task)
            if cursor is not None:
                self._kept.write(task, cursor)

    def forget(self, task: str) -> None:
        self._cursors.pop(task, None)
        if self.spans is not None:
            self.spans.forget(task)
