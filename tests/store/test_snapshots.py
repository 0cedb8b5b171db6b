"""``SnapshotWriter`` (worker/store/snapshots.py): one snapshot at a time on a standing
thread, its size or its failure handed to the loop thread, and a close that waits for
the snapshot in flight."""

from __future__ import annotations

import errno
import threading

import pytest

from worker.spool import TaskSpec
from worker.state import TaskState
from worker.store.base import START, Owner, Snapshot
from worker.store.memory import MemoryStore
from worker.store.snapshots import SnapshotWriter


class GatedStore(MemoryStore):
    """A memory store whose snapshot writes wait for ``gate`` and fail while ``full``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.full = False
        self.writers: set[str] = set()  # the threads that wrote snapshots

    def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
        self.writers.add(threading.current_thread().name)
        assert self.gate.wait(10), "the test never opened the gate"
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().put_snapshot(owner, snapshot)


def owned(store: GatedStore) -> Owner:
    store.create(TaskSpec(id="t1", prompt="p"), {"state": "queued"})
    return store.acquire("t1")


def snapshot() -> Snapshot:
    return Snapshot(START, TaskState("p"))


def test_a_snapshot_is_written_off_the_caller_one_at_a_time() -> None:
    store = GatedStore()
    owner = owned(store)
    writer = SnapshotWriter(store)
    writer.put(owner, snapshot())
    assert writer.busy and writer.collect() is None  # still being written
    with pytest.raises(RuntimeError, match="still being written"):
        writer.put(owner, snapshot())
    store.gate.set()
    size = writer.wait()
    assert size is not None and size > 0 and not writer.busy
    assert writer.collect() is None  # handed over once
    writer.put(owner, snapshot())  # the same thread serves the next one
    assert writer.wait() is not None
    writer.close()
    assert store.writers == {"snapshot"}
    assert store.get_snapshot("t1") is not None


def test_a_failed_snapshot_is_raised_by_the_next_collect_once() -> None:
    store = GatedStore()
    store.full = True
    store.gate.set()
    owner = owned(store)
    writer = SnapshotWriter(store)
    writer.put(owner, snapshot())
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert writer.collect() is None  # reported once
    writer.close()


def test_close_waits_for_the_snapshot_in_flight_and_refuses_more() -> None:
    store = GatedStore()
    owner = owned(store)
    writer = SnapshotWriter(store)
    writer.put(owner, snapshot())
    closing = threading.Thread(target=writer.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # the snapshot in flight is still being written
    store.gate.set()
    closing.join(10)
    assert not closing.is_alive() and store.get_snapshot("t1") is not None
    with pytest.raises(RuntimeError, match="closed"):
        writer.put(owner, snapshot())


def test_a_writer_that_never_wrote_closes_at_once() -> None:
    writer = SnapshotWriter(GatedStore())
    assert writer.wait() is None
    writer.close()
