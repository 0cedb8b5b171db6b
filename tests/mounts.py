"""Small filesystems for storage-fault tests: a tmpfs that fills up, a spool made read-only.

Mounting needs root (CAP_SYS_ADMIN). ``tmpfs`` raises ``MountRefused`` with mount's own
one-line reason where it is refused, so a test can skip saying why, and a chaos class can
print it in its row instead of pretending it ran.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def mount(*args: str) -> str | None:
    """Run mount(8); None when it worked, else why not (one line)."""
    try:
        done = subprocess.run(
            ["mount", *args], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:  # no mount(8) at all
        return f"mount: {exc.strerror}"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[0]


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[None]:
    """A tmpfs of ``size_mb`` MiB mounted on ``path`` inside the block (and every mount
    stacked on it, unmounted after)."""
    path.mkdir(parents=True, exist_ok=True)
    refused = mount("-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path))
    if refused is not None:
        raise MountRefused(refused)
    try:
        yield
    finally:
        for _ in range(10):  # the bind mount of the read-only phase, then the tmpfs
            if not os.path.ismount(path):
                break
            done = subprocess.run(["umount", str(path)], capture_output=True, check=False)
            if done.returncode != 0:  # busy: detach it now, it goes once unused
                subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


class MountRefused(Exception):
    """mount(8) refused (not root, no CAP_SYS_ADMIN, a container): the reason is its line."""


def fill(path: Path) -> int:
    """Write ``path`` until the disk refuses more; the bytes it took."""
    chunk = b"\0" * (1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                n = os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return written
                chunk = chunk[: len(chunk) // 2]  # fill the last pages too
                continue
            written += n
    finally:
        os.close(fd)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[str]:
    """The spool read-only inside the block; yields how (``remount`` or ``bind``)."""
    if mount("-o", "remount,ro", str(path)) is None:
        try:
            yield "remount"
        finally:
            mount("-o", "remount,rw", str(path))
        return
    refused = mount("--bind", str(path), str(path))
    if refused is None:
        refused = mount("-o", "remount,bind,ro", str(path))
    if refused is not None:
        raise MountRefused(f"a read-only spool: {refused}")
    try:
        yield "bind (remount busy)"
    finally:
        mount("-o", "remount,bind,rw", str(path))


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int = 4) -> Iterator[Path]:
    """``tmpfs`` for a test: skipped, with mount's reason, where mounting is refused."""
    try:
        with tmpfs(path, size_mb):
            yield path
    except MountRefused as exc:
        pytest.skip(f"needs a tmpfs mount (root): {exc}")
