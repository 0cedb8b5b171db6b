"""The running daemon's answer to ``agentd status --json`` (``supervisor.ask``, which
says when a command asks): a Unix socket in the spool, ``status.sock``, served by a
thread of the daemon. A role of the daemon (``supervisor.surfaces``).

The answer is the status document (docs/design.md section 3) as the command line prints
it, read by the same code (``overview.status_document``), with one difference: a task's
row is kept from one answer to the next while the task's files stay as they were
(``RowCache``), as the store's ``rest_mark`` tells: on the spool's files, the inode, size
and change time of the task folder (every file of a task but the journal and its events
is replaced whole, by a rename, or made new), of its ``decisions/`` (decisions and budget
changes are new files there), its events and its journal. The store gives no mark while
any of them changed within a tick of the file clock of the moment asked (the moment is
the socket's own change time, set now: the clock the files' times are on, whatever the
daemon's own says), since a change in the same tick as the one before it would leave the
time as it was. A row is kept only when it follows from the files alone
(``status.status_row_of``: not while a worker runs the task, whose heartbeat's age moves
on by itself, and not a task of `agentd run`, whose run is alive or not by a lock). The
list of tasks, the daemon's own block and every other row are read again for each
answer.

The socket is the spool's (0700), and a peer of another user is refused all the same.
The daemon answers only for its own files: on a shared store the command line reads the
cluster itself, and a command that would read another config (another price table) or
name the spool by another path is told no, and reads the files itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.ask import ASK, OK, SOCKET
from supervisor.overview import RowReader, status_document
from supervisor.status import status_row_of
from supervisor.stores import store_of
from worker.budget import Price
from worker.config import Config
from worker.paths import CONFIG_FILE_LIMIT
from worker.spool import Spool, TaskDir

#: The longest question: the config file at its limit, the spool's path and the rest.
QUESTION_LIMIT = CONFIG_FILE_LIMIT + 64 * 1024
#: How long a command may take to ask before it is dropped.
QUESTION_TIMEOUT = 2.0


class RowCache:
    """Each task's status row, kept while its files stay as they were (module docstring).
    ``reader()`` is an answer's ``overview.RowReader``; ``clock``: now on the file clock,
    in ns."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self.clock = clock
        self._rows: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {}
        self._prices: Mapping[str, Price] | None = None
        self.read = 0  # rows read from the files, for the tests and the bench
        self.kept = 0  # rows answered from what was kept

    def reader(self) -> RowReader:
        """The row reader of one answer: the file clock read once for all its rows. A
        clock read before a row only makes more of its files look fresh (read, not kept)."""
        now = self.clock()
        return lambda task, prices: self.row(task, prices, now)

    def row(
        self, task: TaskDir, prices: Mapping[str, Price], now: int | None = None
    ) -> dict[str, Any]:
        if prices != self._prices:  # a reload that changed the price table
            self._rows.clear()
            self._prices = prices
        store = store_of(task)
        now = self.clock() if now is None else now
        mark = store.rest_mark(task.id, now)
        kept = self._rows.pop(task.id, None)
        if mark is not None and kept is not None and kept[0] == mark:
            self._rows[task.id] = kept
            self.kept += 1
            return kept[1]
        row, by_files = status_row_of(task, prices)
        self.read += 1
        if mark is not None and by_files and store.rest_mark(task.id, now) == mark:
            self._rows[task.id] = (mark, row)  # (nothing changed while it was read)
        return row

    def forget(self, kept: set[str]) -> None:
        """Drop the rows of every task but ``kept`` (the tasks there are)."""
        for task_id in self._rows.keys() - kept:
            del self._rows[task_id]


class StatusSocket:
    """``SPOOL/status.sock``: the status document for a command that asks
    (``supervisor.ask``), read with a ``RowCache`` on a thread of its own."""

    def __init__(
        self, spool: Spool, config: Callable[[], Config], accepted: Callable[[], bytes | None]
    ) -> None:
        self.spool = spool
        self.config = config  # the daemon's config now (a reload changes it)
        self.accepted = accepted  # the bytes of the config file it accepted (none: b"")
        self.cache = RowCache(self._file_clock)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return str(self.spool.root / SOCKET)

    def _file_clock(self) -> int:
        """Now, as the file system stamps a change: the socket's times set to now, and its
        change time read back. The task files' times are on that clock, whatever the
        daemon's own says (a faked or stepped one); 0 when it cannot be read, and then
        every mark is a fresh one (no row is kept)."""
        try:
            os.utime(self.path)
            return os.stat(self.path).st_ctime_ns
        except OSError:
            return 0

    def start(self) -> None:
        """Bind and serve. The socket is bound through the folder's descriptor, so that a
        spool's path of any length has one (a socket's own path is at most 107 bytes);
        OSError (a read-only spool, say) is the caller's to report."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale one: the daemon's lock says none serves here
        folder = os.open(self.spool.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(f"/proc/self/fd/{folder}/{SOCKET}")
            os.chmod(self.path, 0o600)
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        finally:
            os.close(folder)
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, name="status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _serve(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the daemon stops
                return
            with conn, contextlib.suppress(OSError):
                try:
                    self._reply(conn)
                except Exception as exc:  # never the end of the answers: the CLI reads files
                    conn.sendall(f"no: {type(exc).__name__}\n".encode())

    def _reply(self, conn: socket.socket) -> None:
        _pid, uid, _gid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
        if uid not in (os.getuid(), 0):
            conn.sendall(b"no: another user\n")
            return
        conn.settimeout(QUESTION_TIMEOUT)
        chunks, size = [], 0
        while chunk := conn.recv(1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > QUESTION_LIMIT:
                conn.sendall(b"no: too long\n")
                return
        conn.sendall(self.answer(b"".join(chunks)))

    def answer(self, question: bytes) -> bytes:
        """``OK`` and the document with its newline, as `agentd status --json` prints it,
        or a line that says why the command is to read the files itself."""
        if not question.startswith(ASK):
            return b"no: not a question of mine\n"
        spool, named, config = [*question[len(ASK) :].split(b"\n", 2), b"", b""][:3]
        if self.spool.shared is not None:
            return b"no: a shared store\n"
        if os.fsdecode(spool) != str(self.spool.root):
            return b"no: another path\n"
        if config != self.accepted():
            return b"no: another config\n"
        settings = self.config()
        if named != b"1" and settings.spool is not None:
            return b"no: a spool the config names\n"
        with self._lock:
            doc = status_document(self.spool, None, settings.price_table, self.cache.reader())
            self.cache.forget({row["id"] for row in doc["tasks"]})
        return OK + json.dumps(doc, indent=2, default=str).encode() + b"\n"
