"""The append-only journal: the durable source of truth of one task.

Format (version ``JOURNAL_VERSION``)::

    journal = header frame, then frames
    header  = a version-1 frame of {"k": "header", "v": VERSION, ...}
    frame   = length:u32le  crc:u32le  durable:u64le  payload[length]
    crc     = crc32(length:u32le || durable:u64le || payload)
    payload = UTF-8 JSON object with a "k" (kind) field

Version 1 (journals of earlier releases) has no ``durable`` field: a frame is
``length:u32le crc:u32le payload`` with ``crc = crc32(length:u32le || payload)``. The
header is a version-1 frame in every version, so any release reads which version a journal
is (an older one refuses a newer journal in one line rather than taking its frames for a
torn tail), and its ``v`` names the framing of every frame after it. A journal keeps the
version it was created with: records appended to a version-1 journal are version-1 frames.

``durable`` is the frame's *durable mark*: the journal size that had been made durable
(by an fdatasync that returned, or by the fsync after a cut) before the frame was written.
It never covers the frame itself, nor anything written in the same write (that write's
sync makes them durable; the next frame's mark says so), and it only grows.

Reading classifies the bytes after the last good frame, at offset D. A frame that is
short, has a zero or overlong length, fails its checksum or is not a JSON object is
*damage*. Then every whole frame after D is looked at:

* one whose durable mark is past D proves that the damaged bytes had been synced before
  it was written: no crash or power loss can lose synced bytes, so the damage is
  corruption in the middle of the journal: ``JournalCorruptError``, and nothing after it
  is ever skipped to. A version-1 frame has no mark and counts as proof (the rule of
  version 1: any whole frame after damage is corruption);
* when no frame proves it, nothing from D on was known durable: the bytes are a torn
  tail (an append the machine did not finish, or a power loss that kept a later unsynced
  page and lost an earlier one), and ``Journal.open`` cuts them (truncate + fsync) before
  anything new is appended. Damage to the last synced write is cut the same way when no
  frame was written after its sync, since no byte on disk says it was synced.

A journal is whole from its first byte: its header is written and synced in a temp file,
renamed into place, and the folder synced (``Journal._create``), so no crash leaves one
without its header. A journal whose whole records end before the size its task recorded
as durable (``recorded``: the worker's heartbeat reports it, the daemon's task record
keeps it) lost synced bytes: blanked, zeroed, cut or missing, it is refused, never taken
for a new task whose calls would run again. With nothing recorded (a task of an earlier
release, whose create could leave a blank journal), a journal without a header is made
whole again, as new, as before.

Each ``append`` is one ``write`` of whole frames, followed by ``fdatasync`` unless the
caller defers it: a deferred record becomes durable with the next synced append, with
``sync()``, with ``close()``, or in the background (``sync_in_background``: the sync runs
on the journal's one sync thread while the worker waits on the model, and the next append
waits for it first). A killed process loses nothing written (the page cache survives it);
only a machine crash can lose a deferred record, and only until its sync. After a failed
write or sync the journal refuses further appends (the sync is never retried on the same
data); the worker stops and the next open reads what the disk really holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import JournalCorruptError, SpoolError, StorageError
from worker.records import RecordKind
from worker.store.base import MAX_RECORD, record_bytes
from worker.store.durable import (
    atomic_write,
    load_json,
    open_private,
    open_regular,
    storage_error,
)

JOURNAL_VERSION = 2

Record = dict[str, Any]


@dataclass(frozen=True)
class Framing:
    """How the frames of one journal version are laid out: with a durable mark or not."""

    version: int
    marked: bool

    @property
    def head(self) -> struct.Struct:
        return _MARKED_HEAD if self.marked else _PLAIN_HEAD

    def _crc(self, length: int, durable: int, payload: bytes) -> int:
        covered = _LENGTH_MARK.pack(length, durable) if self.marked else _LENGTH.pack(length)
        return zlib.crc32(payload, zlib.crc32(covered))

    def frame(self, payload: bytes, durable: int) -> bytes:
        length = len(payload)
        crc = self._crc(length, durable, payload)
        if self.marked:
            return _MARKED_HEAD.pack(length, crc, durable) + payload
        return _PLAIN_HEAD.pack(length, crc) + payload

    def frame_at(self, data: bytes | memoryview, pos: int) -> tuple[Record, int, int | None] | None:
        """The record starting at ``pos``, the offset after it and its durable mark (None
        when this framing has none), or None if no valid frame starts there."""
        head = self.head
        if pos + head.size > len(data):
            return None
        fields = head.unpack_from(data, pos)
        length, crc = fields[0], fields[1]
        durable = fields[2] if self.marked else 0
        end = pos + head.size + length
        if length == 0 or length > MAX_RECORD or end > len(data):
            return None
        payload = bytes(data[pos + head.size : end])
        if self._crc(length, durable, payload) != crc:
            return None
        try:
            record = load_json(payload)
        except ValueError:
            return None
        if not isinstance(record, dict) or not isinstance(record.get("k"), str):
            return None
        return record, end, (durable if self.marked else None)


_LENGTH = struct.Struct("<I")
_LENGTH_MARK = struct.Struct("<IQ")
_PLAIN_HEAD = struct.Struct("<II")
_MARKED_HEAD = struct.Struct("<IIQ")

#: Every framing this release reads, by version; the newest is the one new journals get.
FRAMINGS = {1: Framing(1, marked=False), 2: Framing(2, marked=True)}
#: The header record's framing, in every version.
HEADER_FRAMING = FRAMINGS[1]


def encode(record: Record, durable: int = 0, *, version: int = JOURNAL_VERSION) -> bytes:
    """``record`` as a frame of journal ``version`` carrying the durable mark ``durable``
    (a header record is always a version-1 frame)."""
    payload = record_bytes(record)
    framing = HEADER_FRAMING if record.get("k") == RecordKind.HEADER else FRAMINGS[version]
    return framing.frame(payload, durable)


def _framing_at(data: bytes | memoryview, pos: int) -> Framing | None:
    """The framing of the whole frame at ``pos`` (newest first), or None if there is none."""
    for version in sorted(FRAMINGS, reverse=True):
        if FRAMINGS[version].frame_at(data, pos) is not None:
            return FRAMINGS[version]
    return None


@dataclass(frozen=True)
class Scan:
    """What a byte string holds: its good records (with their end offsets) and the rest."""

    records: list[tuple[Record, int]]
    good_end: int
    size: int
    version: int | None = None  # the framing of the records (None: no record was found)
    durable: int = 0  # the last good record's durable mark (0 for version-1 frames)

    @property
    def torn(self) -> bool:
        return self.good_end < self.size


def scan(data: bytes | memoryview, start: int = 0, *, name: str = "journal", base: int = 0) -> Scan:
    """Parse frames from ``start``; raise ``JournalCorruptError`` on damage that a later
    frame's durable mark shows was synced. ``base`` is the journal offset of ``data[0]``
    (durable marks are journal offsets)."""
    records: list[tuple[Record, int]] = []
    durable = 0
    pos = start
    framing = _framing_at(data, pos)
    while framing is not None and (found := framing.frame_at(data, pos)) is not None:
        record, pos, mark = found
        records.append((record, pos))
        durable = mark if mark is not None else durable
        if record["k"] == RecordKind.HEADER:  # it names the framing of what follows it
            version = record.get("v")
            if version not in FRAMINGS:  # a newer agentd's: ``_check_header`` says so
                return Scan(records, pos, len(data))
            framing = FRAMINGS[version]
    if pos < len(data):
        candidates = [framing] if framing is not None else list(FRAMINGS.values())
        proof = _durable_after(data, pos, base, candidates)
        if proof is not None:
            raise JournalCorruptError(
                f"{name} is damaged at byte {base + pos} with intact records after it "
                f"(the record at byte {base + proof} was written after the damaged bytes were "
                "synced); agentd will not skip recorded work. Restore the task folder from a "
                "backup or fork the task from an earlier turn."
            )
    return Scan(records, pos, len(data), framing.version if framing else None, durable)


def _durable_after(
    data: bytes | memoryview, damage: int, base: int, framings: Sequence[Framing]
) -> int | None:
    """The offset (in ``data``) of the first whole frame after ``damage`` whose durable mark
    covers the damaged bytes, or None when every frame after it was written before they
    were synced (or there is none)."""
    smallest = min(f.head.size for f in framings)
    probe = damage + 1
    while probe + smallest < len(data):
        found = None
        for framing in framings:
            if (found := framing.frame_at(data, probe)) is not None:
                break
        if found is None:
            probe += 1
            continue
        _, end, mark = found
        if mark is None or mark > base + damage:
            return probe
        probe = end
    return None


def read_file(path: Path, start: int = 0) -> Scan:
    """Read-only scan of a journal file (for status and history); never modifies it."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a symlink (never followed), a folder...
        raise SpoolError(
            f"{path} cannot be read as a journal ({exc.strerror}); it must be a regular file "
            "in the task folder."
        ) from None
    with os.fdopen(fd, "rb") as f:
        if start == 0:
            data = f.read()
            result = scan(data, name=str(path))
            _check_header(path, result, start)
            return result
        f.seek(start)  # only the bytes after ``start``: frames parse where they stand
        tail = f.read()
    found = scan(tail, name=str(path), base=start)
    return dataclasses.replace(
        found,
        records=[(record, end + start) for record, end in found.records],
        good_end=found.good_end + start,
        size=found.size + start,
    )


def _check_header(path: Path, result: Scan, start: int) -> None:
    if start != 0 or not result.records:
        return
    head = result.records[0][0]
    if head.get("k") != RecordKind.HEADER:
        raise JournalCorruptError(f"{path} does not start with a journal header; it is not ours.")
    if head.get("v") not in FRAMINGS:
        raise JournalCorruptError(
            f"{path} is journal format {head.get('v')!r}, this agentd reads format "
            f"{JOURNAL_VERSION} and earlier; run the agentd version that wrote it."
        )


def refuse_shorter(path: Path, end: int, recorded: int | None) -> None:
    """``JournalCorruptError`` when the whole records of ``path`` end at byte ``end``,
    before ``recorded``, the size a worker reported durable: synced bytes are missing (a
    journal cut, blanked or zeroed), and a replay of what is left would run recorded
    calls again."""
    if recorded is None or end >= recorded:
        return
    where = f"its whole records end at byte {end}" if end else "it holds no whole record"
    raise JournalCorruptError(
        f"{path} is damaged: {where}, but its task recorded {recorded} bytes as durable; "
        "agentd will not run recorded work again. Restore the task folder from a backup, "
        "or check what its calls did and submit the task anew."
    )


class Journal:
    """An open journal, positioned at its end, ready to append."""

    def __init__(self, path: Path, fd: int, size: int, *, version: int, durable: int) -> None:
        self.path = path
        self._fd = fd
        self.size = size
        self.version = version  # the framing of every record appended
        self._durable = durable  # the size known durable: the mark new frames carry
        self._syncing = durable  # the size the background sync in flight makes durable
        self._broken: StorageError | None = None
        self._dirty = False  # bytes written since the last fdatasync
        self._held = b""  # encoded records the next write carries (``hold``)
        self._syncer: _SyncThread | None = None  # started by the first background sync

    @classmethod
    def open(
        cls, path: Path, start: int = 0, *, recorded: int | None = None, **header: Any
    ) -> tuple[Journal, list[Record]]:
        """Open (making it whole with a header if absent), cut a torn tail, return the
        records from ``start`` on. ``header`` fields are added to a new journal's header
        record. ``recorded`` is the journal size a worker reported durable (the task's
        record and heartbeat keep it; None: unknown, a task of an earlier release): a
        journal whose whole records end before it lost synced bytes, and is refused with
        ``JournalCorruptError`` before anything is cut or written."""
        try:
            fd = open_private(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            refuse_shorter(path, 0, recorded)
            return cls._create(path, header)
        except OSError as exc:
            raise storage_error("opening", path, exc) from exc
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                f.seek(start)
                data = f.read()
            result = scan(data, 0, name=str(path), base=start)
            if start and result.torn and not result.records:
                # Nothing whole starts at ``start``: it is not a record boundary (a
                # stale or damaged snapshot), so the bytes after it are not known to
                # be a torn tail. Never cut them; the caller reads from the start.
                raise JournalCorruptError(
                    f"{path}: no record starts at byte {start}; read the journal from its start."
                )
            _check_header(path, result, start)
            refuse_shorter(path, start + result.good_end, recorded)
            if start or result.records:
                version = result.version or JOURNAL_VERSION
                # What the last frame found says was durable; the bytes after that are
                # the dead writer's and become durable with this one's first sync.
                journal = cls(
                    path, fd, start + result.good_end, version=version, durable=result.durable
                )
                if result.torn:
                    journal._cut(start + result.good_end)
                return journal, [record for record, _ in result.records]
        except BaseException:
            os.close(fd)
            raise
        # No header and no progress recorded: a journal of an earlier release, made by a
        # create and a folder sync before its header was written (a power loss between
        # them left it blank). Nothing in it was durable: it is made whole again, as new.
        os.close(fd)
        return cls._create(path, header)

    @classmethod
    def _create(cls, path: Path, header: Mapping[str, Any]) -> tuple[Journal, list[Record]]:
        """A new journal, whole from its first byte: its header written and synced in a
        temp file, renamed into place, the folder synced. No crash leaves a journal
        without its header, so a blank one is always damage."""
        first = {"k": RecordKind.HEADER, "v": JOURNAL_VERSION, **header}
        data = encode(first)
        atomic_write(path, data)
        try:
            fd = open_private(path, os.O_RDWR | os.O_APPEND)
        except OSError as exc:
            raise storage_error("opening", path, exc) from exc
        return cls(path, fd, len(data), version=JOURNAL_VERSION, durable=len(data)), [first]

    @property
    def durable(self) -> int:
        """The journal size known durable, a background sync that returned included (safe
        to read from another thread: the heartbeat's)."""
        if self._syncer is not None and self._syncer.succeeded():
            return self._syncing
        return self._durable

    def _cut(self, size: int) -> None:
        """Truncate a torn tail and make the cut durable: the journal's whole remaining
        size is durable from then on (and later frames' marks say so)."""
        try:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        except OSError as exc:
            raise storage_error("cutting the torn tail of", self.path, exc) from exc
        self._durable = self._syncing = size

    def _encode(self, records: Iterable[Record]) -> bytes:
        return b"".join(encode(r, self._durable, version=self.version) for r in records)

    def hold(self, records: Iterable[Record]) -> None:
        """Keep ``records`` in memory, to be written in the same write as the next append
        (or by ``sync``, ``sync_in_background`` or ``close``). A kill loses them: only for
        records whose loss is harmless, like a turn none of whose tools has started (the
        model is asked again). Their durable mark is the one of now: it can only be lower
        than the one of the write that carries them, never claim too much."""
        self._held += self._encode(records)

    def drop_held(self) -> None:
        """Forget the held records: their writer lost the right to write them."""
        self._held = b""

    def append(self, records: Iterable[Record], *, sync: bool = True) -> int:
        """Append the held records and ``records`` as one write; with ``sync``, durable
        (with every deferred record before them) when this returns. Returns the journal
        size after them."""
        self._join()
        data = self._held + self._encode(records)
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
        self._syncing = self.size
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
        self._durable = self._syncing = self.size

    def _join(self) -> None:
        """Wait for a background sync; raise if it (or anything before) failed. Once it
        has succeeded, what it covered is durable and the next frames' marks say so."""
        if self._syncer is not None:
            failure = self._syncer.wait()
            if failure is not None:
                self._broken = storage_error("syncing", self.path, failure)
        if self._broken is not None:
            raise self._broken
        self._durable = self._syncing

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

    def succeeded(self) -> bool:
        """Whether the last sync asked for has returned without an error."""
        return self._done.is_set() and self._failure is None

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
