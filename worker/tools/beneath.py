"""Opening paths beneath a directory, with no gap between the check and the use.

A ``Root`` is a directory opened once (``O_DIRECTORY | O_NOFOLLOW``). Every path given to
it is resolved from that fd, one component at a time, by the kernel or by hand, and what
comes back is an fd: the file or folder the check passed is the one the caller reads or
writes, whatever another process renames or swaps for a symlink in the meantime.

The semantics are those of ``openat2(2)`` with ``RESOLVE_BENEATH``: ``..`` and symlinks are
followed, and a resolution that would leave the root, at any step, fails with ``Escape``.
One addition: an absolute symlink whose target is inside the root's real path is followed
as the same path relative to the root (the kernel refuses every absolute symlink), so a
link made with an absolute path to a file of the workspace keeps working.

``openat2`` is called through ctypes where the kernel has it (Linux 5.6 and later); a
refusal (``EXDEV``: an absolute symlink, or a real escape) is then settled by the walk,
which is also the whole way on kernels without it: each component opened with
``O_NOFOLLOW`` from the fd of its folder, a symlink read with ``readlink`` and its target
resolved the same way, ``..`` taking the folder fd above, never above the root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import stat
from collections import deque
from pathlib import Path

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
#: the syscall's number, the same on both machines it is known for here (the generic table)
_OPENAT2 = 437
_OPENAT2_KNOWN = platform.machine() in ("x86_64", "aarch64")
_MAX_LINKS = 40  # the kernel's MAXSYMLINKS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Escape(Exception):
    """The path leads out of the root (``..`` above it, or a symlink pointing outside)."""


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_libc = ctypes.CDLL(None, use_errno=True)


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    """The raw syscall; raises OSError with the kernel's errno."""
    tmpfile = getattr(os, "O_TMPFILE", 0)  # (it contains O_DIRECTORY's bit)
    creates = flags & os.O_CREAT or (tmpfile and flags & tmpfile == tmpfile)
    how = _OpenHow(flags, mode if creates else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = int(
        _libc.syscall(
            ctypes.c_long(_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _probe_openat2() -> bool:
    """Whether this kernel (and any seccomp filter around us) lets ``openat2`` run."""
    if not _OPENAT2_KNOWN:
        return False
    try:
        os.close(_openat2(-100, ".", os.O_PATH | os.O_CLOEXEC, 0))  # AT_FDCWD
    except OSError:
        return False
    return True


HAVE_OPENAT2 = _probe_openat2()


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


class Root:
    """A directory opened once; paths resolved beneath it (see the module docstring).

    ``openat2`` chooses the kernel's resolution where it is available (the default, None,
    where the probe found it); False forces the walk.
    """

    def __init__(self, path: str | os.PathLike[str], *, openat2: bool | None = None) -> None:
        self.path = os.path.realpath(path)
        self.fd = os.open(self.path, _DIR_FLAGS)
        self.openat2 = HAVE_OPENAT2 if openat2 is None else openat2 and HAVE_OPENAT2

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """An fd of ``path`` opened with ``flags``; the final symlink, if any, followed.

        Raises ``Escape``, or the OSError of the open (FileNotFoundError, ...)."""
        flags |= os.O_CLOEXEC
        if self.openat2:
            try:
                return _openat2(self.fd, path, flags, mode)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
        dir_fd, name = self.parent(path)
        try:
            return os.open(name or ".", flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def parent(self, path: str, *, create: bool = False) -> tuple[int, str]:
        """The fd of the folder ``path`` ends in (the caller closes it), and the name of
        its last entry there: never a symlink (a final symlink is followed), "" when
        ``path`` names the folder itself. ``create`` makes the missing folders on the way
        (0777 less the umask, like ``mkdir -p``)."""
        head, _, last = path.rstrip("/").rpartition("/")
        if self.openat2 and last not in ("", ".", ".."):
            try:
                dir_fd = _openat2(self.fd, head or ".", os.O_RDONLY | os.O_DIRECTORY, 0)
            except OSError:
                pass  # missing, out, through an absolute link: the walk settles it
            else:
                if not _is_link(dir_fd, last):
                    return dir_fd, last
                os.close(dir_fd)  # a final symlink: followed by the walk
        stack = [os.dup(self.fd)]  # the folders from the root down to the current one
        pending = deque(_parts(path))
        links = 0
        try:
            while pending:
                part = pending.popleft()
                if part == "..":
                    if len(stack) == 1:
                        raise Escape(path)
                    os.close(stack.pop())
                    continue
                target = self._step(stack[-1], part, last=not pending, create=create)
                if isinstance(target, int):
                    stack.append(target)
                    continue
                if target is None:  # the last entry, not a symlink (or missing)
                    return stack.pop(), part
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                if target.startswith("/"):
                    inside = self._relative(target)
                    if inside is None:
                        raise Escape(path)
                    for fd in stack[1:]:
                        os.close(fd)
                    del stack[1:]
                    target = inside
                pending.extendleft(reversed(_parts(target)))
            return stack.pop(), ""
        finally:
            for fd in stack:
                os.close(fd)

    def _step(self, dir_fd: int, name: str, *, last: bool, create: bool) -> int | str | None:
        """One component: the fd of a folder on the way, a symlink's target, or None for
        the last entry when it is not a symlink."""
        if last:
            return _readlink(dir_fd, name) if _is_link(dir_fd, name) else None
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                link = _readlink(dir_fd, name)
                if link is None:
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)) from None
                return link
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)

    def _relative(self, target: str) -> str | None:
        """An absolute symlink target as a path relative to the root, None if outside
        (judged on the text: what follows the root's path is resolved beneath it)."""
        prefix = self.path.rstrip("/") + "/"
        if target.rstrip("/") == self.path:
            return "."
        return target[len(prefix) :] if target.startswith(prefix) else None

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Root({Path(self.path)!s}, fd={self.fd})"


def _is_link(dir_fd: int, name: str) -> bool:
    """Whether the entry ``name`` is a symlink (False if it is missing)."""
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


def _readlink(dir_fd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # not a symlink
            return None
        raise
