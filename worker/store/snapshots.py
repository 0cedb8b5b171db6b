"""Snapshots written off the loop thread, while the model thinks.

A snapshot costs time in proportion to the transcript (serialize, compress, write, fsync,
rename): tens of milliseconds at a thousand turns. ``SnapshotWriter`` hands it to one
thread of its own, one snapshot at a time, so the loop only pays for a copy of what it
will change later (``TaskState.detached``). A crash mid-snapshot is as harmless as
before: the store replaces a snapshot whole or not at all, and a snapshot is a cache.

A failure (a full disk, a fenced owner) is kept and raised on the loop thread at the
next ``collect``, where a failed synchronous write would have been raised; ``close``
waits for the snapshot in flight and drops its failure (the worker is ending anyway, and
the journal, not the snapshot, is what it leaves behind).
"""

from __future__ import annotations

import threading

from worker.store.base import Owner, Snapshot, TaskStore


class SnapshotWriter:
    def __init__(self, store: TaskStore) -> None:
        self._store = store
        self._thread: threading.Thread | None = None
        self._size: int | None = None  # the bytes of the last snapshot, once written
        self._failure: BaseException | None = None

    @property
    def busy(self) -> bool:
        """A snapshot is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def put(self, owner: Owner, snapshot: Snapshot) -> None:
        """Write ``snapshot`` in the background; its state must be the loop's no longer
        (``TaskState.detached``). Only when not ``busy``."""
        if self.busy:
            raise RuntimeError("a snapshot is still being written")
        self._thread = threading.Thread(
            target=self._write, args=(owner, snapshot), name="snapshot", daemon=True
        )
        self._thread.start()

    def _write(self, owner: Owner, snapshot: Snapshot) -> None:
        try:
            self._size = self._store.put_snapshot(owner, snapshot)
        except BaseException as exc:  # raised on the loop thread by ``collect``
            self._failure = exc

    def collect(self) -> int | None:
        """The size of the snapshot written since the last call, or None; raises what
        made it fail."""
        if self.busy:
            return None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        size, self._size = self._size, None
        return size

    def wait(self) -> int | None:
        """Wait for the snapshot in flight, then ``collect``."""
        if self._thread is not None:
            self._thread.join()
        return self.collect()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._failure = None
