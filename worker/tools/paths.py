"""Confinement of tool paths to the task's workspace.

A path from the model is relative to the workspace. It is refused when it is absolute,
contains NUL, or resolves (following ``..`` and any symlink on the way) outside the
workspace, so a symlink planted inside the workspace that points out of it is refused too.

The file tools resolve a path beneath the workspace's fd (``worker.tools.beneath``) and
use the fd that comes back: nothing is checked by name and then opened by name again, so
a folder swapped for a symlink between the two cannot take a read or a write outside.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from worker.tools.beneath import Escape, Root
from worker.tools.tool import ToolError


def checked(user_path: str) -> str:
    """``user_path`` if it may name something in the workspace at all."""
    if "\0" in user_path:
        raise ToolError("path contains a NUL byte")
    if os.path.isabs(user_path):
        raise ToolError(f"path {user_path!r} is absolute; give a path inside the workspace")
    if os.path.normpath(user_path).split("/", 1)[0] == "..":  # out even before any symlink
        raise ToolError(f"path {user_path!r} escapes the workspace")
    return user_path


def open_beneath(root: Root, user_path: str, flags: int) -> int:
    """An fd of ``user_path`` in the workspace ``root``; the OSError of the open (a
    missing file, a folder where a file was meant) is the caller's to word."""
    with _worded(user_path):
        return root.open(checked(user_path), flags)


def parent_beneath(root: Root, user_path: str) -> tuple[int, str]:
    """The fd of the folder ``user_path`` ends in, its missing folders created, and the
    name of the file there (see ``Root.parent``); refused when it names a folder."""
    last = checked(user_path).rstrip("/").rsplit("/", 1)[-1]
    if os.path.normpath(user_path) == ".":
        # Writing "the workspace itself" would put a temp file next to it, outside.
        raise ToolError(f"path {user_path!r} names the workspace itself; give a file path in it")
    if last in (".", "..") or user_path.endswith("/"):
        raise ToolError(f"path {user_path!r} names a folder; give a file path in the workspace")
    with _worded(user_path):
        try:
            dir_fd, name = root.parent(user_path, create=True)
        except NotADirectoryError:
            raise ToolError(f"a folder on the way to {user_path!r} is a file") from None
    if not name:
        os.close(dir_fd)
        raise ToolError(f"path {user_path!r} names a folder; give a file path in the workspace")
    return dir_fd, name


@contextlib.contextmanager
def _worded(user_path: str) -> Iterator[None]:
    """An escape, or a symlink loop, as the one line the model gets."""
    try:
        yield
    except Escape:
        raise ToolError(f"path {user_path!r} escapes the workspace") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ToolError(
            f"path {user_path!r} has too many levels of symlinks (or changed meanwhile)"
        ) from None
