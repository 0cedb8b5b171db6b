"""Snapshots written off the loop thread, while the model thinks.

A snapshot costs time in proportion to the transcript (serialize, compress, write, fsync,
rename): tens of milliseconds at a thousand turns. ``SnapshotWriter`` hands it to one
thread of its own, one snapshot at a time, so the loop only pays for a copy of what it
will change later (``TaskState.detached``). A crash mid-snapshot is as harmless as
before: the store replaces a snapshot whole or not at all, and a snapshot is a cache.

The thread is started once, at the first snapshot, and then waits for work: starting a
thread per snapshot made the loop wait for the new thread to let go of the GIL (up to
the interpreter's switch interval, 5 ms) on every snapshot. The serialization itself lets
go of the GIL between pieces (``worker.state.dump_scene``).

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
        self._changed = threading.Condition()
        self._job: tuple[Owner, Snapshot] | None = None  # waiting or being written
        self._thread: threading.Thread | None = None
        self._closed = False
        self._size: int | None = None  # the bytes of the last snapshot, once written
        self._failure: BaseException | None = None

    @property
    def busy(self) -> bool:
        """A snapshot is still being written."""
        return self._job is not None

    def put(self, owner: Owner, snapshot: Snapshot) -> None:
        """Write ``snapshot`` in the background; its state must be the loop's no longer
        (``TaskState.detached``). Only when not ``busy``."""
        with self._changed:
            if self._job is not None or self._closed:
                raise RuntimeError("a snapshot is still being written, or the writer is closed")
        if self._thread is None:
            thread = threading.Thread(target=self._serve, name="snapshot", daemon=True)
            thread.start()  # (kept only once started: a failed start leaves nothing to join)
            self._thread = thread
        with self._changed:
            self._job = (owner, snapshot)
            self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while self._job is None and not self._closed:
                    self._changed.wait()
                if self._job is None:
                    return
                owner, snapshot = self._job
            try:
                self._size = self._store.put_snapshot(owner, snapshot)
            except BaseException as exc:  # raised on the loop thread by ``collect``
                self._failure = exc
            with self._changed:
                self._job = None
                self._changed.notify_all()

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
        with self._changed:
            while self._job is not None and self._serving():
                self._changed.wait(0.5)  # (rechecked: a thread that died serves no more)
        return self.collect()

    def _serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._failure = None
