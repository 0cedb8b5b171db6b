"""What the agent loop writes of its task: records, events, snapshots.

``Recorder`` is the loop's one way to its ``TaskStore``'s journal. ``record`` stamps a
record, takes every secret the worker knows of out of it (``without_secrets``: docs/design.md
section 5), appends it (durable when it returns, unless asked otherwise) and folds it into
the ``TaskState`` every role of the loop reads; the heartbeat is told the new counters.
``event`` appends a lifecycle event, advisory: a full disk or a database away loses it.
``maybe_snapshot`` takes a snapshot at a turn boundary when one is due, written on the
snapshot thread while the model thinks (``worker.store.snapshots``).

Each journal write is timed (``StepMetrics.checkpointed``), one of the worker's metrics.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

from worker.budget import spend_json
from worker.errors import StorageError, storage_fault
from worker.events import Event, event_line, utc_now
from worker.heartbeat import Heartbeat
from worker.metrics import StepMetrics
from worker.models.base import JSON
from worker.records import Record, RecordKind
from worker.redactor import redact
from worker.state import TaskState
from worker.store import replay
from worker.store.base import START, Cursor, JournalWriter, Owner, Snapshot, TaskStore
from worker.store.snapshots import SnapshotWriter

SNAPSHOT_EVERY = 100  # turns between snapshots, at least
# ...and journal bytes between snapshots, at least the last snapshot's size over this: a
# snapshot costs time in proportion to the transcript, so for long tasks they come further
# apart, and the bytes written for snapshots stay within 3x the journal's own.
SNAPSHOT_GROWTH = 3


def without_secrets(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """``record`` as it may be recorded and sent to the model: a result's content (a tool's
    output, a reconcile answer, an operator's; its text, or the text of each of its text
    blocks) with every secret the worker knows of replaced, so a tool that found the key
    cannot hand it on (docs/design.md section 5)."""
    content = record.get("content")
    if record.get("k") != RecordKind.RESULT:
        return record
    if isinstance(content, str):
        return {**record, "content": redact.clean_secrets(content)}
    if isinstance(content, list):
        blocks = [
            {**b, "text": redact.clean_secrets(b["text"])}
            if isinstance(b, dict) and isinstance(b.get("text"), str)
            else b
            for b in content
        ]
        return {**record, "content": blocks}
    return record


class Recorder:
    """One task's journal, state and events as its loop writes them.

    ``state`` is the fold of every record read or written (``TaskState``); ``journal``
    the writer ``open`` opened (None before). ``heartbeat``, when given, follows the
    journal's durable position and is told the turn, usage and spend at each record, and
    the loop's phase (``phase``)."""

    def __init__(
        self,
        store: TaskStore,
        task_id: str,
        prompt: str,
        heartbeat: Heartbeat | None,
        metrics: StepMetrics,
        *,
        snapshot_every: int = SNAPSHOT_EVERY,
    ) -> None:
        self.store = store
        self.task_id = task_id
        self.heartbeat = heartbeat
        self.metrics = metrics
        self.snapshot_every = snapshot_every
        self.journal: JournalWriter | None = None
        self.state = TaskState(prompt)
        self.snapshot_turn = 0
        self.snapshot_at: Cursor = START  # where the last snapshot was taken
        self.snapshot_size = 0  # and the bytes it took
        self.snapshots = SnapshotWriter(store)  # writes them while the model thinks

    def open(self, owner: Owner, prompt: str) -> TaskState:
        """Load the snapshot (if usable) and replay the journal after it
        (``worker.store.replay``: the daemon's replay too)."""
        journal, state, snapshot = replay.resume(
            self.store,
            owner,
            prompt,
            header={"task": self.task_id},
            on_ignored=self.snapshot_ignored,
        )
        self.journal, self.state = journal, state
        self._follow(journal)
        self.snapshot_turn = state.turn
        if snapshot is not None:
            self.snapshot_at, self.snapshot_size = snapshot.cursor, snapshot.size
        return state

    def _follow(self, journal: JournalWriter) -> None:
        if self.heartbeat:  # ``PROGRESS``: a journal found shorter is damage, not a new task
            self.heartbeat.follow(journal=lambda: journal.durable.position)

    def snapshot_ignored(self, exc: Exception) -> None:
        self.event(Event.SNAPSHOT_IGNORED, level="warning", error=str(exc)[:200])

    @property
    def writer(self) -> JournalWriter:
        if self.journal is None:
            raise RuntimeError("AgentLoop.open() must be called before recording")
        return self.journal

    def record(self, *records: Record, sync: bool = True, hold: bool = False) -> None:
        """Append ``records``, each of its kind's shape (``worker.records``), stamped with
        ``at`` (durable when this returns, unless ``sync`` is False) and fold them in;
        with ``hold``, they ride on the next record's write instead."""
        stamped = [{**without_secrets(r), "at": utc_now()} for r in records]
        if hold:
            self.writer.hold(stamped)
        else:
            started = time.perf_counter()
            self.writer.append(stamped, sync=sync)
            self.metrics.checkpointed(time.perf_counter() - started)
        for record in stamped:
            self.state.apply(record)
        if self.heartbeat:
            self.heartbeat.update(
                turn=self.state.turn,
                usage=self.state.usage_total.to_json(),
                spend=spend_json(self.state.spend_total),
                tokens_used=self.state.tokens_used,
                compactions=self.state.compaction_count,
            )

    def reopen(self) -> list[JSON]:
        """Reopen the journal after its last record known here (``FencedError`` when the
        task's owner changed) and fold in what it holds; the records it found."""
        writer = self.writer
        journal, records = self.store.open_journal(writer.owner, after=writer.cursor)
        with contextlib.suppress(StorageError, OSError):
            writer.close()  # (refusing appends since its failed one)
        self.journal = journal
        self._follow(journal)
        for record in records:
            self.state.apply(record)
        return records

    def maybe_snapshot(self) -> None:
        """Take a snapshot at this boundary when one is due; it is written on the
        snapshot thread (``worker.store.snapshots``) while the model thinks. A snapshot
        that failed is raised at the first boundary after it, due or not, as a synchronous
        write would have been (a full disk stops the worker now, not a hundred turns on)."""
        written = self.snapshots.collect()
        if written is not None:
            self.snapshot_size = written
        if self.state.turn - self.snapshot_turn < self.snapshot_every or (
            self.state.pending_calls()
        ):
            return
        written = self.snapshots.wait()  # the last one: long written, unless every turn
        if written is not None:
            self.snapshot_size = written
        if self.writer.volume_since(self.snapshot_at) < self.snapshot_size // SNAPSHOT_GROWTH:
            return
        self.writer.sync()  # a snapshot never covers records that are not durable
        at = self.writer.cursor
        self.snapshots.put(self.writer.owner, Snapshot(at, self.state.detached()))
        self.snapshot_turn, self.snapshot_at = self.state.turn, at

    def event(self, event: Event, level: str = "info", **fields: Any) -> None:
        line = event_line(
            event, level, task=self.task_id, pid=os.getpid(), turn=self.state.turn, **fields
        )
        try:  # events are advisory: a full disk, or a database away, loses them
            self.store.append_event(self.task_id, line)
        except OSError:
            pass
        except StorageError as exc:
            if storage_fault(exc) is None:
                raise

    def phase(self, phase: str) -> None:
        if self.heartbeat:
            self.heartbeat.phase(phase)

    def close(self) -> None:
        self.snapshots.close()
        if self.journal is not None:
            self.journal.close()
