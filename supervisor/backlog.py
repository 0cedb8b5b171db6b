"""The daemon's writes that a storage fault refused, kept until the disk takes them.

The daemon writes task records (``state.json``), events files and ``supervisor.json``.
On a full, failing or read-only spool such a write fails, and the daemon must go on
serving (docs/design.md invariant 8) without losing what it meant to write: a record left
saying ``running`` for a worker long gone would make ``status`` lie after space returns.

``WriteBacklog`` runs each write at once. One refused by a storage fault
(``worker.errors.storage_fault``) is kept, and ``retry`` (called on every daemon tick)
tries again: one attempt while the fault lasts, so a full disk costs one failed syscall
or two a tick, then every kept write in order once one succeeds. Two kinds of writes:

* ``replace(key, write)``: a whole file rewritten from the caller's current state (a
  task record). A later write of the same key supersedes the kept one, so a record is
  rewritten once, as it is now, never replayed through its past states.
* ``append(write)``: one line added to a file (an event). Kept in order, at most
  ``MAX_APPENDS`` of them; past that the oldest are dropped and counted.

A fault *episode* runs from the first refused write to the moment the backlog is empty
again: ``on_fault`` is called once at its start, ``on_recovered`` once at its end (with
how many writes were made late and how many lines were dropped), so a full disk is
logged twice, not once per refused write. An error that is no storage fault (a
permission refused, a record that is a folder) is the caller's, raised as before.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from worker.errors import StorageError, storage_fault

MAX_APPENDS = 1000

Write = Callable[[], None]


@dataclass(frozen=True)
class Recovery:
    """The end of a fault episode."""

    rewritten: int  # kept writes made once the disk took them
    dropped: int  # writes given up: lines past MAX_APPENDS, or refused for another cause
    seconds: float  # how long the episode lasted, by the caller's clock


class WriteBacklog:
    def __init__(
        self,
        on_fault: Callable[[StorageError], None],
        on_recovered: Callable[[Recovery], None],
        *,
        clock: Callable[[], float],
        max_appends: int = MAX_APPENDS,
    ) -> None:
        self._pending: OrderedDict[Hashable, Write] = OrderedDict()
        self._appends = 0
        self._serial = itertools.count()
        self._on_fault = on_fault
        self._on_recovered = on_recovered
        self._clock = clock
        self._max_appends = max_appends
        self._since: float | None = None  # when the episode began; None outside one
        self._rewritten = 0
        self._dropped = 0

    @property
    def in_fault(self) -> bool:
        return self._since is not None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def replace(self, key: Hashable, write: Write) -> bool:
        """Run ``write`` (which writes a whole file); keep it under ``key`` if a storage
        fault refuses it. True when it was written now."""
        written = self._attempt(write)
        self._pending.pop(key, None)  # superseded by this write, written or kept
        if not written:
            self._pending[key] = write
        return written

    def append(self, write: Write) -> bool:
        """Run ``write`` (which adds a line); keep it, in order, if a storage fault
        refuses it. Lines wait behind earlier ones: while any is kept, a new one is
        kept too, so a file never gets its lines out of order."""
        if not self._appends and self._attempt(write):
            return True
        if self._appends >= self._max_appends:
            oldest = next(k for k in self._pending if isinstance(k, _Line))
            del self._pending[oldest]
            self._appends -= 1
            self._dropped += 1
        self._pending[_Line(next(self._serial))] = write
        self._appends += 1
        return False

    def retry(self) -> None:
        """Try the kept writes again, in order, stopping at the first one still refused."""
        while self._pending:
            key, write = next(iter(self._pending.items()))
            try:
                if not self._attempt(write):
                    return
            except (StorageError, OSError):  # no retry will fix it (a file made a folder)
                self._dropped += 1
            else:
                self._rewritten += 1
            del self._pending[key]
            if isinstance(key, _Line):
                self._appends -= 1
        if self._since is not None:
            recovery = Recovery(self._rewritten, self._dropped, self._clock() - self._since)
            self._since, self._rewritten, self._dropped = None, 0, 0
            self._on_recovered(recovery)

    def _attempt(self, write: Write) -> bool:
        try:
            write()
        except (StorageError, OSError) as exc:
            fault = storage_fault(exc)
            if fault is None:
                raise
            self._begin(fault)
            return False
        return True

    def _begin(self, fault: StorageError) -> None:
        if self._since is None:
            self._since = self._clock()
            self._on_fault(fault)


@dataclass(frozen=True)
class _Line:
    """The key of one kept append: its place in the order."""

    serial: int
