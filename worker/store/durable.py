"""Every durable write in agentd goes through this module.

* ``atomic_write`` replaces a file as a whole: a temp file in the same directory, write,
  fsync, rename over the target, fsync the directory. A reader sees the old bytes or the
  new ones, never a mix, whatever kills the process or the machine.
* ``private_dir`` / ``open_private`` create folders 0700 and files 0600 whatever the umask.
* ``write_exclusive`` creates a file only if it does not exist yet (link(2) of a fully
  written temp file), so two writers racing for one name get exactly one winner.
* ``move_exclusive`` moves a whole folder into place unless its name is taken
  (``renameat2(RENAME_NOREPLACE)``; a plain rename would replace an empty folder).

Reads go through ``open_regular``, which opens with ``O_NONBLOCK`` and then looks at
what it opened (``fstat``): a FIFO, a device or a socket, named on the command line or
planted in the spool, is refused (``NotRegularFileError``) instead of blocking the
reader for ever or feeding it without end.

A failed fsync is never retried on the same data: the error is raised as
``StorageError`` and the caller stops (the page cache may already have dropped the dirty
pages, so a retry could report success for data that never reached the disk).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from worker.errors import StorageError

#: Bytes read at a time from a file that grew while it was read.
READ_CHUNK = 1 << 20

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) as 0700 folders; tighten it if it exists."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        path.chmod(DIR_MODE)
    return path


def open_private(path: Path | str, flags: int, *, dir_fd: int | None = None) -> int:
    """``os.open`` with 0600 whatever the umask, never following a symlink at ``path``
    (relative to the folder open as ``dir_fd``, if given)."""
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE, dir_fd=dir_fd)
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    return fd


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error("fsync of folder", path, exc) from exc
    finally:
        os.close(fd)


def storage_error(what: str, path: Path, exc: OSError) -> StorageError:
    reason = errno.errorcode.get(exc.errno or 0, "error") if exc.errno else "error"
    return StorageError(
        f"{what} {path} failed ({reason}: {exc.strerror}); nothing recorded was changed. "
        "Free space or fix the disk, then the task resumes from what is on disk.",
        exc.errno,
    )


def _write_temp(path: Path, data: bytes, *, durable: bool, dir_fd: int | None = None) -> Path:
    # Unique per call, not just per process: two threads writing the same name must not
    # share (and truncate) one temp file, or the winner of a race could publish the
    # loser's bytes.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    at = tmp.name if dir_fd is not None else tmp
    try:
        fd = open_private(at, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(at, dir_fd=dir_fd)
        raise storage_error("writing", path, exc) from exc
    return tmp


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; with ``durable`` it survives power loss."""
    tmp = _write_temp(path, data, durable=durable)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise storage_error("renaming onto", path, exc) from exc
    if durable:
        fsync_dir(path.parent)


def atomic_write_at(dir_fd: int, name: str, data: bytes, *, shown: Path) -> None:
    """``atomic_write`` (durable) of the entry ``name`` of the folder open as ``dir_fd``.

    The temp file, the rename and the folder's fsync all go through that fd, so a folder
    renamed or swapped for a symlink meanwhile cannot send the bytes anywhere else.
    ``shown`` is the path errors name. A folder at ``name`` raises IsADirectoryError."""
    tmp = _write_temp(Path(name), data, durable=True, dir_fd=dir_fd).name
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, IsADirectoryError):
            raise
        raise storage_error("renaming onto", shown, exc) from exc
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        raise storage_error("fsync of folder", shown.parent, exc) from exc


def write_exclusive(path: Path, data: bytes) -> bool:
    """Durably create ``path`` with ``data`` unless it exists; True if this call created it."""
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise storage_error("creating", path, exc) from exc
    try:
        return write_exclusive_at(dir_fd, path.name, data, shown=path)
    finally:
        os.close(dir_fd)


def write_exclusive_at(dir_fd: int, name: str, data: bytes, *, shown: Path) -> bool:
    """``write_exclusive`` of the entry ``name`` of the folder open as ``dir_fd`` (every
    step through that fd, like ``atomic_write_at``); ``shown`` is the path errors name."""
    tmp = _write_temp(Path(name), data, durable=True, dir_fd=dir_fd).name
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as exc:
        raise storage_error("creating", shown, exc) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        raise storage_error("fsync of folder", shown.parent, exc) from exc
    return True


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


@functools.cache
def _libc() -> Any:
    """The C library (for ``renameat2``), loaded once."""
    import ctypes  # noqa: PLC0415  (only a move needs it: a reader starts without it)

    return ctypes.CDLL(None, use_errno=True)


def move_exclusive(src: Path, dst: Path) -> bool:
    """Move the folder ``src`` to ``dst`` unless ``dst`` exists, then make the move
    durable; True if this call made ``dst``. Both are in one file system. Two callers
    racing for one ``dst`` get exactly one winner: ``renameat2(RENAME_NOREPLACE)``, or
    where the kernel or the file system lacks it, an exclusive ``mkdir`` of ``dst`` that
    the rename then replaces (``dst`` is an empty folder meanwhile)."""
    import ctypes  # noqa: PLC0415  (the same)

    renameat2 = getattr(_libc(), "renameat2", None)
    done = -1
    if renameat2 is not None:
        done = renameat2(
            _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
        )
    if done != 0:
        code = ctypes.get_errno() if renameat2 is not None else errno.ENOSYS
        if code == errno.EEXIST:
            return False
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise storage_error("moving into place", dst, OSError(code, os.strerror(code)))
        try:
            os.mkdir(dst, DIR_MODE)
        except FileExistsError:
            return False
        try:
            os.rename(src, dst)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(dst)
            raise storage_error("moving into place", dst, exc) from exc
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)
    return True


def dump_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON: how agentd stores every record, snapshot and file.
    orjson writes it, twenty times faster than ``json.dumps`` on a turn's record (after
    its fdatasync, the loop's largest cost): the same JSON, byte for byte but for how
    some floats are spelt (``1e-7`` for ``1e-07``). What orjson refuses is written by the
    standard library, as before: an integer past 64 bits, a key that is not a string, and
    what ``json.dumps`` refuses too (a dataclass, a datetime: ``TypeError``). A float
    that is not finite, which no record holds, becomes ``null`` (JSON has no NaN)."""
    import orjson  # noqa: PLC0415  (only a writer needs it: `agentd status` reads, and starts without it)

    # passed through to the standard library, which refuses them, as it always did
    strict = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
    try:
        return orjson.dumps(obj, option=strict)
    except orjson.JSONEncodeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def load_json(data: bytes | str) -> Any:
    """The value of JSON ``data``; ``ValueError`` if it is none. Read by the standard
    library: orjson reads an integer past 64 bits as a float, and what agentd stored
    must come back as it was (on a long transcript, the two read about as fast)."""
    return json.loads(data)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write(path, dump_json(obj), durable=durable)


class NotRegularFileError(OSError):
    """A path that names a FIFO, a device or a socket where a file was expected; its
    ``strerror`` says which (``"a FIFO, not a regular file"``)."""


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _not_regular(path: Path | str, mode: int) -> OSError:
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return NotRegularFileError(errno.EINVAL, f"{kind}, not a regular file", str(path))


def open_regular(path: Path | str, *, follow_symlinks: bool = False) -> int:
    """A read-only descriptor of the regular file at ``path``. The open never blocks
    (``O_NONBLOCK``: a FIFO opens at once, and is then refused); anything but a regular
    file raises ``NotRegularFileError`` (``IsADirectoryError`` for a folder). A symlink
    at ``path`` is followed only when ``follow_symlinks`` (a file an operator names, not
    one of the spool's)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: a socket cannot be opened at all
            raise
        try:
            mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
        except OSError:
            raise exc from None
        raise _not_regular(path, mode) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    return fd


def read_regular(
    path: Path | str, limit: int | None = None, *, follow_symlinks: bool = False
) -> bytes:
    """The bytes of the regular file at ``path`` (``open_regular``), at most ``limit`` + 1
    of them when ``limit`` is given, so that the caller can tell a file past its cap."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        want = math.inf if limit is None else limit + 1
        # its size and one byte more, in one read: a short read of a regular file is its
        # end (no buffered file object: the daemon reads a heartbeat so at each check)
        size = os.fstat(fd).st_size
        asked = int(min(want, size + 1))
        chunks = [os.read(fd, asked)]
        got = len(chunks[0])
        # on: it grew meanwhile, or a read came back short before its size (FUSE, NFS)
        while got < want and chunks[-1] and (len(chunks[-1]) == asked or got < size):
            asked = int(min(want - got, READ_CHUNK))
            chunks.append(os.read(fd, asked))
            got += len(chunks[-1])
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_bytes(path: Path) -> bytes:
    """A spool file's bytes, never through a symlink at ``path``, never from anything but
    a regular file; errors are the caller's."""
    return read_regular(path)


def read_json(path: Path) -> Any:
    """Read a JSON file written by ``atomic_write_json``; errors are the caller's to name."""
    return load_json(read_bytes(path))
