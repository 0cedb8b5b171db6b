"""Logging: the one place that configures structlog, and the per-task event files.

Every event goes through the same processor chain::

    merge_contextvars -> add_log_level -> timestamp (ISO 8601, UTC) -> format_exc_info
        -> redact -> JSONRenderer | ConsoleRenderer

``redact`` (from ``worker.events``, the one redactor) removes API keys and credentials
anywhere in the event (DESIGN.md section 4: the key never appears in the logs).

The configuration is global state: ``configure()`` sets it, ``reset()`` puts the
structlog defaults back (the test suite does so around every test).

A daemon that logs to a file (``agentd start --log-file``, as ``--detach`` does) has its
stdout and stderr on that file, so that a traceback lands there too, and reopens it by
name on SIGHUP (``reopen_log_file``): after logrotate has moved the file away, the next
line goes to a new file of that name, not to the rotated one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger, Processor

from worker.durable import open_private
from worker.events import (
    REDACTED,
    Redactor,
    TaskEventLog,
    read_events,
    read_events_from,
    redact,
)

__all__ = [
    "EVENTS_FILE",
    "REDACTED",
    "Redactor",
    "TaskEventLog",
    "configure",
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

#: The file this process's stdout and stderr were sent to (``log_to_file``), if any.
_log_file: Path | None = None


# -- configuration ---------------------------------------------------------------------


def configure(
    fmt: LogFormat | None = None,
    stream: TextIO | None = None,
    *,
    level: int = logging.INFO,
) -> None:
    """Configure structlog for this process.

    ``fmt`` None picks console output on a TTY and JSON lines otherwise; ``stream`` is
    sys.stderr by default. Task events reach each task's events file through
    ``worker.events.append_event``, called by whoever emits them.
    """
    out = sys.stderr if stream is None else stream
    tty = _isatty(out)
    if fmt is None:
        fmt = "console" if tty else "json"
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
                colors=tty, exception_formatter=structlog.dev.plain_traceback
            )
        )
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,  # so reset() and reconfiguring reach every logger
    )


def reset() -> None:
    """Back to structlog's defaults, with no bound context variables and no log file to
    reopen (the descriptors stay where they are)."""
    global _log_file  # noqa: PLW0603  (this module is where global state lives)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    _log_file = None


def log_to_file(path: Path) -> None:
    """Send this process's stdout and stderr to ``path`` (appended; created 0600), and
    remember it for ``reopen_log_file``. Raises OSError when it cannot be opened."""
    global _log_file  # noqa: PLW0603
    _redirect_output(path)
    _log_file = path


def reopen_log_file() -> Path | None:
    """Open the log file again by its name (after a rotation: a new file) and send stdout
    and stderr to it; the path, or None when this process logs to no file. Raises OSError
    when it cannot be opened, and the output stays on the file it was on."""
    if _log_file is not None:
        _redirect_output(_log_file)
    return _log_file


def _redirect_output(path: Path) -> None:
    fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a line cut at the swap is lost
                stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def get_logger(**initial_values: Any) -> FilteringBoundLogger:
    """A logger that follows the current configuration, with ``initial_values`` bound."""
    return cast(FilteringBoundLogger, structlog.get_logger(**initial_values))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
