"""Logging: the one place that configures structlog, and the per-task event files.

Every event goes through the same processor chain::

    merge_contextvars -> add_log_level -> timestamp (ISO 8601, UTC) -> format_exc_info
        -> redact -> JSONRenderer | ConsoleRenderer

``redact`` (from ``worker.redactor``, the one redactor) removes API keys and credentials
anywhere in the event (docs/design.md section 4: the key never appears in the logs).

Lines are written by a ``LogSink``, never by the stream's own ``write``: a log on a full,
failing or read-only disk (the daemon's log may live in its spool) must not raise out of
a logging call and take the daemon down. A line the stream refuses is kept, with the
ones after it (at most ``LOG_BACKLOG``, older ones dropped and counted:
``dropped_lines``), and written before the next line once the stream takes writes again.

Under systemd (``JOURNAL_STREAM`` set, and no ``--log-file``) each line starts with its
syslog priority, ``<4>`` for a warning (sd-daemon(3)), so that ``journalctl -p warning``
finds holds and failures; never otherwise, where ``<4>`` would only be noise. Console
output has colour on a TTY unless ``NO_COLOR`` is set (no-color.org).

The configuration is global state: ``configure()`` sets it, ``reset()`` puts the
structlog defaults back (the test suite does so around every test).

A daemon that logs to a file (``agentd start --log-file``, as ``--detach`` does) has its
stdout and stderr on that file, so that a traceback lands there too, and reopens it by
name on SIGHUP (``reopen_log_file``): after logrotate has moved the file away, the next
line goes to a new file of that name, not to the rotated one.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger, Processor

from worker.events import TaskEventLog, read_events, read_events_from
from worker.output import LOG_FILE_LIMIT, BoundedOutput
from worker.redactor import REDACTED, Redactor, redact

__all__ = [
    "EVENTS_FILE",
    "REDACTED",
    "LogSink",
    "Redactor",
    "TaskEventLog",
    "configure",
    "dropped_lines",
    "get_logger",
    "log_to_file",
    "read_events",
    "read_events_from",
    "redact",
    "reopen_log_file",
    "reset",
]

LogFormat = Literal["json", "console"]

#: The name of each task's event file inside its spool folder.
EVENTS_FILE = "events.jsonl"

#: The file this process's stdout and stderr were sent to (``log_to_file``), if any, and
#: the copy that bounds it.
_log_file: Path | None = None
_output: BoundedOutput | None = None

#: Lines kept while the log's stream refuses writes; older ones are dropped past this.
LOG_BACKLOG = 1000


class LogSink:
    """Writes log lines to a stream; a write that fails never raises.

    A file stream is written with ``os.write`` on its descriptor (a buffered stream that
    failed to flush would keep failing, and raise, on every later write); any other
    stream (a test's StringIO) through ``write``. A refused line, or the rest of one a
    short write cut, waits in order for the next line, which writes it first."""

    def __init__(self, stream: TextIO, backlog: int = LOG_BACKLOG) -> None:
        self.stream = stream
        self.dropped = 0
        self._fd: int | None
        try:
            self._fd = stream.fileno()
        except (OSError, ValueError, AttributeError):  # no descriptor: a StringIO
            self._fd = None
        self._kept: deque[bytes] = deque()
        self._backlog = backlog
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            if len(self._kept) >= self._backlog:
                self._kept.popleft()
                self.dropped += 1
            self._kept.append((line + "\n").encode("utf-8", "replace"))
            while self._kept:
                try:
                    written = self._put(self._kept[0])
                except (OSError, ValueError):  # a full disk, a closed stream: later
                    return
                if written < len(self._kept[0]):
                    self._kept[0] = self._kept[0][written:]
                else:
                    self._kept.popleft()

    def _put(self, data: bytes) -> int:
        if self._fd is not None:
            return os.write(self._fd, data)
        self.stream.write(data.decode("utf-8", "replace"))
        self.stream.flush()
        return len(data)


#: The syslog priority of each structlog method (sd-daemon(3): SD_ERR, SD_WARNING, ...).
PRIORITIES = {
    "critical": 2,
    "fatal": 2,
    "error": 3,
    "err": 3,
    "exception": 3,
    "failure": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "msg": 6,
    "log": 6,
    "debug": 7,
}


class _SinkLogger:
    """The structlog logger of a ``LogSink``: every level writes the rendered line, with
    its syslog priority in front when ``priorities`` (the stream is the journal's)."""

    def __init__(self, sink: LogSink, *, priorities: bool) -> None:
        self._sink = sink
        self._priorities = priorities

    def __getattr__(self, method: str) -> Any:
        if method not in PRIORITIES:
            raise AttributeError(method)
        prefix = f"<{PRIORITIES[method]}>" if self._priorities else ""
        return lambda message: self._sink.write(prefix + message)


_sink: LogSink | None = None


# -- configuration ---------------------------------------------------------------------


def configure(
    fmt: LogFormat | None = None,
    stream: TextIO | None = None,
    *,
    level: int = logging.INFO,
) -> None:
    """Configure structlog for this process.

    ``fmt`` None picks console output on a TTY and JSON lines otherwise; ``stream`` is
    sys.stderr by default. Console colours need a TTY and no ``NO_COLOR``; priority
    prefixes need ``JOURNAL_STREAM`` and no log file (``log_to_file``). Task events
    reach each task's events file through ``worker.events.append_event``, called by
    whoever emits them.
    """
    out = sys.stderr if stream is None else stream
    tty = _isatty(out)
    if fmt is None:
        fmt = "console" if tty else "json"
    global _sink  # noqa: PLW0603  (the one piece of global state: this module's)
    _sink = sink = LogSink(out)
    priorities = bool(os.environ.get("JOURNAL_STREAM")) and _log_file is None
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.format_exc_info,  # tracebacks are text before redaction
        redact,
    ]
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors.append(
            structlog.dev.ConsoleRenderer(
                colors=tty and not os.environ.get("NO_COLOR"),
                exception_formatter=structlog.dev.plain_traceback,
            )
        )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: _SinkLogger(sink, priorities=priorities),
        cache_logger_on_first_use=False,  # so reset() and reconfiguring reach every logger
    )


def reset() -> None:
    """Back to structlog's defaults, with no bound context variables and no log file to
    reopen (the descriptors stay where they are)."""
    global _log_file, _sink  # noqa: PLW0603  (this module is where global state lives)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    _log_file = None
    _sink = None


def log_to_file(path: Path) -> None:
    """Send this process's stdout and stderr to ``path`` (appended; created 0600; moved to
    ``PATH.1`` past ``LOG_FILE_LIMIT``, as a worker's output is: ``worker.output``), and
    remember it for ``reopen_log_file``. Raises OSError when it cannot be opened."""
    global _log_file, _output  # noqa: PLW0603  (the same)
    if _output is not None:
        _output.close()
    _output = BoundedOutput(path, LOG_FILE_LIMIT)
    atexit.register(_output.close)  # what is still in the pipe reaches the file
    _log_file = path


def reopen_log_file() -> Path | None:
    """Open the log file again by its name (after a rotation: a new file); the path, or
    None when this process logs to no file. Raises OSError when it cannot be opened, and
    the output stays on the file it was on."""
    if _output is not None:
        _output.reopen()
    return _log_file


def dropped_lines() -> int:
    """Log lines given up since ``configure`` (a stream that refused them too long)."""
    return _sink.dropped if _sink is not None else 0


def get_logger(**initial_values: Any) -> FilteringBoundLogger:
    """A logger that follows the current configuration, with ``initial_values`` bound."""
    return cast(FilteringBoundLogger, structlog.get_logger(**initial_values))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
