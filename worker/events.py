"""Per-task lifecycle events: ``TASK/events.jsonl``.

The file holds one redacted JSON object a line (``worker.redactor`` cleans each event
before it is written). Both the worker and the supervisor append to it (each event is
one ``write`` with ``O_APPEND``), so ``agentd logs`` tells one story per task.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from worker.redactor import Redactor, redact
from worker.store.durable import open_regular


def utc_now() -> str:
    """Now, as ``2026-01-31T12:00:00.123Z``: every record and event carries one, so the
    formatted second is kept and only the milliseconds are formatted anew."""
    global _second  # noqa: PLW0603  (one cache of the formatted second, replaced whole)
    whole, micros = divmod(round(time.time() * 1e6), 1_000_000)  # as datetime rounds
    second = _second
    if second[0] != whole:
        second = _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{second[1]}.{micros // 1000:03d}Z"


_second: tuple[int, str] = (-1, "")


# -- the names of events ----------------------------------------------------------------


class Event(StrEnum):
    """Every event a process of agentd says, by name (docs/design.md section 8; each one's
    fields and level: docs/reference/events.md). A member is its name: it is written to
    the logs and the events files as that text, and events written by an earlier release
    read back as the same member."""

    # the daemon
    SUPERVISOR_STARTED = "supervisor_started"
    SUPERVISOR_READY = "supervisor_ready"
    SUPERVISOR_STATUS = "supervisor_status"
    SUPERVISOR_STOPPING = "supervisor_stopping"
    SUPERVISOR_STOPPED = "supervisor_stopped"
    SIGNAL_IGNORED = "signal_ignored"
    CONFIG_RELOADED = "config_reloaded"
    CONFIG_RELOAD_FAILED = "config_reload_failed"
    LOG_REOPENED = "log_reopened"
    LOG_REOPEN_FAILED = "log_reopen_failed"
    CGROUPS = "cgroups"
    CGROUP_FAILED = "cgroup_failed"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    FORKSERVER_READY = "forkserver_ready"
    FORKSERVER_FAILED = "forkserver_failed"
    FORKSERVER_EXITED = "forkserver_exited"
    METRICS_SERVING = "metrics_serving"
    METRICS_FAILED = "metrics_failed"
    STATUS_SOCKET_FAILED = "status_socket_failed"
    TRACES_EXPORTING = "traces_exporting"
    CONSOLE_SERVING = "console_serving"
    CONSOLE_READY = "console_ready"
    CONSOLE_EXITED = "console_exited"
    CONSOLE_FAILED = "console_failed"
    CONSOLE_ERROR = "console_error"
    CONSOLE_LOGIN = "console_login"
    CONSOLE_LOGIN_FAILED = "console_login_failed"
    STRAYS_KILLED = "strays_killed"
    STORAGE_FAULT = "storage_fault"
    STORAGE_RECOVERED = "storage_recovered"
    RECORD_WRITE_FAILED = "record_write_failed"
    TRANSITION_REFUSED = "transition_refused"
    HOOK_FAILED = "hook_failed"
    TASK_UNREADABLE = "task_unreadable"
    # several nodes (docs/design.md section 10)
    NODE_REGISTERED = "node_registered"
    NODE_SUPERSEDED = "node_superseded"
    TASK_CLAIMED = "task_claimed"
    TASK_ADOPTED = "task_adopted"
    LEASE_LOST = "lease_lost"
    WORKSPACE_UNSEEN = "workspace_unseen"
    # a task
    TASK_SUBMITTED = "task_submitted"
    TASK_RESUMED = "task_resumed"
    TASK_RETRIED = "task_retried"
    TASK_REWOUND = "task_rewound"
    TASK_FORKED = "task_forked"
    TASK_DONE = "task_done"
    TASK_FAILED = "task_failed"
    TASK_CANCELLED = "task_cancelled"
    RESTART_SCHEDULED = "restart_scheduled"
    RESOURCE_WAIT = "resource_wait"
    CRASH_LOOP = "crash_loop"
    BUDGET_CHANGED = "budget_changed"
    BUDGET_EXHAUSTED = "budget_exhausted"
    # its worker
    WORKER_SPAWNED = "worker_spawned"
    WORKER_ADOPTED = "worker_adopted"
    WORKER_LOCK_WAIT = "worker_lock_wait"
    WORKER_EXITED = "worker_exited"
    WORKER_HUNG = "worker_hung"
    WORKER_STALLED = "worker_stalled"
    WORKER_KILLED = "worker_killed"
    PROCESSES_KILLED = "processes_killed"
    # its calls
    MODEL_RETRY = "model_retry"
    COMPACTION = "compaction"
    CONTEXT_STRATEGY_FALLBACK = "context_strategy_fallback"
    SNAPSHOT_IGNORED = "snapshot_ignored"
    DANGLING_RERUN = "dangling_rerun"
    DANGLING_RECONCILED = "dangling_reconciled"
    DANGLING_HELD = "dangling_held"
    DANGLING_DECIDED = "dangling_decided"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_EXPIRED = "approval_expired"
    DECISION_INVALID = "decision_invalid"
    RECONCILE_FAILED = "reconcile_failed"
    RESULT_WAITING = "result_waiting"
    RESULT_WRITTEN = "result_written"
    VCS_CAPTURE_FAILED = "vcs_capture_failed"
    MCP_SERVER_FAILED = "mcp_server_failed"
    MCP_TOOLS_CHANGED = "mcp_tools_changed"
    SPAN = "span"  # a span of the task's trace (docs/design.md section 14), at level debug
    TURN = "turn"  # never written: `agentd logs` shows each turn of the history as one


# -- per-task event files --------------------------------------------------------------


class TaskEventLog:
    """A task's ``events.jsonl``: one redacted JSON object per line, append-only.

    Each event is one ``write`` to a file opened with ``O_APPEND``, so the supervisor
    and a worker may append to the same file. The file is advisory (the journal is the
    record of truth), so there is no fsync; a line torn by a crash is skipped by
    ``read_events`` and the next append starts on a fresh line.
    """

    def __init__(self, path: Path, *, redactor: Redactor = redact) -> None:
        self.path = path
        self._redactor = redactor

    def append(self, event: Mapping[str, Any]) -> None:
        """Append ``event`` (redacted) as one line; the file is created 0600."""
        clean = self._redactor.clean_mapping(event)
        line = json.dumps(clean, ensure_ascii=False, default=str, separators=(",", ":"))
        data = (line + "\n").encode("utf-8", "replace")
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags, 0o600)  # a symlink planted here is never followed
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o777 != 0o600:
                os.fchmod(fd, 0o600)  # whatever the umask, or whoever created it
            if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                data = b"\n" + data  # the last line was torn: do not glue onto it
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every complete event in ``path``; [] when there is no file yet."""
    events, _ = read_events_from(path, 0)
    return events


def read_events_from(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete events after byte ``offset``, and the offset to continue from.

    For ``agentd logs --follow``: an unfinished last line is left for the next call.
    Lines that are not a JSON object (torn by a crash) are skipped.
    """
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:  # none yet, or not a file of ours (a symlink): no events to show
        return [], offset
    end = data.rfind(b"\n") + 1
    events: list[dict[str, Any]] = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + end


def event_line(event: Event, level: str = "info", **fields: Any) -> dict[str, Any]:
    """An event as it is written: its name, the time now, its level and its fields."""
    return {"event": event, "timestamp": utc_now(), "level": level, **fields}


class EventSink(Protocol):
    """What takes a task's events: a ``TaskStore`` (``append_event``)."""

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None: ...


def record_event(
    sink: EventSink, task_id: str, event: Event, level: str = "info", **fields: Any
) -> dict[str, Any]:
    """``append_event`` through a store: one event of the task, its failure to log never
    stopping the caller. Returns the event as written (before redaction)."""
    line = event_line(event, level, **fields)
    with contextlib.suppress(OSError):
        sink.append_event(task_id, line)
    return line


def append_event(path: Path, event: Event, level: str = "info", **fields: Any) -> dict[str, Any]:
    """Append one event line to a task's events file; a failure to log never stops the
    caller (a worker's events are advisory; the daemon keeps the ones a full disk refused:
    ``supervisor.backlog``). Returns the event as written (before redaction)."""
    line = event_line(event, level, **fields)
    with contextlib.suppress(OSError):
        TaskEventLog(path).append(line)
    return line
