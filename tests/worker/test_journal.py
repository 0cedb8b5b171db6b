"""The journal: framing, durable marks, torn-tail cuts (a crash's or a power loss's),
corruption refusal, the version-1 format, storage faults, modes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.faults.common import (
    PAGE,
    Fate,
    after_power_loss,
    run_worker,
    unsynced_pages,
)
from tests.support import scripted_task
from worker.errors import JournalCorruptError, StorageError
from worker.spool import Spool
from worker.store import base as base_module
from worker.store.journal import (
    FRAMINGS,
    JOURNAL_VERSION,
    Journal,
    encode,
    iter_records,
    read_file,
    scan,
)

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike
from worker.protocol import ExitCode

FIXTURES = Path(__file__).parent / "fixtures"
V1_JOURNAL = FIXTURES / "journal-v1"  # a finished 4-turn task, written by the format-1 code


@pytest.fixture
def no_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _records(n: int, size: int = 40) -> list[dict[str, Any]]:
    return [{"k": "turn", "turn": i, "text": f"record {i} " + "x" * size} for i in range(n)]


def _write_journal(path: Path, records: list[dict[str, Any]]) -> list[int]:
    """A journal holding ``records`` after its header; the end offset of every record."""
    journal, replay = Journal.open(path)
    assert [r["k"] for r in replay] == ["header"]  # a new journal hands back its header
    ends = [journal.size]
    with journal:
        for record in records:
            ends.append(journal.append([record]))
    return ends


def _payloads(records: list[dict[str, object]]) -> list[dict[str, object]]:
    return [r for r in records if r["k"] != "header"]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal, replay = Journal.open(path, task="t1")
    assert replay == [{"k": "header", "v": JOURNAL_VERSION, "task": "t1"}]
    records = [*_records(3), {"k": "user", "content": [{"type": "text", "text": "héllo ✓"}]}]
    with journal:
        journal.append(records[:2])  # several records in one write
        end = journal.append(records[2:])
    assert end == path.stat().st_size
    again, replay = Journal.open(path)
    with again:
        assert replay[0] == {"k": "header", "v": JOURNAL_VERSION, "task": "t1"}
        assert replay[1:] == records
        assert again.size == end
        again.append([{"k": "end", "state": "done", "reason": "end_turn"}])
    assert list(iter_records(path))[-1]["k"] == "end"
    assert len(list(iter_records(path))) == len(records) + 2


def test_open_from_an_offset_reads_only_what_follows(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(4))
    journal, replay = Journal.open(path, ends[2])
    with journal:
        assert replay == _records(4)[2:]


def test_truncation_at_every_byte_of_the_last_record(tmp_path: Path) -> None:
    """A torn append: the records before it intact, the partial record never accepted,
    the file cut back to the last whole record and appendable again."""
    records = _records(3, size=200)
    whole = tmp_path / "whole"
    ends = _write_journal(whole, records)
    data = whole.read_bytes()
    start, end = ends[-2], ends[-1]
    path = tmp_path / "journal"
    partial_accepted = earlier_lost = trials = 0
    for cut in range(start, end):
        path.write_bytes(data[:cut])
        assert scan(data[:cut]).good_end == start
        journal, replay = Journal.open(path)
        with journal:
            got = _payloads(replay)
            partial_accepted += len(got) > len(records) - 1
            earlier_lost += got != records[:-1]
            assert path.stat().st_size == start, f"cut at {cut} not trimmed"
            journal.append([{"k": "end", "state": "done", "reason": "x"}])
        after = _payloads(list(iter_records(path)))
        assert after == [*records[:-1], {"k": "end", "state": "done", "reason": "x"}]
        trials += 1
    print(
        f"\njournal torn-tail: {trials} cut offsets, partial records accepted "
        f"{partial_accepted}, earlier records lost {earlier_lost}"
    )
    assert trials == end - start > 200
    assert partial_accepted == 0
    assert earlier_lost == 0


def test_read_only_scan_never_cuts(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(2))
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    result = read_file(path)
    assert result.torn
    assert result.good_end == ends[1]
    assert _payloads([r for r, _ in result.records]) == _records(2)[:1]
    assert path.read_bytes() == data[:-3]


@pytest.mark.parametrize("bit", [0, 3, 7])
def test_bit_flip_in_the_last_record_is_a_torn_tail(tmp_path: Path, bit: int) -> None:
    records = _records(3)
    whole = tmp_path / "whole"
    ends = _write_journal(whole, records)
    data = whole.read_bytes()
    path = tmp_path / "journal"
    for pos in range(ends[-2], ends[-1]):  # length, checksum and payload bytes
        damaged = bytearray(data)
        damaged[pos] ^= 1 << bit
        path.write_bytes(bytes(damaged))
        journal, replay = Journal.open(path)
        journal.close()
        assert _payloads(replay) == records[:-1], f"flip at byte {pos}"
        assert path.stat().st_size == ends[-2]


@pytest.mark.parametrize("victim", [1, 2])
def test_bit_flip_in_a_middle_record_is_corruption(tmp_path: Path, victim: int) -> None:
    records = _records(4)
    whole = tmp_path / "whole"
    ends = _write_journal(whole, records)
    data = whole.read_bytes()
    path = tmp_path / "journal"
    for pos in range(ends[victim - 1], ends[victim]):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(JournalCorruptError, match=f"damaged at byte {ends[victim - 1]}"):
            Journal.open(path)
        with pytest.raises(JournalCorruptError):
            read_file(path)
        assert path.read_bytes() == bytes(damaged), "a corrupt journal must not be modified"


def test_corrupt_header_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    _write_journal(path, _records(2))
    damaged = bytearray(path.read_bytes())
    damaged[10] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalCorruptError, match="will not skip recorded work"):
        Journal.open(path)


def test_zeroed_tail_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(2))
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    journal, replay = Journal.open(path)
    with journal:
        assert _payloads(replay) == _records(2)
        assert path.stat().st_size == ends[-1]
        journal.append([{"k": "user", "content": []}])
    assert len(list(iter_records(path))) == 4


def test_zeroed_page_in_the_middle_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(40))
    data = bytearray(path.read_bytes())
    data[ends[3] : ends[3] + 512] = b"\0" * 512
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError):
        Journal.open(path)


def test_torn_header_of_a_new_journal_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    Journal.open(path)[0].close()
    data = path.read_bytes()
    path.write_bytes(data[:5])
    journal, replay = Journal.open(path, task="t9")
    journal.close()
    assert replay == [{"k": "header", "v": JOURNAL_VERSION, "task": "t9"}]
    assert list(iter_records(path)) == replay


def test_empty_file_gets_a_header(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    path.touch()
    Journal.open(path)[0].close()
    assert list(iter_records(path)) == [{"k": "header", "v": JOURNAL_VERSION}]


def test_a_new_journal_is_whole_from_its_first_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its header is written and synced in a temp file that is renamed into place: a
    crash before the rename leaves no journal, never a blank one (a fresh task), and the
    rename publishes the whole header."""
    path = tmp_path / "journal"
    renamed: list[bytes] = []
    real = os.replace

    def crash(src: str | Path, dst: str | Path) -> None:
        renamed.append(Path(src).read_bytes())
        raise OSError(errno.EIO, "the machine went down")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(StorageError):
        Journal.open(path, task="t1")
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert [scan(data).records[0][0] for data in renamed] == [
        {"k": "header", "v": JOURNAL_VERSION, "task": "t1"}
    ]
    monkeypatch.setattr(os, "replace", real)
    journal, replay = Journal.open(path, task="t1")
    journal.close()
    assert path.read_bytes() == renamed[0] and replay == list(iter_records(path))


def _blank(path: Path, kind: str, whole: bytes) -> None:
    """``path`` made as a lost journal of ``kind``, from the journal ``whole``."""
    header_end = scan(whole).records[0][1]
    blanks = {
        "empty": b"",
        "zeroed": bytes(len(whole)),
        "header-only": whole[:header_end],
        "header-cut": whole[: header_end // 2],
    }
    path.write_bytes(blanks[kind])


@pytest.mark.parametrize("kind", ["empty", "zeroed", "header-only", "header-cut"])
def test_a_journal_shorter_than_its_recorded_progress_is_refused_untouched(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(3))
    _blank(path, kind, path.read_bytes())
    before = path.read_bytes()
    with pytest.raises(JournalCorruptError) as info:
        Journal.open(path, recorded=ends[-1])
    message = str(info.value)
    assert str(path) in message and f"recorded {ends[-1]} bytes" in message
    assert "\n" not in message and "backup" in message
    assert path.read_bytes() == before, "a refusal changes no byte"


@pytest.mark.parametrize("kind", ["empty", "zeroed", "header-only", "header-cut"])
def test_a_blank_journal_without_recorded_progress_is_a_new_one(tmp_path: Path, kind: str) -> None:
    """No progress recorded (a task of an earlier release, whose create could leave a
    blank journal): nothing in it was durable, and it is made whole again, as new."""
    path = tmp_path / "journal"
    _write_journal(path, _records(1))
    _blank(path, kind, path.read_bytes())
    journal, replay = Journal.open(path, task="t1")
    journal.close()
    assert [r["k"] for r in replay] == ["header"]
    assert [r["k"] for r in iter_records(path)] == ["header"] and not read_file(path).torn


def test_a_torn_tail_after_the_recorded_progress_is_cut_as_ever(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(3))
    with open(path, "ab") as f:
        f.write(encode({"k": "turn", "turn": 9})[:7])
    journal, replay = Journal.open(path, recorded=ends[-1])
    journal.close()
    assert len(replay) == 4 and path.stat().st_size == ends[-1]


def test_wrong_header_version_is_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    path.write_bytes(encode({"k": "header", "v": JOURNAL_VERSION + 1}) + encode({"k": "turn"}))
    before = path.read_bytes()
    with pytest.raises(JournalCorruptError) as info:
        Journal.open(path)
    message = str(info.value)
    assert f"format {JOURNAL_VERSION + 1}" in message
    assert f"reads format {JOURNAL_VERSION}" in message
    assert "\n" not in message
    with pytest.raises(JournalCorruptError, match="format"):
        read_file(path)
    assert path.read_bytes() == before


def test_a_journal_without_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    path.write_bytes(encode({"k": "turn", "turn": 1}))
    with pytest.raises(JournalCorruptError, match="does not start with a journal header"):
        Journal.open(path)


def test_failed_fdatasync_is_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    journal.append([{"k": "turn", "turn": 1}])
    calls: list[int] = []
    real = os.fdatasync

    def flaky(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", flaky)
    with journal:
        with pytest.raises(StorageError, match="EIO"):
            journal.append([{"k": "turn", "turn": 2}])
        for _ in range(2):
            with pytest.raises(StorageError):
                journal.append([{"k": "turn", "turn": 3}])
    assert len(calls) == 1, "fdatasync was retried after it failed"
    monkeypatch.undo()
    turns = [r["turn"] for r in iter_records(path) if r["k"] == "turn"]
    assert 3 not in turns  # nothing was written after the failure
    assert turns[0] == 1


def test_failed_write_refuses_further_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    size = journal.size
    real_write = os.write

    def half_then_enospc(fd: int, data: bytes | memoryview) -> int:
        if len(data) > 8:
            return real_write(fd, bytes(data)[:8])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_enospc)
    with journal:
        with pytest.raises(StorageError, match="ENOSPC"):
            journal.append([{"k": "turn", "turn": 1, "pad": "y" * 100}])
        monkeypatch.undo()
        with pytest.raises(StorageError):
            journal.append([{"k": "turn", "turn": 2}])
        assert journal.size == size
    # The next open sees the half-written frame as a torn tail and cuts it.
    again, replay = Journal.open(path)
    again.close()
    assert _payloads(replay) == []
    assert path.stat().st_size == size


def test_oversized_record_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base_module, "MAX_RECORD", 64)  # the one limit, in every backend
    with pytest.raises(StorageError, match="over the 64-byte limit"):
        encode({"k": "result", "content": "z" * 100})


def test_journal_is_private_under_umask_0(tmp_path: Path, no_umask: None) -> None:
    path = tmp_path / "journal"
    Journal.open(path)[0].close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_existing_journal_is_tightened_to_0600(tmp_path: Path, no_umask: None) -> None:
    path = tmp_path / "journal"
    Journal.open(path)[0].close()
    path.chmod(0o644)
    Journal.open(path)[0].close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_journal_refuses_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "journal"
    link.symlink_to(target)
    with pytest.raises(StorageError):
        Journal.open(link)
    assert target.read_bytes() == b""


def test_open_from_an_offset_that_is_not_a_boundary_cuts_nothing(tmp_path: Path) -> None:
    """A stale or damaged snapshot may name any offset: the bytes after it are never
    taken for a torn tail (that would cut recorded work)."""
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(3))
    data = path.read_bytes()
    for start in (ends[-1] - 7, ends[-2] + 3, ends[1] + 1):
        with pytest.raises(JournalCorruptError):
            Journal.open(path, start)
        assert path.read_bytes() == data, f"open at {start} changed the journal"


def test_torn_tail_right_after_an_offset_is_cut_by_a_full_read(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(3))
    path.write_bytes(path.read_bytes()[:-5])  # the last append was torn
    with pytest.raises(JournalCorruptError, match=f"no record starts at byte {ends[-2]}"):
        Journal.open(path, ends[-2])
    journal, replay = Journal.open(path)
    journal.close()
    assert _payloads(replay) == _records(3)[:-1]
    assert path.stat().st_size == ends[-2]


def test_deferred_records_become_durable_with_the_next_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    syncs: list[int] = []
    real = os.fdatasync

    def sync(fd: int) -> None:
        syncs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", sync)
    with journal:
        journal.append([{"k": "result", "call_id": "a"}], sync=False)
        assert syncs == []
        journal.append([{"k": "intent", "call_id": "b"}])  # one sync covers both
        assert len(syncs) == 1
        journal.append([{"k": "result", "call_id": "b"}], sync=False)
        journal.sync_in_background()
        journal.sync_in_background()  # nothing new to sync: no second thread
        journal.sync()  # waits for the background sync, adds none
        assert len(syncs) == 2
    assert [r["call_id"] for r in iter_records(path) if r["k"] != "header"] == ["a", "b", "b"]


def test_a_failed_background_sync_is_never_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    calls: list[int] = []

    def failing(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    journal.append([{"k": "result", "call_id": "a"}], sync=False)
    journal.sync_in_background()
    with pytest.raises(StorageError, match="EIO"):
        journal.append([{"k": "intent", "call_id": "b"}])
    with pytest.raises(StorageError):
        journal.sync()
    journal.close()  # best effort, and still no second fdatasync
    assert len(calls) == 1


def test_background_syncs_share_one_thread_that_ends_with_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[str] = []
    real = os.fdatasync

    def sync(fd: int) -> None:
        syncs.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", sync)

    def sync_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "journal-sync"]

    journal, _ = Journal.open(tmp_path / "journal")
    before = syncs.count("journal-sync")
    for i in range(50):
        journal.append([{"k": "result", "call_id": str(i)}], sync=False)
        journal.sync_in_background()
        assert len(sync_threads()) == 1
    journal.append([{"k": "intent", "call_id": "x"}])  # waits for the last background one
    assert syncs.count("journal-sync") - before == 50
    journal.close()
    assert sync_threads() == []


def test_held_records_ride_on_the_next_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    writes: list[int] = []
    real = os.write

    def write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    size = journal.size
    journal.hold([{"k": "turn", "turn": 1}])
    assert writes == [] and path.stat().st_size == size == journal.size  # not on disk yet
    journal.append([{"k": "intent", "call_id": "a"}])
    assert len(writes) == 1, "the held turn and the intent are one write"
    assert [r["k"] for r in iter_records(path)] == ["header", "turn", "intent"]
    journal.hold([{"k": "turn", "turn": 2}])
    journal.close()  # close writes (and syncs) what is held
    assert [r["k"] for r in iter_records(path)][-1] == "turn"


def test_held_records_are_lost_by_a_kill_and_nothing_else_is(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    journal.append([{"k": "result", "call_id": "a"}], sync=False)
    journal.hold([{"k": "turn", "turn": 2}])
    os.close(journal._fd)  # the process dies: what was written stays, what was held is gone
    assert [r["k"] for r in iter_records(path)] == ["header", "result"]


# -- durable marks and power loss -------------------------------------------------------


def _marks(data: bytes) -> list[int | None]:
    """The durable mark of every frame of a journal (None: the header, which has none)."""
    marks: list[int | None] = []
    pos = 0
    for record, end in scan(data).records:
        framing = FRAMINGS[1] if record["k"] == "header" else FRAMINGS[JOURNAL_VERSION]
        found = framing.frame_at(data, pos)
        assert found is not None
        marks.append(found[2])
        pos = end
    return marks


@contextlib.contextmanager
def observed_syncs() -> Iterator[list[int]]:
    """The file size at every fdatasync that returned (any thread): what was durable."""
    sizes: list[int] = []
    real = os.fdatasync

    def observed(fd: FileDescriptorLike) -> None:  # os.fdatasync's own signature
        size = os.fstat(fd if isinstance(fd, int) else fd.fileno()).st_size
        real(fd)
        sizes.append(size)

    os.fdatasync = observed
    try:
        yield sizes
    finally:
        os.fdatasync = real


@pytest.fixture
def synced() -> Iterator[list[int]]:
    with observed_syncs() as sizes:
        yield sizes


def _big(name: str, size: int = PAGE) -> dict[str, object]:
    return {"k": "result", "call_id": name, "content": "r" * size}


def test_marks_claim_only_what_was_synced_before_the_write(
    tmp_path: Path, synced: list[int]
) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    header_end = journal.size
    with journal:
        journal.hold([{"k": "turn", "turn": 1}])
        after_intent = journal.append([{"k": "intent", "call_id": "a"}])  # one write, one sync
        after_result = journal.append([_big("a", 10)], sync=False)
        journal.sync_in_background()
        journal.append([{"k": "intent", "call_id": "b"}], sync=False)  # waits for it first
        journal.append([{"k": "user", "content": []}])
    assert synced[:1] == [after_intent]  # (the header was synced whole, before its rename)
    assert _marks(path.read_bytes()) == [
        None,  # the header: a version-1 frame
        header_end,  # the turn and its intent: their own sync is not theirs to claim
        header_end,
        after_intent,  # the result, written after the intent's sync
        after_result,  # the background sync had returned before this write
        after_result,  # not synced before it
    ]


def test_a_lost_unsynced_page_before_a_kept_frame_is_a_torn_tail(
    tmp_path: Path, synced: list[int]
) -> None:
    """The power-loss case of a tool turn: a result written without a sync, the next
    intent written after it, and only the page holding the intent reached the disk."""
    path = tmp_path / "journal"
    ends = _write_journal(path, _records(3))
    journal, _ = Journal.open(path)
    with journal:
        journal.append([_big("a", 2 * PAGE)], sync=False)
        journal.append([{"k": "intent", "call_id": "b"}], sync=False)
        data = path.read_bytes()
    durable = max(synced[:-1])  # the last fdatasync is close()'s, after the power loss
    assert durable == ends[-1]
    pages = unsynced_pages(len(data), durable)
    lost = after_power_loss(data, durable, [Fate.ZERO] * (len(pages) - 1) + [Fate.KEEP])
    assert scan(lost[durable:], base=durable).records == []  # damage first...
    assert FRAMINGS[2].frame_at(lost, len(data) - len(encode({"k": "intent", "call_id": "b"})))
    path.write_bytes(lost)  # ...and a whole frame after it
    assert read_file(path).good_end == durable  # status and history read it, and cut nothing
    assert path.read_bytes() == lost
    journal, replay = Journal.open(path)
    with journal:
        assert _payloads(replay) == _records(3)
        assert path.stat().st_size == durable, "the unsynced bytes are cut"
        assert journal.append([{"k": "user", "content": []}]) > durable
    assert _marks(path.read_bytes())[-1] == durable, "the cut was synced: the next mark says so"


def test_damage_before_a_durable_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    with journal:
        start = journal.size
        journal.append([_big("a", 2 * PAGE)])  # synced: the next frame's mark covers it
        journal.append([{"k": "intent", "call_id": "b"}], sync=False)
    data = bytearray(path.read_bytes())
    data[start + 100 : start + 100 + PAGE] = bytes(PAGE)  # a synced page zeroed
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError, match=f"damaged at byte {start} with intact"):
        Journal.open(path)
    assert path.read_bytes() == bytes(data), "a refused journal is never changed"


def test_a_crash_loses_nothing_written_and_the_next_writer_claims_only_its_syncs(
    tmp_path: Path, synced: list[int]
) -> None:
    """A killed writer's unsynced bytes are in the page cache: the next open reads them
    whole, and they become durable with its first sync, not before."""
    path = tmp_path / "journal"
    journal, _ = Journal.open(path)
    header_end = journal.size  # synced whole before the journal was renamed into place
    journal.append([_big("a", 10)], sync=False)
    os.close(journal._fd)  # killed before any sync of its result
    crashed_size = path.stat().st_size
    again, replay = Journal.open(path)
    with again:
        assert [r["k"] for r in replay] == ["header", "result"]
        after_intent = again.append([{"k": "intent", "call_id": "b"}])
        again.append([{"k": "user", "content": []}])
    assert after_intent > crashed_size
    assert _marks(path.read_bytes())[-3:] == [header_end, header_end, after_intent]


_SIZES = st.sampled_from([1, 200, PAGE - 100, PAGE + 300, 2 * PAGE]) | st.integers(1, 9000)
_OPS = st.tuples(st.sampled_from(["sync", "defer", "background", "hold"]), _SIZES)
_UNSYNCED = st.tuples(st.sampled_from(["defer", "hold"]), _SIZES)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    ops=st.builds(
        lambda head, tail: head + tail,  # anything, then the unsynced writes a power loss hits
        st.lists(_OPS, max_size=8),
        st.lists(_UNSYNCED, min_size=1, max_size=4),
    ),
    fates=st.lists(st.sampled_from(list(Fate)), min_size=12, max_size=12),
)
@example(ops=[("defer", 2 * PAGE), ("defer", 200)], fates=[Fate.ZERO] + [Fate.KEEP] * 11)
def test_a_power_loss_loses_only_unsynced_records_and_never_fails_the_open(
    tmp_path_factory: pytest.TempPathFactory,
    ops: list[tuple[str, int]],
    fates: list[Fate],
) -> None:
    """Any mix of synced, deferred, background-synced and held appends, then a power loss
    that keeps every synced byte and keeps, zeroes or drops each later page: the journal
    opens, every record synced is there, and the cut is at or after the synced size."""
    path = tmp_path_factory.mktemp("power") / "journal"
    with observed_syncs() as sizes:
        journal, _ = Journal.open(path)
        sizes.append(journal.size)  # the header, synced before its rename
        for n, (how, size) in enumerate(ops):
            record = {"k": "result", "call_id": str(n), "content": "x" * size}
            if how == "hold":
                journal.hold([record])
            else:
                journal.append([record], sync=how == "sync")
            if how == "background":
                journal.sync_in_background()
        journal.append([], sync=False)  # waits for a background sync still running
        data, durable = path.read_bytes(), max(sizes)
        journal.close()
    starts = [0, *(end for _, end in scan(data).records)][1:-1]
    marks = [m for m in _marks(data) if m is not None]
    assert marks == sorted(marks), "durable marks only grow"
    assert all(m <= start for m, start in zip(marks, starts, strict=True))
    pages = unsynced_pages(len(data), durable)
    lost = after_power_loss(data, durable, (fates * 4)[: len(pages)])
    kept = [r for r, end in scan(data).records if end <= durable]
    path.write_bytes(lost)
    again, replay = Journal.open(path)
    again.close()
    assert replay[: len(kept)] == kept
    assert path.stat().st_size >= durable


# -- the version-1 format ----------------------------------------------------------------


def test_a_version_1_journal_opens_and_keeps_its_format(tmp_path: Path) -> None:
    original = V1_JOURNAL.read_bytes()
    found = scan(original)
    assert found.version == 1 and not found.torn
    assert [r["k"] for r, _ in found.records][-2:] == ["turn", "end"]
    path = tmp_path / "journal"
    path.write_bytes(original)
    journal, replay = Journal.open(path)
    with journal:
        assert journal.version == 1
        assert replay == [r for r, _ in found.records]
        journal.append([{"k": "user", "content": []}])
    data = path.read_bytes()
    assert data[: len(original)] == original
    assert data[len(original) :] == encode({"k": "user", "content": []}, version=1)


def test_a_version_1_journal_keeps_the_version_1_rules(tmp_path: Path) -> None:
    """No marks: a torn tail is cut as before, and any whole frame after damage is
    corruption, as the release that wrote it would decide."""
    original = V1_JOURNAL.read_bytes()
    ends = [end for _, end in scan(original).records]
    path = tmp_path / "journal"
    path.write_bytes(original[:-5])
    journal, replay = Journal.open(path)
    journal.close()
    assert replay[-1]["k"] == "turn" and path.stat().st_size == ends[-2]
    damaged = bytearray(original)
    damaged[ends[-3] + 20] ^= 0x04  # the last turn, followed by the end record
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalCorruptError, match=f"damaged at byte {ends[-3]}"):
        Journal.open(path)
    assert path.read_bytes() == bytes(damaged)


def test_a_version_1_task_resumes_on_a_real_worker(tmp_path: Path) -> None:
    """The fixture's task stopped after its second turn (as the earlier release left it),
    resumed by this release's worker: nothing before is changed, the new records are
    version-1 frames, and the task finishes."""
    original = V1_JOURNAL.read_bytes()
    found = scan(original).records
    second = max(i for i, (r, _) in enumerate(found) if r["k"] == "turn" and r["turn"] == 2)
    stop = next(end for r, end in found[second + 1 :] if r["k"] == "result")
    script = json.loads((FIXTURES / "journal-v1.script.json").read_text())
    task = scripted_task(Spool(tmp_path / "spool").ensure(), script["responses"], name="t1")
    task.journal.write_bytes(original[:stop])
    done = run_worker(task)
    assert done.code == ExitCode.DONE, done.stderr
    data = task.journal.read_bytes()
    assert data[:stop] == original[:stop]
    after = scan(data)
    assert after.version == 1 and not after.torn
    assert [r["k"] for r, _ in after.records][-1] == "end"
    turns = [r["turn"] for r, _ in after.records if r["k"] == "turn"]
    assert turns == [1, 2, 3, 4]
