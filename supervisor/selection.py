"""Finding tasks among many (docs/design.md section 20): the rows of the status document
filtered by state and by text, sorted, and cut into pages that neither skip nor repeat a
row, for ``agentd status`` and ``GET /api/tasks`` alike.

A page ends with a cursor (``next``): the sort key of its last row, which the next request
hands back (``--after``, ``after=``); the next page is the rows that sort after it. A task
that arrives between two pages is not slipped into a page already read, and no row is
given twice.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from worker.errors import UsageError
from worker.protocol import TaskStatus

#: What needs a person first (``--sort state``, ``status --watch``): held, then failed or
#: waiting to restart, running, queued, and what has ended last.
ATTENTION: dict[str, int] = {
    TaskStatus.HELD: 0,
    TaskStatus.FAILED: 1,
    TaskStatus.BACKOFF: 1,
    TaskStatus.RUNNING: 2,
    TaskStatus.QUEUED: 3,
}
#: ``--sort``: the orders a selection may be given in.
SORTS = {
    "name": "by task id",
    "age": "the newest first",
    "-age": "the oldest first",
    "state": "what needs a person first (held, then failed or backoff, running, queued, "
    "ended), the latest change first within each",
}
MAX_LIMIT = 10_000


@dataclass(frozen=True)
class Selection:
    """Which rows, in what order, how many, after which cursor."""

    states: frozenset[str] = field(default_factory=frozenset)
    text: str = ""
    sort: str = "name"
    limit: int | None = None
    after: str | None = None

    @classmethod
    def parse(
        cls,
        *,
        states: str | None = None,
        text: str | None = None,
        sort: str | None = None,
        limit: str | int | None = None,
        after: str | None = None,
        default_sort: str = "name",
    ) -> Selection:
        """A selection from what an operator typed; ``UsageError`` (exit 2, HTTP 400)
        for anything it cannot be."""
        wanted = frozenset(s.strip() for s in (states or "").split(",") if s.strip())
        unknown = sorted(wanted - {str(s) for s in TaskStatus})
        if unknown:
            raise UsageError(
                f"no state {unknown[0]!r}; the states are {', '.join(map(str, TaskStatus))}."
            )
        order = sort or default_sort
        if order not in SORTS:
            raise UsageError(f"no sort {order!r}; sort by {', '.join(SORTS)}.")
        count: int | None = None
        if limit is not None:
            shown = str(limit)
            if not (shown.isascii() and shown.isdigit()) or not 1 <= int(shown) <= MAX_LIMIT:
                raise UsageError(
                    f"the limit must be a number from 1 to {MAX_LIMIT}, not {shown!r}."
                )
            count = int(shown)
        if after is not None:
            _decode(after)  # refused now, before anything is read
        return cls(wanted, (text or "").strip().lower(), order, count, after)

    def key(self, row: Mapping[str, Any]) -> list[Any]:
        """The row's place in this order (a list, as a cursor keeps it)."""
        born = -_stamp(row.get("created_at"))  # the newest first
        if self.sort == "age":
            return [born, row["id"]]
        if self.sort == "-age":
            return [-born, row["id"]]
        if self.sort == "state":
            rank = ATTENTION.get(str(row.get("state")), len(ATTENTION))
            return [rank, -_stamp(row.get("updated_at")), row["id"]]
        return [row["id"]]

    def matches(self, row: Mapping[str, Any]) -> bool:
        if self.states and row.get("state") not in self.states:
            return False
        if self.text:
            seen = " ".join(str(row.get(k) or "") for k in ("id", "reason", "phase", "node"))
            return self.text in seen.lower()
        return True

    def apply(self, rows: Iterable[Mapping[str, Any]]) -> tuple[list[Any], str | None]:
        """The rows of this page, in order, and the cursor of the next page (None: none)."""
        chosen = sorted((r for r in rows if self.matches(r)), key=self.key)
        if self.after is not None:
            start = _decode(self.after)
            try:
                chosen = [r for r in chosen if self.key(r) > start]
            except TypeError:  # (a cursor of another sort)
                raise UsageError(
                    f"the cursor is of another sort than {self.sort!r}; give the sort of the "
                    "page before, or start again without one."
                ) from None
        if self.limit is None or len(chosen) <= self.limit:
            return chosen, None
        page = chosen[: self.limit]
        return page, _encode(self.key(page[-1]))


def _stamp(text: Any) -> float:
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _encode(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def _decode(cursor: str) -> list[Any]:
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if not isinstance(key, list) or not key:
        raise UsageError(f"{cursor[:40]!r} is no cursor; give the `next` of the page before.")
    return key
