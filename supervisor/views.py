"""What ``agentd status`` and ``agentd logs`` show a person (docs/design.md sections 2 and 3).

Both commands print for people the way the tools they already use do: the status table as
supervisorctl and pm2 print theirs (an AGE, a TOKENS and a CONTEXT column, REASON cut at the
terminal's width with ``…``), and a task's log as kubectl prints a pod's (the last N lines,
one JSON object a line, a follow that ends with the task).

A task's log is two streams merged in time order, each kept in its own order:

* the lifecycle events of ``TASK/events.jsonl`` (``worker.events``), shown as stored;
* one ``turn`` line per turn, built from the journal by ``supervisor.history.history_rows``
  (the rows ``agentd history`` prints): the turn, its tool calls with their outcome, its
  tokens.

The text form is logfmt: ``key=value``, a value quoted (JSON string syntax) when it holds a
space, a quote, an ``=`` or a control character; no Python reprs (a null field is left
out), floats rounded to milliseconds, a nested object flattened to ``key.sub=value``.
Everything here returns strings or data; the commands (``supervisor.commands``) print.
"""

from __future__ import annotations

import heapq
import json
import re
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from supervisor.overview import RUNS_ON
from supervisor.record import ARRIVALS, TaskRecord
from supervisor.relay import earlier_mark
from supervisor.stores import store_of
from worker.budget import usd_text
from worker.events import Event
from worker.protocol import FINAL_STATES, TaskStatus
from worker.records import CallOutcome
from worker.spans import SPAN_EVENT
from worker.spool import TaskDir
from worker.store.base import START, Cursor

# -- the status table -------------------------------------------------------------------

ELLIPSIS = "…"


def human_bytes(size: int) -> str:
    """A size the way ``du -h`` says one: ``812K``, ``3.4M``, ``1.2G``."""
    shown = float(size)
    for unit in ("B", "K", "M", "G", "T"):
        if shown < 1024 or unit == "T":
            return f"{shown:.0f}{unit}" if unit == "B" or shown >= 10 else f"{shown:.1f}{unit}"
        shown /= 1024
    return f"{size}B"


def human_age(seconds: float | None) -> str:
    """A duration the way kubectl's AGE column shows one: ``42s``, ``5m10s``, ``3h``."""
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    if s < 120:
        return f"{s}s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if minutes < 10:
        return f"{minutes}m{s % 60}s"
    if hours < 3:
        return f"{minutes}m"
    if hours < 48:
        return f"{hours}h{(s % 3600) // 60}m" if hours < 8 else f"{hours}h"
    return f"{days}d"


def human_count(n: int) -> str:
    """A token count short enough for a column: ``812``, ``12.3k``, ``4.1M``."""
    if n < 10_000:
        return str(n)
    if n < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.1f}M"


def seconds_since(stamp: str | None, now: float) -> float | None:
    """Seconds from the ISO-8601 time ``stamp`` to ``now`` (wall clock); None if unreadable."""
    if not stamp:
        return None
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    return now - then.timestamp()


def cut(line: str, width: int | None) -> str:
    """``line`` cut to ``width`` characters, the last one an ellipsis when anything went."""
    if width is None or len(line) <= width:
        return line
    return line[: max(width - 1, 0)] + ELLIPSIS


def by_attention(tasks: Iterable[Mapping[str, Any]]) -> list[Any]:
    """The status rows with what needs a person first (``selection.ATTENTION``), the
    latest change first within each: ``status --sort state``'s order."""
    from supervisor.selection import Selection  # noqa: PLC0415  (the watch alone needs it)

    return Selection(sort="state").apply(tasks)[0]


def render_status(
    doc: Mapping[str, Any],
    *,
    width: int | None = None,
    now: float | None = None,
    height: int | None = None,
) -> str:
    """The ``agentd status`` table for a status document (``supervisor.overview.status_document``).

    AGE is the time since the task was submitted (kubectl's meaning: it keeps counting
    across restarts, which RESTARTS counts). TOKENS is what the task has spent, input plus
    output (``usage``); COST its ``cost_usd``, over its USD budget when it has one;
    CONTEXT is ``tokens_used``, the context the model saw at its last
    call plus what it wrote, the counter that drives compaction (``-`` before the first
    turn). REASON is the last column, so cutting a row at ``width`` cuts the
    reason; ``width`` None (stdout is not a terminal) cuts nothing. With ``height`` (the
    terminal's lines), the rows that do not fit under the header are left out, and a
    last line says how many. On a shared store
    (``nodes`` in the document) a NODE column says which node runs each task, and the
    first line how many nodes are alive.
    """
    now = time.time() if now is None else now
    sup = doc["supervisor"]
    lines = [
        f"agentd running (pid {sup['pid']}) on {sup['spool']}"
        if sup["running"]
        else f"agentd is not running on {sup['spool']} ({_without_daemon(doc['tasks'])})"
    ]
    nodes = doc.get("nodes")
    if nodes is not None:
        alive = sum(1 for n in nodes if n["alive"])
        lines[0] += f"; node {sup.get('node')}, {alive} of {len(nodes)} node(s) alive"
    if sup["running"] and sup.get("sandbox"):
        lines[0] += f"; run_command sandbox: {sup['sandbox']}"
    if sup.get("cgroups"):
        lines[0] += f"; cgroups: {sup['cgroups']}"
    if isinstance(sup.get("spool_bytes"), int):
        lines[0] += f"; spool {human_bytes(sup['spool_bytes'])}"
    header = (
        "TASK",
        "STATE",
        "AGE",
        "TURN",
        "TOKENS",
        "COST",
        "CONTEXT",
        "RESTARTS",
        "PID",
        *(("NODE",) if nodes is not None else ()),
        "HEARTBEAT",
        "PHASE",
    )
    rows: list[tuple[str, ...]] = [(*header, "REASON")]
    for t in doc["tasks"]:
        usage = t.get("usage") or {}
        tokens = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
        beat, used = t["heartbeat_age"], t.get("tokens_used")
        rows.append(
            (
                t["id"],
                t["state"],
                human_age(seconds_since(t.get("created_at"), now)),
                str(t["turn"]),
                human_count(tokens),
                human_cost(t.get("cost_usd"), (t.get("budget") or {}).get("usd")),
                "-" if used is None else human_count(int(used)),
                str(t["restarts"]),
                str(t["pid"] or "-"),
                *((t.get("node") or "-",) if nodes is not None else ()),
                "-" if beat is None else f"{beat:.1f}s",
                t["phase"] or "-",
                _reason(t),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        cells = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
        lines.append(cut(f"{cells}  {row[-1]}".rstrip(), width))
    if not doc["tasks"]:
        lines.append("no tasks; add one with `agentd submit --prompt TEXT`")
    # (the screen's last line is the cursor's: a text as tall as the screen scrolls its
    # first line, the header, away; the daemon's line, not cut, may take several)
    head = sum(-(-len(line) // width) if width else 1 for line in lines[:2])
    if height is not None and head + len(lines) - 2 > height - 1:
        shown = max(height - 2 - head, 0)  # the header, the rows, the note, the cursor
        hidden = len(lines) - 2 - shown
        note = (
            f"… {hidden} more task(s) not shown: a taller terminal shows them, or `agentd status`"
        )
        lines = [*lines[: 2 + shown], cut(note, width)]
    return "\n".join(line.rstrip() for line in lines)


def _without_daemon(tasks: list[Mapping[str, Any]]) -> str:
    """What becomes of the tasks while no daemon runs: queued ones wait for `agentd start`;
    a worker that outlived a killed daemon runs on, and that start adopts it."""
    running = sum(1 for t in tasks if t["state"] == TaskStatus.RUNNING and t["reason"] == RUNS_ON)
    if not running:
        return "tasks wait until `agentd start`"
    return (
        f"{running} worker(s) still run on their own and are adopted at the next "
        "`agentd start`; other tasks wait until then"
    )


def human_cost(cost: Any, budget: Any) -> str:
    """COST: the spend in dollars to the cent (a smaller one to four places), ``-`` when a
    model has no price, and ``/`` the USD budget when there is one (one below a cent at
    the precision of the cost)."""
    if not isinstance(cost, int | float):
        shown = "-"
    else:
        shown = f"${cost:.2f}" if cost >= 0.01 or cost == 0 else f"${cost:.4f}"
    return shown + (f"/{usd_text(budget)}" if isinstance(budget, int | float) else "")


def _reason(t: Mapping[str, Any]) -> str:
    """What the REASON column says: held calls first (they need a person), then the
    recorded reason, then a sandbox that refused run_command; on one line."""
    if t["dangling"]:
        return f"{len(t['dangling'])} held call(s): agentd dangling {t['id']}"
    reason = t["reason"] or ""
    if not reason and (t.get("sandbox") or "").startswith("refused"):
        reason = f"run_command {t['sandbox']}"
    return " ".join(reason.split())


# -- a task's log -----------------------------------------------------------------------

#: The event that announces each end state: `agentd logs --follow` stops once it has shown it.
END_EVENTS = {state: ARRIVALS[state][0] for state in FINAL_STATES}

#: How long `--follow` waits for the end event once the record says the task ended (the
#: daemon saves the record, then appends the event; a cancel made with no daemon running
#: appends none).
END_GRACE = 2.0

# Fields every event has, shown in their own columns (or, for ``task``, implied), and
# ``origin``, the daemon's mark on its own lines (``supervisor.relay``), which says nothing
# to a reader. (``by`` is the person who acted: shown.)
_COLUMNS = ("timestamp", "level", "event", "task", "origin")
_BARE = re.compile(r"[^\s\"'=\\]+")


def turn_event(task_id: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """A history row (``history_rows``) as a log event named ``turn``."""
    event: dict[str, Any] = {
        "event": Event.TURN,
        "timestamp": row.get("at"),
        "level": "info",
        "task": task_id,
        "turn": row["turn"],
        "stop_reason": row.get("stop_reason"),
        "input_tokens": row.get("input_tokens", 0),
        "output_tokens": row.get("output_tokens", 0),
        "tool_calls": [
            {
                k: c.get(k)
                for k in ("call_id", "tool", "effect", "outcome", "is_error", "decision")
                if k != "decision" or c.get(k)
            }
            for c in row.get("tool_calls", [])
        ],
    }
    if row.get("rewound"):
        event["rewound"] = True
    if row.get("inherited"):
        event["inherited"] = True
    return event


def _settled(row: Mapping[str, Any]) -> bool:
    """Every tool call of the turn has its outcome (none pending, none held)."""
    return all(
        c.get("outcome") not in (CallOutcome.PENDING, CallOutcome.DANGLING)
        for c in row.get("tool_calls", [])
    )


def _when(event: Mapping[str, Any]) -> str:
    return str(event.get("timestamp") or "")


class TaskLog:
    """A task's log, read in steps: each ``read`` returns what is new since the last.

    Events are read from the byte offset the last read reached (an unfinished last line
    waits for the next read); the journal is folded into history rows again only when it
    has grown. With ``settled``, the last turn is held back until its calls have their
    outcomes, so a followed turn is printed once, complete.
    """

    def __init__(self, task: TaskDir) -> None:
        self.task = task
        self._store = store_of(task)
        self._events_at = START
        self._journal_at: Cursor | None = None  # where the rows were folded to
        self._rows: list[dict[str, Any]] = []
        self._turns_shown = 0
        self._last_end: str | None = None
        self._ended_since: float | None = None

    def read(self, *, settled: bool = False) -> list[dict[str, Any]]:
        events, self._events_at = self._store.read_events(self.task.id, self._events_at)
        events = [e for e in events if e.get("event") != SPAN_EVENT]  # the exporter's alone
        rows = self._history()[self._turns_shown :]
        if settled and rows and not _settled(rows[-1]):
            rows = rows[:-1]
        self._turns_shown += len(rows)
        for e in events:
            if e.get("event") in END_EVENTS.values():
                self._last_end = e["event"]
        # a compaction and a rewind are in the events already (``compaction``,
        # ``task_rewound``)
        turns = [turn_event(self.task.id, r) for r in rows if r.get("kind") == "turn"]
        return list(heapq.merge(events, turns, key=_when))

    def ended(self) -> bool:
        """The task is in an end state and its end event has been read (or did not come
        within ``END_GRACE``). A held task has not ended: a decision resumes it."""
        state = TaskRecord.load(self.task).state
        if state not in FINAL_STATES:
            self._ended_since = None
            return False
        if self._last_end == END_EVENTS[state]:
            return True
        now = time.monotonic()
        self._ended_since = self._ended_since or now
        return now - self._ended_since >= END_GRACE

    def _history(self) -> list[dict[str, Any]]:
        end = self._store.journal_end(self.task.id)
        if end != self._journal_at:
            from supervisor.history import history_rows  # noqa: PLC0415 (`status` needs none of it)

            self._rows, self._journal_at = history_rows(self.task), end
        return self._rows


def shown_outcome(call: Mapping[str, Any]) -> str:
    """A tool call's outcome as the text views show it: ``error`` for a result whose
    ``is_error`` is set (the JSON keeps ``outcome`` and says ``is_error``), but for a call
    that was never run, skipped by an operator or cut off: it says so, as it did not err."""
    outcome = str(call.get("outcome"))
    if call.get("is_error") and outcome not in (CallOutcome.SKIPPED, CallOutcome.NOT_RUN):
        return CallOutcome.ERROR
    return outcome


def log_line(event: Mapping[str, Any]) -> str:
    """One event as a line of text: time, level, name, then its fields in logfmt."""
    fields = {k: v for k, v in event.items() if k not in _COLUMNS}
    if earlier_mark(event):
        fields.pop("by", None)  # an earlier release's mark, not a person
    if event.get("event") == Event.TURN:
        calls = fields.pop("tool_calls", [])
        fields["tools"] = [f"{c.get('tool')}:{shown_outcome(c)}" for c in calls] or None
    text = " ".join(logfmt(fields))
    level = str(event.get("level", "info"))
    return f"{event.get('timestamp') or '-'} {level:7} {event.get('event')} {text}".rstrip()


def logfmt(fields: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    """``key=value`` pairs for ``fields``; a nested object becomes ``key.sub=value``."""
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if value is None:
            continue
        if isinstance(value, Mapping):
            yield from logfmt(value, f"{name}.")
        else:
            yield f"{name}={logfmt_value(value)}"


def logfmt_value(value: Any) -> str:
    """A scalar or a list as logfmt shows it: a list of scalars joined with ``,``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(round(value, 3))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list | tuple):
        if all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
            text = ",".join(str(round(v, 3) if isinstance(v, float) else v) for v in value)
        else:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    else:
        text = str(value)
    if _BARE.fullmatch(text) and text.isprintable():
        return text
    return json.dumps(text, ensure_ascii=False)
