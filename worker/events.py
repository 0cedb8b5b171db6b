"""Per-task lifecycle events: one JSON object a line in ``TASK/events.jsonl``.

Both the worker and the supervisor append here (``O_APPEND`` keeps lines whole), so
``agentd logs`` shows one story per task. Every line passes ``redact`` first: API keys,
``Authorization`` values and anything shaped like an Anthropic key never reach the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from worker.durable import open_private

REDACTED = "[redacted]"
_SECRET_KEYS = re.compile(r"api[_-]?key|authorization|secret|password|token$", re.IGNORECASE)
_SECRET_TEXT = re.compile(r"sk-ant-[A-Za-z0-9_\-]{8,}|Bearer\s+[A-Za-z0-9._\-]{8,}")


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _secret_values(environ: Mapping[str, str]) -> list[str]:
    return [v for k, v in environ.items() if _SECRET_KEYS.search(k) and len(v) >= 8]


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of ``value`` with secrets replaced by ``[redacted]``, at any depth."""
    secrets = _secret_values(os.environ) if secrets is None else secrets
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return _SECRET_TEXT.sub(REDACTED, value)
    if isinstance(value, Mapping):
        return {
            k: REDACTED
            if isinstance(k, str) and _SECRET_KEYS.search(k) and v not in (None, "")
            else redact(v, secrets)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, secrets) for v in value]
    return value


def append_event(path: Path, event: str, level: str = "info", **fields: Any) -> dict[str, Any]:
    """Append one event line; a failure to log never stops the caller."""
    line: dict[str, Any] = redact(
        {"event": event, "timestamp": utc_now(), "level": level, **fields}
    )
    with contextlib.suppress(OSError):
        fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (json.dumps(line, default=str) + "\n").encode())
        finally:
            os.close(fd)
    return line


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every whole event line of ``path``; a torn or foreign line is passed over."""
    events: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return events
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict):
                events.append(item)
    return events
