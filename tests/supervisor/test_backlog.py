"""``WriteBacklog``: the daemon's writes refused by a storage fault, kept and written once
the disk takes them again, with one fault and one recovery per episode.

The faults are real: task records written with ``TaskRecord.save`` onto a small tmpfs
filled to the last byte (``tests.mounts``, root only; skipped with mount's reason
elsewhere). The bound on kept lines and their order are checked with writes that raise
the OSError a full disk raises, since filling a disk a thousand times proves nothing more.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.backlog import Recovery, WriteBacklog
from supervisor.record import TaskRecord
from tests.mounts import fill, small_disk
from worker.errors import StorageError
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir


class Episodes:
    """What the backlog reported: the faults and recoveries, in order."""

    def __init__(self) -> None:
        self.seen: list[str | Recovery] = []
        self.clock = itertools.count()

    def backlog(self, **kwargs: int) -> WriteBacklog:
        return WriteBacklog(
            lambda fault: self.seen.append(f"fault {fault.errno}"),
            self.seen.append,
            clock=lambda: float(next(self.clock)),
            **kwargs,
        )


def saver(record: TaskRecord, task: TaskDir) -> Callable[[], None]:
    return lambda: record.save(task)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", size_mb=1) as path:
        yield path


def test_records_refused_by_a_full_disk_are_rewritten_as_they_are_now(disk: Path) -> None:
    spool = Spool(disk / "spool").ensure()
    tasks = [spool.task(f"t{i}") for i in range(3)]
    records = [TaskRecord(state=TaskStatus.RUNNING, pid=100 + i) for i in range(3)]
    for task, record in zip(tasks, records, strict=True):
        task.path.mkdir()
        record.save(task)
    episodes = Episodes()
    backlog = episodes.backlog()
    filler = disk / "fill"
    fill(filler)
    for task, record in zip(tasks, records, strict=True):
        record.state, record.pid = TaskStatus.BACKOFF, None
        assert not backlog.replace(("record", task.id), saver(record, task))
    records[0].state = TaskStatus.DONE  # changed again while it waits: the newest state is written
    assert not backlog.replace(("record", tasks[0].id), saver(records[0], tasks[0]))
    assert backlog.pending == 3
    assert [TaskRecord.load(t).state for t in tasks] == ["running"] * 3  # refused, for real
    backlog.retry()  # still full: one attempt, nothing written, no second fault reported
    assert backlog.pending == 3 and episodes.seen == [f"fault {errno.ENOSPC}"]
    filler.unlink()
    backlog.retry()
    assert backlog.pending == 0
    assert [TaskRecord.load(t).state for t in tasks] == ["done", "backoff", "backoff"]
    assert [TaskRecord.load(t).pid for t in tasks] == [None, None, None]
    assert episodes.seen[1:] == [Recovery(rewritten=3, dropped=0, seconds=1.0)]
    backlog.retry()  # nothing kept: nothing to report
    assert len(episodes.seen) == 2


def test_a_write_that_succeeds_supersedes_the_kept_one(disk: Path) -> None:
    spool = Spool(disk / "spool").ensure()
    task = spool.task("t")
    task.path.mkdir()
    record = TaskRecord(state=TaskStatus.RUNNING)
    backlog = Episodes().backlog()
    filler = disk / "fill"
    fill(filler)
    assert not backlog.replace("record", lambda: record.save(task))
    filler.unlink()
    record.state = TaskStatus.DONE
    assert backlog.replace("record", lambda: record.save(task))
    assert backlog.pending == 0 and TaskRecord.load(task).state == "done"


def full_disk() -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_kept_lines_keep_their_order_and_are_bounded() -> None:
    episodes = Episodes()
    backlog = episodes.backlog(max_appends=3)
    lines: list[int] = []
    disk_full = True

    def line(n: int) -> None:
        if disk_full:
            full_disk()
        lines.append(n)

    for n in range(5):
        assert not backlog.append(lambda n=n: line(n))  # type: ignore[misc]
    disk_full = False
    assert not backlog.append(lambda: line(5))  # waits behind the kept ones
    backlog.retry()
    assert lines == [3, 4, 5]  # the oldest dropped, the rest in order
    assert episodes.seen == [f"fault {errno.ENOSPC}", Recovery(3, 3, 1.0)]


def test_an_error_that_is_no_storage_fault_is_the_callers() -> None:
    backlog = Episodes().backlog()

    def refused() -> None:
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(OSError, match="Permission denied"):
        backlog.replace("record", refused)

    def too_big() -> None:
        raise StorageError("a record over the limit")

    with pytest.raises(StorageError, match="limit"):
        backlog.replace("record", too_big)
    assert backlog.pending == 0 and not backlog.in_fault


def test_a_kept_write_that_turns_into_another_error_is_given_up_not_raised() -> None:
    """The tick retries the backlog: an error there must never stop the tick."""
    episodes = Episodes()
    backlog = episodes.backlog()
    errors = iter([errno.ENOSPC, errno.EISDIR])

    def write() -> None:
        code = next(errors)
        raise OSError(code, "x")

    assert not backlog.replace("record", write)
    backlog.retry()
    assert backlog.pending == 0
    assert episodes.seen[-1] == Recovery(rewritten=0, dropped=1, seconds=1.0)
