"""The store seam: every durable byte of a task goes through a ``TaskStore``.

A backend implements two Protocols, and the conformance suite
(``worker.testing.store_conformance``, run by ``tests/store/``) proves that it keeps
their promises; a cluster's store passes ``worker.testing.shared_conformance`` too::

    the loop, the daemon, the CLI            (never know which backend they have)
          │  TaskStore                         tasks, snapshots, decisions, records,
          │                                    events, heartbeats, exits, ownership
          │  JournalWriter                     one owner's appends to one journal
          ▼
    files.FileStore    memory.MemoryStore    (a PostgreSQL store: the same Protocols;
                                              memshared.MemorySharedStore in memory)

Every method is one step that a database can make one transaction: an append carries the
``Owner`` it was opened with, and the backend checks the owner's epoch in the same step,
so a writer whose ownership moved (a lease taken over, a lock released) can never record
another record (``FencedError``). Records, decisions and cancels that two writers may race
for are settled by the backend in one step too: ``record_decision`` and ``request_cancel``
have one winner, ``cas_record`` refuses a stale ``Version`` (``RecordConflictError``).

Positions are opaque: a ``Cursor`` is made by the store and handed back to it, never
computed with (the file store's is a byte offset, another's a sequence number). A
``Snapshot`` is a cache of a ``TaskState`` at a cursor; the one replay that folds a
snapshot and the records after it is ``worker.store.replay``.

Errors (``worker.errors``): ``InvalidIdError`` for an id no store accepts,
``NotFoundError`` for a task that does not exist, ``StorageError`` for a write that
failed or a record over ``MAX_RECORD``, ``JournalCorruptError`` for a journal that cannot
be read safely, ``LockBusyError`` when another owner holds the task, ``FencedError`` for a
step of an owner that no longer owns it, ``RecordConflictError`` for a stale version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from worker.errors import JournalCorruptError, StorageError
from worker.spool import TaskSpec
from worker.state import TaskState
from worker.store.durable import dump_json, load_json

JSON = dict[str, Any]

#: The largest record (its JSON, in bytes) a journal takes, in every backend.
MAX_RECORD = 64 * 1024 * 1024


def record_bytes(record: Mapping[str, Any]) -> bytes:
    """A journal record as every backend stores it: its JSON; ``StorageError`` when it is
    over ``MAX_RECORD`` (nothing is written)."""
    data = dump_json(record)
    if len(data) > MAX_RECORD:
        raise StorageError(
            f"a journal record of {len(data)} bytes is over the {MAX_RECORD}-byte limit; "
            "shorten the tool result or message that produced it."
        )
    return data


@dataclass(frozen=True, order=True)
class Cursor:
    """A position in a task's journal (or events), made by the store that reads it.

    Opaque to everyone else: keep it, compare it, hand it back. Cursors of one journal
    order as its records do."""

    position: int = 0


#: Before the first record: replaying from here folds the whole journal.
START = Cursor()

#: The field of a worker's heartbeat, and of the task record the daemon writes from it,
#: that keeps the journal's last durable position the worker reported (a ``Cursor``'s
#: ``position``). A journal that ends before it lost synced records: it is damage, never
#: a fresh task. Absent (a record of an earlier release): unknown.
PROGRESS = "journal"


def recorded_progress(*sources: Mapping[str, Any] | None) -> int | None:
    """The furthest journal position ``sources`` (records, heartbeats) say was durable;
    None when none says (unknown progress)."""
    found = [
        value
        for source in sources
        if isinstance(source, Mapping)
        for value in [source.get(PROGRESS)]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0
    ]
    return max(found, default=None)


@dataclass(frozen=True)
class Owner:
    """The right to append to one task's journal, held by one worker at a time.

    ``epoch`` grows with every acquisition of the task, and every fenced step carries it:
    a backend refuses the step of an owner whose epoch is no longer the task's."""

    task_id: str
    holder: str  # who holds it, for messages ("pid 1234", a node's name)
    epoch: int
    # on a shared store, the lease a claim took over from a holder that let it stand
    # still (the hold of the call that holder was running names it)
    previous: Previous | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Previous:
    """The lease a claim took over, its holder having let it stand still for its length
    and a margin: whose it was, its epoch, and when it ended, as the taker's wall clock
    reads the instant the lease ran out (for people; docs/design.md section 10)."""

    node: str
    epoch: int
    ended_at: str

    def to_json(self) -> JSON:
        return {"node": self.node, "epoch": self.epoch, "ended_at": self.ended_at}

    @classmethod
    def from_json(cls, data: Any) -> Previous | None:
        """The lease a worker's environment names (``TAKEN_OVER_ENV``), or None."""
        if not isinstance(data, dict):
            return None
        node, epoch, ended = data.get("node"), data.get("epoch"), data.get("ended_at")
        if not isinstance(node, str) or type(epoch) is not int or not isinstance(ended, str):
            return None
        return cls(node, epoch, ended)

    def told(self) -> str:
        """What a hold says of it: the call ran on that node, under that lease."""
        return (
            f"it was running on node {self.node} (epoch {self.epoch}), whose lease ended at "
            f"{self.ended_at} without a renewal"
        )


@dataclass(frozen=True)
class Seized:
    """A lease an operator's command took (``SharedStore.seize``): ``owner`` is the
    command's; ``holder`` the node that had let it stand still (None: none held it),
    under ``epoch``, whose tool may still run for at most ``ends_in`` seconds."""

    owner: Owner
    holder: str | None
    epoch: int
    ends_in: float


@dataclass(frozen=True)
class Snapshot:
    """The task's ``state`` as of ``cursor``: replaying the records after ``cursor`` onto
    it gives the task's state. A store keeps only what the next step needs
    (``TaskState.compact``); ``size`` is the bytes it took (0 until stored)."""

    cursor: Cursor
    state: TaskState
    size: int = 0


@dataclass(frozen=True)
class Version:
    """The version of a task record that ``get_record`` read, for ``cas_record``."""

    token: str = ""  # "": no record yet


def check_journal(name: str, held: int, seq: int, after: int) -> None:
    """The journal of a store that counts its records (``seq``: the records appended,
    kept with the task's row) holds ``held`` of them: ``JournalCorruptError`` when it
    holds fewer (records lost: the task's record shows turns its journal has not), or no
    record starts at ``after``."""
    if held < seq:
        where = f"its records end at {held}" if held else "it holds no record"
        raise JournalCorruptError(
            f"{name} is damaged: {where}, but its task recorded {seq}; agentd will not run "
            "recorded work again. Restore the task from a backup, or check what its calls "
            "did and submit the task anew."
        )
    if not 0 <= after <= seq:
        raise JournalCorruptError(
            f"{name}: no record starts at {after}; read the journal from its start."
        )


def read_records(name: str, items: Sequence[bytes], first: int) -> list[JSON]:
    """Stored records ``items`` as JSON objects; ``JournalCorruptError`` naming the first
    that is not one (zeroed or cut bytes: damage, not a torn tail, since a row is written
    whole in one step). ``first`` is the number (seq) of the first of ``items``."""
    found = []
    for n, item in enumerate(items, start=first):
        try:
            record = load_json(item)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("k"), str):
            raise JournalCorruptError(
                f"{name} is damaged: record {n} is not a journal record; agentd will not "
                "skip recorded work. Restore the task from a backup, or check what its "
                "calls did and submit the task anew."
            )
        found.append(record)
    return found


class Unreadable(ValueError):
    """A stored item that exists but cannot be used; ``where`` names it for an event."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where
        self.reason = reason


#: ``Unreadable.reason`` of a task record that cannot be read, or is not one.
UNREADABLE = "unreadable"
NOT_A_RECORD = "not a task record"


class JournalWriter(Protocol):
    """One owner's open journal, positioned after its last record.

    ``append`` is durable when it returns unless ``sync=False``; a deferred record becomes
    durable with the next synced append, ``sync``, ``sync_in_background`` or ``close``.
    ``hold`` keeps records to ride on the next write (a kill loses them: only for records
    whose loss is harmless). After a failed write the writer refuses every append."""

    @property
    def owner(self) -> Owner: ...

    @property
    def cursor(self) -> Cursor:
        """After the last record written (held records are not written yet)."""
        ...

    @property
    def durable(self) -> Cursor:
        """After the last record known durable (at most ``cursor``): the progress a worker
        reports in its heartbeat (``PROGRESS``)."""
        ...

    def volume_since(self, cursor: Cursor) -> int:
        """Bytes recorded after ``cursor``: what spaces snapshots, never a position."""
        ...

    def append(self, records: Iterable[JSON], *, sync: bool = True) -> None: ...

    def hold(self, records: Iterable[JSON]) -> None: ...

    def sync(self) -> None: ...

    def sync_in_background(self) -> None: ...

    def close(self) -> None:
        """Write what is held (unless the owner lost the task, or the write fails: the
        loss of a held record is harmless) and close."""
        ...


class HeldInMemory:
    """What the journals of the memory and PostgreSQL stores share: the held records kept
    as bytes, until an append carries them or ``close`` writes them; appends durable when
    they return, so a background sync is a sync."""

    _held: list[bytes]

    @property
    def cursor(self) -> Cursor:
        raise NotImplementedError

    @property
    def durable(self) -> Cursor:
        return self.cursor  # every append is durable when it returns

    def append(self, records: Iterable[JSON], *, sync: bool = True) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        if self._held:
            self.append([])

    def sync_in_background(self) -> None:
        self.sync()

    def close(self) -> None:
        if self._held:
            # Never raises: a fenced owner, a failed write or a driver's error only lose
            # what may be lost, and the caller must go on to release the task.
            with contextlib.suppress(Exception):
                self.append([])
        self._held = []


class TaskStore(Protocol):
    """Where every durable byte of every task lives. Thread-safe; ids are checked first."""

    # -- tasks ------------------------------------------------------------------------

    def create(
        self,
        spec: TaskSpec,
        record: JSON,
        *,
        script: bytes | None = None,
        journal: Sequence[JSON] = (),
        prepare: Callable[[Path | None], None] | None = None,
    ) -> None:
        """Create the task with its first ``record`` (and a fork's first journal records):
        all or nothing, and ``StateConflictError`` when the id is taken. ``prepare`` makes
        what lives beside the store (a fork's workspace) before the task can be seen: if
        it raises, there is no task. It is given the folder the task's files are being
        made in (the spool's store), or None: the task's folder in the spool, made by
        ``prepare`` itself where it needs one (a shared store)."""
        ...

    def task_ids(self) -> list[str]: ...

    def exists(self, task_id: str) -> bool: ...

    def rest_mark(self, task_id: str, now_ns: int | None = None) -> tuple[int, ...] | None:
        """A mark of what a daemon's rescan, and a status row it keeps
        (``supervisor.status_socket``), read of the task (its record, spec, heartbeat and
        snapshot, requests, cancel and pause, decisions and budget changes, events and
        journal) that moves whenever any of it changes, or None when no mark can be
        trusted now (at ``now_ns``, wall-clock nanoseconds): the rescan then reads the
        task. A backend with no cheap mark gives None always."""
        ...

    def read_all(self) -> contextlib.AbstractContextManager[None]:
        """For the block, a backend may answer this thread's reads of what status shows
        (specs, records, heartbeats, snapshots, journals) from one read of every task made
        first: a database in one round trip. Files read each record and heartbeat once."""
        ...

    def load_spec(self, task_id: str) -> TaskSpec: ...

    def load_script(self, task_id: str) -> bytes: ...

    # -- ownership --------------------------------------------------------------------

    def acquire(self, task_id: str, *, wait: float = 0.0) -> Owner:
        """Own the task, waiting up to ``wait`` seconds; ``LockBusyError`` if another does."""
        ...

    def renew(self, owner: Owner) -> None:
        """Keep owning the task; ``FencedError`` once ownership moved."""
        ...

    def release(self, owner: Owner) -> None: ...

    def owned(self, task_id: str) -> bool:
        """Whether some owner holds the task now."""
        ...

    def owner_pid(self, task_id: str) -> int | None:
        """The pid of the process on this machine that holds the task (or held it last),
        for the daemon to re-attach to a worker an earlier daemon started; None when there
        is none, or the backend cannot tell (an owner on another node)."""
        ...

    # -- the journal ------------------------------------------------------------------

    def open_journal(
        self, owner: Owner, *, after: Cursor = START, header: Mapping[str, Any] | None = None
    ) -> tuple[JournalWriter, list[JSON]]:
        """Open the task's journal for ``owner`` (creating it with a header record, with
        ``header``'s fields), cut a torn tail, and return the records after ``after``.
        ``JournalCorruptError`` when no record starts at ``after`` or the journal is
        damaged before its tail."""
        ...

    def replay(self, task_id: str, after: Cursor = START) -> list[JSON]:
        """The records after ``after``, read-only (a torn tail is left alone); [] if the
        task has no journal yet."""
        ...

    def journal_end(self, task_id: str) -> Cursor:
        """After the last record recorded so far, read-only: where a new worker starts, so
        that what it recorded can be told afterwards (``START`` with no journal yet)."""
        ...

    # -- snapshots --------------------------------------------------------------------

    def get_snapshot(self, task_id: str) -> Snapshot | None:
        """The latest snapshot, or None; ``ValueError`` (or ``OSError``) when it is
        damaged: a snapshot is a cache, and the caller replays the journal instead."""
        ...

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        """Replace the snapshot (fenced); returns the bytes it takes."""
        ...

    # -- operator decisions and the cancel ----------------------------------------------

    def record_decision(
        self, task_id: str, key: str, attempt: int, decision: Mapping[str, Any]
    ) -> bool:
        """Durably record the decision on ``attempt`` of the call with idempotency
        ``key``, unless one is recorded already: True for the one writer that wins."""
        ...

    def decision_name(self, task_id: str, key: str, attempt: int) -> str:
        """What names that decision in a message (a file, a row): the backend's choice."""
        ...

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None:
        """The decision on that attempt, or None; ``Unreadable`` when it cannot be used."""
        ...

    def request_cancel(self, task_id: str, stamp: JSON) -> bool:
        """Durably record an operator's cancel, once: True for the one writer that wins."""
        ...

    def cancel_requested(self, task_id: str) -> bool: ...

    def read_cancel(self, task_id: str) -> JSON | None:
        """The cancel's record (``request_cancel``'s stamp: when, and who asked), or None
        when no cancel is recorded; ``ValueError`` when it cannot be read."""
        ...

    def withdraw_cancel(self, task_id: str) -> None:
        """Drop a cancel that came too late to apply (the task had ended by itself)."""
        ...

    # -- the task record --------------------------------------------------------------

    def get_record(self, task_id: str) -> tuple[JSON | None, Version]:
        """The task record and its version; ``ValueError`` when it is unreadable."""
        ...

    def record_version(self, task_id: str) -> Version:
        """The record's version now, without reading it: for the one writer allowed to
        replace it whatever it holds (the supervisor lock's holder), a damaged record too."""
        ...

    def record_name(self, task_id: str) -> str:
        """What names the task record in a message (a file, a row): the backend's choice,
        the ``where`` of an ``Unreadable`` it raises for the record."""
        ...

    def cas_record(
        self, task_id: str, expected: Version, record: JSON, *, durable: bool = True
    ) -> Version:
        """Replace the record if its version is still ``expected``, else
        ``RecordConflictError``; ``durable=False`` for a state recovery never trusts."""
        ...

    # -- events, heartbeats and exits -------------------------------------------------

    def append_event(self, task_id: str, event: Mapping[str, Any]) -> None:
        """Append one lifecycle event (redacted); events are advisory, not fenced."""
        ...

    def read_events(self, task_id: str, after: Cursor = START) -> tuple[list[JSON], Cursor]:
        """The events after ``after``, in the order they were appended, and where to go on."""
        ...

    def events_end(self, task_id: str) -> Cursor:
        """After the last event appended so far, without reading any: where a reader that
        wants only what comes next starts (``START`` when there are none)."""
        ...

    def publish_heartbeat(self, task_id: str, beat: JSON) -> None:
        """Replace the heartbeat: it describes the present, so it need not survive a crash."""
        ...

    def read_heartbeat(self, task_id: str) -> JSON | None: ...

    def publish_exit(self, task_id: str, outcome: Mapping[str, Any]) -> None:
        """The worker's last words (the exit record), durably."""
        ...

    def read_exit(self, task_id: str) -> JSON | None: ...


@dataclass(frozen=True)
class NodeInfo:
    """One node of a cluster as the shared store knows it (``agentd nodes``)."""

    name: str
    host: str
    pid: int
    max_workers: int
    tasks: int  # the tasks it holds a live lease on
    heartbeat_age: float  # seconds since it last said it was alive
    alive: bool  # it said so within a lease
    epoch: int = 0  # its registration: bumped each time a daemon registers the name

    def to_json(self) -> JSON:
        return {
            "name": self.name,
            "host": self.host,
            "pid": self.pid,
            "epoch": self.epoch,
            "max_workers": self.max_workers,
            "tasks": self.tasks,
            "heartbeat_age": round(self.heartbeat_age, 3),
            "alive": self.alive,
        }


class SharedStore(TaskStore, Protocol):
    """A ``TaskStore`` that several daemons (nodes) share: the queue, the leases and the
    nodes live in it (docs/design.md section 10). A node ``claim``s tasks; each claim is an
    ``Owner`` whose epoch fences every earlier one, and that its worker appends with.
    Ownership ends with ``put_record(..., release=True)``: the node's verdict on the task
    and the end of its lease, in one fenced step."""

    @property
    def node(self) -> str: ...

    @property
    def lease(self) -> float:
        """Seconds a lease lasts unless renewed."""
        ...

    def close(self) -> None:
        """Close its connections (it reconnects if used again)."""
        ...

    def __hash__(self) -> int:
        """Hashable (by identity, as any object): a spool's ``TaskDir``s are cached by the
        store they are on (``worker.spool``)."""
        ...

    def check_fence(self, owner: Owner) -> None:
        """``FencedError`` unless ``owner`` still owns the task (a read: writes nothing)."""
        ...

    def claim(
        self, limit: int, *, exclude: Sequence[str] = (), expired: bool = True
    ) -> list[Owner]:
        """Take up to ``limit`` runnable tasks no lease holds, or whose holder let its lease
        stand still for its length as this node watched it (never waiting for another
        node's claim), oldest first, each with a new epoch (``Owner.previous`` names a
        lease taken over); without ``expired``, only tasks no lease holds."""
        ...

    def handover(self, owner: Owner) -> Owner:
        """The same node keeps the task for a new worker: a new epoch (fencing the last
        worker, whatever is left of it) and a fresh lease; ``FencedError`` if it moved."""
        ...

    def renew_all(self, owners: Sequence[Owner]) -> list[Owner]:
        """Renew every lease of ``owners`` in one step; returns the ones that moved. Once
        this node has joined, the same step says it is alive, and renews nothing but
        raises ``SupersededError`` when another daemon registered its name since."""
        ...

    def put_record(
        self, owner: Owner, record: JSON, *, release: bool, runnable_in: float = 0.0
    ) -> None:
        """Replace the task record, fenced by ``owner``; with ``release``, end the lease
        too, the task claimable again in ``runnable_in`` seconds (a backoff) if its state
        is one a claim takes. ``FencedError`` (nothing written) once ownership moved."""
        ...

    def leases(self) -> dict[str, str]:
        """The node holding the lease of each task whose lease is held (until its holder
        releases it or another node takes it over)."""
        ...

    def seize(self, task_id: str) -> Seized | None:
        """For an operator's command (a cancel, a rewind): the task's lease, taken when none
        is held or when its holder has not renewed it for half of it as this process
        watched it (a frozen node), fencing the holder at once; None while the holder
        renews it, or until this process has watched that long (call it again)."""
        ...

    def orphans(self) -> list[tuple[Owner, JSON]]:
        """The leases held under this node's name on running tasks, each with its worker's
        latest beat (which names the worker's process: ``worker.identity``)."""
        ...

    def join(self, max_workers: int) -> int:
        """Register this process as the node of its name, under a new registration epoch
        (returned), which claims and renewals check from then on (``SupersededError``
        once another daemon registered the name); ``ConfigError`` when a live node of
        another process has this name."""
        ...

    def leave(self) -> None: ...

    def relogin(self, url: str) -> None:
        """Log in with ``url``'s user and password from the next connection on (SIGHUP
        read the store's URL again); the database stays this store's."""
        ...

    def nodes(self) -> list[NodeInfo]: ...

    def operator_lock(self, task_id: str, wait: float) -> contextlib.AbstractContextManager[None]:
        """Hold the task's operator lock for the block, across every node (the commands
        that settle a task's fate take it: ``supervisor.decisions``); ``LockBusyError``
        when another command holds it for ``wait`` seconds."""
        ...

    def request_pause(self, task_id: str, seconds: float) -> None:
        """An operator's pause of the task for at most ``seconds``: no node claims it
        meanwhile, and the node running it stops its worker at a safe point."""
        ...

    def end_pause(self, task_id: str) -> None: ...

    def pause_requested(self, task_id: str) -> bool: ...

    def wake(self, task_id: str) -> None:
        """Wake every node (a submit, a decision, a cancel): advisory, never the truth."""
        ...

    # -- the console's API tokens (docs/design.md section 12) ---------------------------

    def add_token(self, token: JSON) -> None:
        """Keep an API token (``id``, ``digest``: its SHA-256, never the token; ``by``:
        who minted it; ``created_at``); ``RecordConflictError`` when its id or digest is
        taken."""
        ...

    def tokens(self) -> list[JSON]:
        """Every API token kept, oldest first (without the tokens themselves: digests)."""
        ...

    def token(self, digest: str) -> JSON | None:
        """The API token whose SHA-256 is ``digest``, or None (never minted, or revoked)."""
        ...

    def revoke_token(self, token_id: str) -> bool:
        """Forget the API token ``token_id``: False when there is none of that id."""
        ...

    def listen(self, on_wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_wake`` (from another thread) whenever a node is woken; returns what
        stops listening. Lost wake-ups cost a poll interval, never a task."""
        ...
