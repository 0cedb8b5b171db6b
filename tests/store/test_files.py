"""What only the file store promises: the bytes of the releases before the seam, the torn
tail and the damaged middle of a framed journal, and races of whole processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.store.conftest import new_task
from tests.support import REPO, poll_for
from worker.errors import FencedError, JournalCorruptError, LockBusyError
from worker.state import fold, snapshot_bytes
from worker.store.base import NOT_A_RECORD, PROGRESS, Snapshot, Unreadable
from worker.store.files import FileStore
from worker.store.journal import Journal
from worker.testing.store_conformance import HEADER, turn, user

pytestmark = pytest.mark.backend("files")


def journal_of(store: FileStore, task_id: str = "t1") -> Path:
    return store.task(task_id).journal


def test_the_bytes_on_disk_are_the_journals_and_the_snapshots_of_before(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    records = [turn(1), user("more")]
    writer.append(records[:1])
    writer.append(records[1:], sync=False)
    writer.sync()
    state = fold("Do the thing.", store.replay(task))
    store.put_snapshot(owner, Snapshot(writer.cursor, state))
    writer.close()

    direct, _ = Journal.open(tmp_path / "journal", task="t1")  # the journal module alone
    with direct:
        direct.append(records[:1])
        direct.append(records[1:], sync=False)
    assert journal_of(store).read_bytes() == (tmp_path / "journal").read_bytes()
    snapshot = store.task(task).snapshot.read_bytes()
    assert snapshot == snapshot_bytes(state, journal_of(store).stat().st_size)


def test_a_torn_tail_is_left_by_a_reader_and_cut_by_the_owner(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.append([user("one"), user("two")])
    writer.close()
    path = journal_of(store)
    whole = path.stat().st_size
    with path.open("ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # an append the machine did not finish

    assert store.replay(task)[1:] == [user("one"), user("two")]
    assert path.stat().st_size == whole + 8  # a reader changes nothing
    writer, records = store.open_journal(owner, header=HEADER)
    assert records[1:] == [user("one"), user("two")]
    assert path.stat().st_size == whole  # the owner cut it
    writer.append([user("three")])
    assert store.replay(task)[1:] == [user("one"), user("two"), user("three")]
    writer.close()


def test_damage_in_the_middle_is_refused_never_skipped(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.append([user("one")])
    middle = writer.cursor.position
    writer.append([user("two")])
    writer.append([user("three")])  # its durable mark covers "two"
    writer.close()
    path = journal_of(store)
    data = bytearray(path.read_bytes())
    data[middle + 20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match="intact records after it"):
        store.replay(task)
    with pytest.raises(JournalCorruptError):
        store.open_journal(owner, header=HEADER)
    assert path.read_bytes() == bytes(data)  # nothing was cut


RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from worker.store.files import FileStore
    spool, go, me = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    store = FileStore(spool)
    deadline = time.monotonic() + 20
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    won = store.record_decision("t1", "agentd-key1", 1, {"by": me})
    sys.exit(0 if won else 10)
    """
)


@pytest.mark.parametrize("writers", [2, 8])
def test_a_decision_is_recorded_once_by_racing_processes(tmp_path: Path, writers: int) -> None:
    store = FileStore(tmp_path / "spool")
    new_task(store)
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(store.spool.root), str(go), str(i)], cwd=REPO
        )
        for i in range(writers)
    ]
    go.touch()
    codes = [racer.wait(timeout=60) for racer in racers]
    assert sorted(codes) == [0] + [10] * (writers - 1)
    assert store.read_decision("t1", "agentd-key1", 1) == {"by": codes.index(0)}


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from worker.store.files import FileStore
    store = FileStore(Path(sys.argv[1]))
    store.acquire("t1")
    print("held", flush=True)
    time.sleep(60)
    """
)


def test_ownership_is_held_by_one_process_and_dies_with_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "spool")
    new_task(store)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store.spool.root)], cwd=REPO, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert store.owned("t1")
        with pytest.raises(LockBusyError):
            store.acquire("t1")
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
    poll_for(lambda: not store.owned("t1"), timeout=10)
    owner = store.acquire("t1")
    store.release(owner)
    with pytest.raises(FencedError):
        store.open_journal(owner, header=HEADER)


def test_what_the_daemon_reads_beside_the_protocol(tmp_path: Path) -> None:
    """``owner_pid`` (adopt), ``record_version`` and the names a message gives, as the
    file store answers them: the lock's holder, the file's identity, the files' names."""
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    assert store.owner_pid(task) is None and not store.owned(task)
    owner = store.acquire(task)
    assert store.owned(task) and store.owner_pid(task) == os.getpid()
    store.release(owner)
    assert not store.owned(task)
    _, version = store.get_record(task)
    assert store.record_version(task) == version
    newer = store.cas_record(task, store.record_version(task), {"state": "running"})
    assert store.record_version(task) == newer != version
    assert store.record_name(task) == str(store.task(task).state)
    assert store.decision_name(task, "k1", 2) == store.task(task).decision_file("k1", 2).name
    store.task(task).state.write_text("[1]")
    with pytest.raises(Unreadable) as refused:
        store.get_record(task)
    assert (refused.value.where, refused.value.reason) == (store.record_name(task), NOT_A_RECORD)


@pytest.mark.parametrize("source", ["record", "heartbeat"])
def test_a_journal_shorter_than_the_progress_recorded_is_damage(
    tmp_path: Path, source: str
) -> None:
    """The progress a worker's heartbeat reports, or the daemon's record keeps from it:
    a journal that lost synced records is refused by the reader and the owner alike."""
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.append([turn(1), user("more")])
    progress = writer.durable.position
    assert progress == journal_of(store).stat().st_size
    writer.close()
    if source == "record":
        record, version = store.get_record(task)
        store.cas_record(task, version, {**(record or {}), PROGRESS: progress})
    else:
        store.publish_heartbeat(task, {"pid": 1, PROGRESS: progress})
    assert [r["k"] for r in store.replay(task)] == ["header", "turn", "user"]
    os.truncate(journal_of(store), 0)
    for read in (lambda: store.replay(task), lambda: store.open_journal(owner)):
        with pytest.raises(JournalCorruptError, match=f"recorded {progress} bytes"):
            read()
    assert journal_of(store).read_bytes() == b""
    journal_of(store).unlink()  # a journal gone is the same loss
    with pytest.raises(JournalCorruptError, match="holds no whole record"):
        store.open_journal(owner)
    assert not journal_of(store).exists()


def test_a_record_of_an_earlier_release_has_unknown_progress(tmp_path: Path) -> None:
    """No progress field anywhere: a blank journal is read as today, a new one."""
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    owner = store.acquire(task)
    journal_of(store).touch()
    assert store.progress(task) is None and store.replay(task) == []
    writer, records = store.open_journal(owner, header=HEADER)
    writer.close()
    assert [r["k"] for r in records] == ["header"]


def test_read_all_reads_a_record_and_a_heartbeat_once_and_a_write_drops_the_copy(
    tmp_path: Path,
) -> None:
    """Status reads a task's record and heartbeat for its row and again for its journal's
    progress: in a ``read_all`` block the files are read once. A change made by another
    process in the block is seen at the next block; one written through the store at once."""
    store = FileStore(tmp_path / "spool")
    task = new_task(store)
    store.publish_heartbeat(task, {"turn": 1})
    files = store.task(task)
    with store.read_all():
        record, version = store.get_record(task)
        assert (record, store.read_heartbeat(task)) == ({"state": "queued"}, {"turn": 1})
        assert record is not None
        record["state"] = "mangled"  # each caller's copy is its own
        files.state.write_text('{"state": "done"}')  # another process's writes
        files.heartbeat.write_text('{"turn": 2}')
        assert store.get_record(task) == ({"state": "queued"}, version)
        assert store.read_heartbeat(task) == {"turn": 1}
        with store.read_all():  # an inner block reads what the outer one read
            assert store.get_record(task)[0] == {"state": "queued"}
        store.publish_heartbeat(task, {"turn": 3})
        assert store.read_heartbeat(task) == {"turn": 3}
        store.cas_record(task, store.record_version(task), {"state": "running"})
        assert store.get_record(task)[0] == {"state": "running"}
    files.state.write_text('{"state": "done"}')
    files.heartbeat.write_text('{"turn": 4}')
    assert store.get_record(task)[0] == {"state": "done"}  # outside a block: read as ever
    assert store.read_heartbeat(task) == {"turn": 4}
    with store.read_all():
        assert store.get_record(task)[0] == {"state": "done"}
