"""Logging: the one place that configures structlog, and the per-task event files.

Every event goes through the same processor chain::

    merge_contextvars -> add_log_level -> timestamp (ISO 8601, UTC) -> format_exc_info
        -> redact -> [TaskEventWriter] -> JSONRenderer | ConsoleRenderer

``redact`` removes API keys and credentials anywhere in the event (DESIGN.md section
4: the key never appears in the logs); ``TaskEventWriter`` copies each event that has
a ``task`` field into that task's ``events.jsonl`` (what ``agentd logs`` reads), so a
lifecycle event is logged once and lands in both places.

The configuration is global state: ``configure()`` sets it, ``reset()`` puts the
structlog defaults back (the test suite does so around every test).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

LogFormat = Literal["json", "console"]

#: What a secret is replaced with.
REDACTED = "[redacted]"

#: The name of each task's event file inside its spool folder.
EVENTS_FILE = "events.jsonl"

# Values of keys named like these are secrets, whatever they hold. A key matches when
# its last word is one of these (after lowercasing and turning "-" into "_"), so
# `x-api-key` and `access_token` match while `input_tokens` and `max_tokens` do not.
_SECRET_KEY = re.compile(
    r"(?:^|_)(?:api_?key|access_key|private_key|authorization|token|secret|password|passwd"
    r"|cookie|credentials?)$"
)
# Secrets inside any string: Anthropic keys, and the credential of an HTTP auth header.
_ANTHROPIC_KEY = re.compile(r"sk-ant-[A-Za-z0-9_-]+")
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
# The literal values of secret-named environment variables ($ANTHROPIC_API_KEY, say, or
# $GITHUB_TOKEN) are redacted too, unless too short to be real secrets: redacting every
# "x" would make logs unreadable and protect nothing.
_MIN_LITERAL_SECRET = 8
_MAX_DEPTH = 16


class Redactor:
    """Processor that replaces secrets in an event dict, at any depth.

    The value of a secret-named key becomes ``[redacted]``; inside every other string,
    each substring shaped like a secret does (the rest of the message stays readable).
    Containers are copied, never changed in place: they may belong to the caller.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        return self.clean_mapping(event_dict)

    def clean_mapping(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``mapping`` without secrets."""
        return self._mapping(mapping, self._literals(), 0)

    def clean_text(self, text: str) -> str:
        """``text`` with every secret-shaped substring replaced."""
        return self._text(text, self._literals())

    def _literals(self) -> list[str]:
        return [
            value
            for name, value in self._environ.items()
            if len(value) >= _MIN_LITERAL_SECRET and _is_secret_key(name)
        ]

    def _mapping(
        self, mapping: Mapping[Any, Any], literals: list[str], depth: int
    ) -> dict[Any, Any]:
        clean: dict[Any, Any] = {}
        for key, value in mapping.items():
            if isinstance(key, str) and _is_secret_key(key):
                clean[key] = REDACTED if value is not None else None
            else:
                clean[key] = self._value(value, literals, depth + 1)
        return clean

    def _value(self, value: Any, literals: list[str], depth: int) -> Any:
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, str):
            return self._text(value, literals)
        if depth > _MAX_DEPTH:
            return self._text(_safe_repr(value), literals)
        if isinstance(value, Mapping):
            return self._mapping(value, literals, depth)
        if isinstance(value, list | tuple):
            items = [self._value(v, literals, depth + 1) for v in value]
            return items if isinstance(value, list) else tuple(items)
        # Any other object is rendered through its repr later: if that would show a
        # secret (an exception quoting a header, say), log the cleaned text instead.
        text = _safe_repr(value)
        clean = self._text(text, literals)
        return value if clean == text else clean

    def _text(self, text: str, literals: list[str]) -> str:
        for literal in literals:
            if literal in text:
                text = text.replace(literal, REDACTED)
        if "sk-ant-" in text:
            text = _ANTHROPIC_KEY.sub(REDACTED, text)
        return _AUTH_SCHEME.sub(rf"\1 {REDACTED}", text)


#: The redaction processor, reading secrets' values from this process's environment.
redact = Redactor()


def _is_secret_key(name: str) -> bool:
    return _SECRET_KEY.search(name.lower().replace("-", "_")) is not None


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:  # a broken __repr__ must not take logging down with it
        return f"<{type(value).__name__} object>"


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
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
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


#: Maps a task id to its events file, or None when the task has no folder (any more).
TaskEventsPath = Callable[[str], Path | None]


class TaskEventWriter:
    """Processor that appends every event with a ``task`` field to that task's file.

    Runs after ``redact``, so the file gets exactly what the stream gets. A failed
    write does not fail the log call: the stream event carries ``events_file_error``.
    """

    def __init__(self, events_path: TaskEventsPath) -> None:
        self._events_path = events_path

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        task = event_dict.get("task")
        if not isinstance(task, str):
            return event_dict
        try:
            path = self._events_path(task)
            if path is not None:
                TaskEventLog(path).append(event_dict)
        except (OSError, ValueError) as e:  # ValueError: an id the resolver refuses
            event_dict["events_file_error"] = str(e)
        return event_dict


# -- configuration ---------------------------------------------------------------------


def configure(
    fmt: LogFormat | None = None,
    stream: TextIO | None = None,
    *,
    level: int = logging.INFO,
    task_events: TaskEventsPath | None = None,
) -> None:
    """Configure structlog for this process.

    ``fmt`` None picks console output on a TTY and JSON lines otherwise; ``stream`` is
    sys.stderr by default. With ``task_events``, events that name a task are also
    appended to that task's events file (see ``TaskEventWriter``).
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
    if task_events is not None:
        processors.append(TaskEventWriter(task_events))
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
