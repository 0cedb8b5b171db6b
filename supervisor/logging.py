"""Logging: the one place that configures structlog, and the per-task event files.

Every event goes through the same processor chain::

    merge_contextvars -> add_log_level -> timestamp (ISO 8601, UTC) -> format_exc_info
        -> redact -> JSONRenderer | ConsoleRenderer

``redact`` (from ``worker.events``, the one redactor) removes API keys and credentials
anywhere in the event (DESIGN.md section 4: the key never appears in the logs).

The configuration is global state: ``configure()`` sets it, ``reset()`` puts the
structlog defaults back (the test suite does so around every test).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger, Processor

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
    "read_events",
    "read_events_from",
    "redact",
    "reset",
]

LogFormat = Literal["json", "console"]

#: The name of each task's event file inside its spool folder.
EVENTS_FILE = "events.jsonl"


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
    """Back to structlog's defaults, with no bound context variables."""
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def get_logger(**initial_values: Any) -> FilteringBoundLogger:
    """A logger that follows the current configuration, with ``initial_values`` bound."""
    return cast(FilteringBoundLogger, structlog.get_logger(**initial_values))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
