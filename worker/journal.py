"""The append-only journal: the durable source of truth of one task.

Format (version ``JOURNAL_VERSION``)::

    frame   = length:u32le  crc:u32le  payload[length]
    crc     = crc32(length:u32le || payload)
    payload = UTF-8 JSON object with a "k" (kind) field; the first is
              {"k": "header", "v": JOURNAL_VERSION}

Reading classifies the bytes after the last good frame. A frame that is short, has a
zero or overlong length, fails its checksum or is not a JSON object is *damage*. When a
well-formed frame can be found anywhere after the damage, the damage is in the middle
of the journal: ``JournalCorruptError``, and nothing after it is ever skipped to. When
none can, it is a torn tail (an append the machine did not finish) and ``Journal.open``
cuts it before anything new is appended.

Each ``append`` is one ``write`` of whole frames, followed by ``fdatasync`` unless the
caller defers it: a deferred record becomes durable with the next synced append, with
``sync()``, with ``close()``, or in the background (``sync_in_background``: the sync runs
on the journal's one sync thread while the worker waits on the model, and the next append
waits for it first). A killed
process loses nothing written (the page cache survives it); only a machine crash can
lose a deferred record, and only until its sync. After a failed write or sync the journal
refuses further appends (the sync is never retried on the same data); the worker stops
and the next open reads what the disk really holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.durable import dump_json, fsync_dir, open_private, storage_error
from worker.errors import JournalCorruptError, SpoolError, StorageError

JOURNAL_VERSION = 1
MAX_RECORD = 64 * 1024 * 1024
_HEAD = struct.Struct("<II")

Record = dict[str, Any]


def encode(record: Record) -> bytes:
    payload = dump_json(record)
    length = len(payload)
    if length > MAX_RECORD:
        raise StorageError(
            f"a journal record of {length} bytes is over the {MAX_RECORD}-byte limit; "
            "shorten the tool result or message that produced it."
        )
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<I", length)))
    return _HEAD.pack(length, crc) + payload


def _frame_at(data: bytes | memoryview, pos: int) -> tuple[Record, int] | None:
    """The record starting at ``pos`` and the offset after it, or None if it is not valid."""
    if pos + _HEAD.size > len(data):
        return None
    length, crc = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + length
    if length == 0 or length > MAX_RECORD or end > len(data):
        return None
    payload = bytes(data[pos + _HEAD.size : end])
    if zlib.crc32(payload, zlib.crc32(struct.pack("<I", length))) != crc:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("k"), str):
        return None
    return record, end


@dataclass(frozen=True)
class Scan:
    """What a byte string holds: its good records (with their end offsets) and the rest."""

    records: list[tuple[Record, int]]
    good_end: int
    size: int

    @property
    def torn(self) -> bool:
        return self.good_end < self.size


def scan(data: bytes | memoryview, start: int = 0, *, name: str = "journal") -> Scan:
    """Parse frames from ``start``; raise ``JournalCorruptError`` on damage before the tail."""
    records: list[tuple[Record, int]] = []
    pos = start
    while (found := _frame_at(data, pos)) is not None:
        record, pos = found
        records.append((record, pos))
    if pos < len(data):
        for probe in range(pos + 1, len(data) - _HEAD.size):
            if _frame_at(data, probe) is not None:
                raise JournalCorruptError(
                    f"{name} is damaged at byte {pos} with intact records after it; "
                    "agentd will not skip recorded work. Restore the task folder from a "
                    "backup or fork the task from an earlier turn."
                )
    return Scan(records, pos, len(data))


def read_file(path: Path, start: int = 0) -> Scan:
    """Read-only scan of a journal file (for status and history); never modifies it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a symlink (never followed), a folder...
        raise SpoolError(
            f"{path} cannot be read as a journal ({exc.strerror}); it must be a regular file "
            "in the task folder."
        ) from None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    result = scan(data, start, name=str(path))
    _check_header(path, result, start)
    return result


def _check_header(path: Path, result: Scan, start: int) -> None:
    if start != 0 or not result.records:
        return
    head = result.records[0][0]
    if head.get("k") != "header":
        raise JournalCorruptError(f"{path} does not start with a journal header; it is not ours.")
    if head.get("v") != JOURNAL_VERSION:
        raise JournalCorruptError(
            f"{path} is journal format {head.get('v')!r}, this agentd reads format "
            f"{JOURNAL_VERSION}; run the agentd version that wrote it."
        )


class Journal:
    """An open journal, positioned at its end, ready to append."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self._fd = fd
        self.size = size
        self._broken: StorageError | None = None
        self._dirty = False  # bytes written since the last fdatasync
        self._held = b""  # encoded records the next write carries (``hold``)
        self._syncer: _SyncThread | None = None  # started by the first background sync

    @classmethod
    def open(cls, path: Path, start: int = 0, **header: Any) -> tuple[Journal, list[Record]]:
        """Open (creating it with a header if absent), cut a torn tail, return the records
        from ``start`` on. ``header`` fields are added to a new journal's header record."""
        created = not path.exists()
        try:
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        except OSError as exc:
            raise storage_error("opening", path, exc) from exc
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                f.seek(start)
                data = f.read()
            result = scan(data, 0, name=str(path))
            if start and result.torn and not result.records:
                # Nothing whole starts at ``start``: it is not a record boundary (a
                # stale or damaged snapshot), so the bytes after it are not known to
                # be a torn tail. Never cut them; the caller reads from the start.
                raise JournalCorruptError(
                    f"{path}: no record starts at byte {start}; read the journal from its start."
                )
            _check_header(path, result, start)
            journal = cls(path, fd, start + result.good_end)
            if result.torn:
                journal._cut(start + result.good_end)
            if created or journal.size == 0:
                if created:
                    fsync_dir(path.parent)
                first = {"k": "header", "v": JOURNAL_VERSION, **header}
                journal.append([first])
                return journal, [first]
        except BaseException:
            os.close(fd)
            raise
        return journal, [record for record, _ in result.records]

    def _cut(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as exc:
            raise storage_error("cutting the torn tail of", self.path, exc) from exc

    def hold(self, records: Iterable[Record]) -> None:
        """Keep ``records`` in memory, to be written in the same write as the next append
        (or by ``sync``, ``sync_in_background`` or ``close``). A kill loses them: only for
        records whose loss is harmless, like a turn none of whose tools has started (the
        model is asked again)."""
        self._held += b"".join(encode(r) for r in records)

    def append(self, records: Iterable[Record], *, sync: bool = True) -> int:
        """Append the held records and ``records`` as one write; with ``sync``, durable
        (with every deferred record before them) when this returns. Returns the journal
        size after them."""
        self._join()
        data = self._held + b"".join(encode(r) for r in records)
        self._held = b""
        if data:
            self._write(data)
        if sync and self._dirty:
            self._sync_now()
        return self.size

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._broken = storage_error("appending to", self.path, exc)
            raise self._broken from exc
        self.size += len(data)
        self._dirty = True

    def sync(self) -> None:
        """Make every record written or held so far durable."""
        self.append([], sync=False)
        if self._dirty:
            self._sync_now()

    def sync_in_background(self) -> None:
        """Start making what was written (or held) durable, without waiting for it."""
        self.append([], sync=False)
        if not self._dirty:
            return
        self._dirty = False
        if self._syncer is None:
            self._syncer = _SyncThread(self._fd)
        self._syncer.request()

    def _sync_now(self) -> None:
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._broken = storage_error("syncing", self.path, exc)
            raise self._broken from exc
        self._dirty = False

    def _join(self) -> None:
        """Wait for a background sync; raise if it (or anything before) failed."""
        if self._syncer is not None:
            failure = self._syncer.wait()
            if failure is not None:
                self._broken = storage_error("syncing", self.path, failure)
        if self._broken is not None:
            raise self._broken

    def close(self) -> None:
        """Sync what is still deferred (best effort: a failure was already reported or
        will be found on the next open) and close."""
        if self._fd < 0:
            return
        with contextlib.suppress(StorageError):
            self.sync()
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SyncThread:
    """One thread per open journal that runs the fdatasyncs asked for in the background,
    one at a time; ``wait`` returns once the last one asked for is done (with its error,
    which is reported once: the journal refuses appends from then on)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._failure: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="journal-sync", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._done.clear()
        self._asks.put(True)

    def wait(self) -> OSError | None:
        self._done.wait()
        failure, self._failure = self._failure, None
        return failure

    def stop(self) -> None:
        self._asks.put(False)
        self._thread.join()

    def _run(self) -> None:
        while self._asks.get():
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                self._failure = exc
            finally:
                self._done.set()


def iter_records(path: Path) -> Iterator[Record]:
    for record, _ in read_file(path).records:
        yield record
