"""The daemon's doorbell: ``SPOOL/inbox``, where CLI commands that change a task (submit,
decide, cancel, retry) drop a file (``supervisor.coordination.ring``).

``watch`` empties the folder and calls its ``ring`` once per burst of new entries, with
the tasks they were named for (``Spool.ring``: ``TASK.PID.NS``, or a worker's one file
``TASK.events.0``; a name it cannot read rings for every task). It
reads inotify directly where it can (a descriptor on the daemon's own loop: no thread,
no polling), and falls back to watchfiles (a thread that polls the folder) where inotify
cannot be had. A doorbell is only a hint to look now: the daemon also rescans every
``RESCAN_INTERVAL`` seconds, so a missed one can never strand a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path

from worker.spool import TASK_ID

DEBOUNCE = 0.005  # seconds: a burst of doorbells is one ring
IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100


async def watch(inbox: Path, ring: Callable[[set[str] | None], None]) -> None:
    """Call ``ring`` after each burst of new entries in ``inbox`` (which it removes first)
    with the tasks they named (None: every task), until cancelled. The watch is in place
    after one loop turn: an entry made before that is for the caller's first scan to find."""
    fd = _inotify(inbox)
    if fd is None:  # no inotify to be had: watchfiles (a thread that polls it)
        if "ssl" in sys.modules and sys.modules["ssl"] is None:
            del sys.modules["ssl"]  # kept out by `agentd start`; anyio needs it
        from watchfiles import awatch  # noqa: PLC0415

        async for _changes in awatch(inbox, debounce=50, step=20, recursive=False):
            ring(_drain(inbox))
        return
    loop = asyncio.get_running_loop()
    rung = asyncio.Event()

    def readable() -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: all read
            while os.read(fd, 65536):
                pass
        rung.set()

    loop.add_reader(fd, readable)
    try:
        while True:
            await rung.wait()
            await asyncio.sleep(DEBOUNCE)
            rung.clear()
            ring(_drain(inbox))
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _drain(inbox: Path) -> set[str] | None:
    """Remove every entry of ``inbox``; the tasks they named (None: one named none)."""
    tasks: set[str] | None = set()
    for entry in os.scandir(inbox):
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
        parts = entry.name.rsplit(".", 2)
        if tasks is not None and len(parts) == 3 and TASK_ID.fullmatch(parts[0]):
            tasks.add(parts[0])
        else:
            tasks = None
    return tasks


def _inotify(path: Path) -> int | None:
    """A non-blocking inotify descriptor that reports new entries in ``path``, or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            return None
        mask = IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE
        if int(libc.inotify_add_watch(fd, os.fsencode(path), mask)) < 0:
            os.close(fd)
            return None
    except (OSError, AttributeError):
        return None
    return fd
