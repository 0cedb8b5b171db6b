"""The clocks of chaos class 21 (``tests.chaos.nodes``): what steps a node's wall clock,
the database host's, and what gives one node a monotonic clock of its own.

* ``DatabaseClock``: PostgreSQL runs under libfaketime (``LD_PRELOAD``), its wall clock
  at the offset in a file read at every call (``FAKETIME_NO_CACHE``), its monotonic
  clock left alone (``FAKETIME_DONT_FAKE_MONOTONIC``): a step of the database host's
  clock moves ``now()`` and every timestamp the server writes, at once.
* ``NodeClocks``: each node's daemon, fork server and workers run with their wall clock
  at an offset read from a file of the node's own. libfaketime cannot step a Python
  node (under 0.9.10 ``time.sleep`` fails with EINVAL once the monotonic clock is left
  alone: ``tests.chaos.clock`` says more), so the injected clock of class 19 does it:
  a ``sitecustomize`` on their ``PYTHONPATH`` that moves ``time.time`` and
  ``time.time_ns``, which every stamp of theirs reads.
* ``TimeNamespace``: one node's monotonic and boot-time clocks a day ahead of the
  others' (a time namespace: ``unshare --time``; the kernel cannot step a wall clock in
  one). Its processes enter it by ``setns`` and exec (``enter_argv``), so the daemon's
  pid is the one the harness started.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from supervisor.pgcluster import ThrowawayCluster
from tests.chaos.clock import WALL_SHIM, faketime_env, faketime_library
from tests.support import REPO

#: Seconds a wall-clock step moves a clock (the issue's: two minutes either way).
STEP = 120
#: How far ahead the namespaced node's monotonic clock runs: a day.
DAY = 86400


def _write_offset(path: Path, offset: int) -> None:
    """The offset both shims read, replaced whole (a half-written file is never read)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{offset:+d}\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)


class DatabaseClock:
    """The throwaway server's wall clock, steppable: ``install`` restarts the server under
    libfaketime at offset 0; ``step`` moves it."""

    def __init__(self, db: ThrowawayCluster) -> None:
        library = faketime_library()
        if library is None:
            raise RuntimeError(
                "libfaketime is not installed (apt-get install libfaketime): class 21 steps "
                "the database host's clock with it"
            )
        self.db = db
        self.file = db.root / "faketime"  # (the server's user reads it: its own folder)
        self.offset = 0
        _write_offset(self.file, 0)
        self.env = faketime_env(library, self.file)

    def install(self) -> None:
        self.db.server_env = self.env
        self.db.stop()
        self.db.start()

    def step(self, offset: int) -> None:
        self.offset = offset
        _write_offset(self.file, offset)


class NodeClocks:
    """Each node's wall-clock offset, in a file of its own that its processes read at
    every ``time.time()`` (the injected clock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.shim = root / "wall-shim"
        self.shim.mkdir()
        (self.shim / "sitecustomize.py").write_text(WALL_SHIM)
        self.offsets: dict[str, int] = {}

    def file(self, node: str) -> Path:
        return self.root / f"{node}.wall"

    def env(self, node: str) -> dict[str, str]:
        """What a node's daemon is started with (its workers inherit it)."""
        if node not in self.offsets:
            self.step(node, 0)
        return {
            "PYTHONPATH": os.pathsep.join((str(self.shim), str(REPO))),
            "CHAOS_WALL_OFFSET_FILE": str(self.file(node)),
        }

    def step(self, node: str, offset: int) -> None:
        self.offsets[node] = offset
        _write_offset(self.file(node), offset)


#: Run ``argv[2:]`` in the time namespace whose file is ``argv[1]``: setns, then exec (the
#: process keeps its pid). A time namespace is entered by a single-threaded process only.
_ENTER = (
    "import ctypes, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "if ctypes.CDLL(None, use_errno=True).setns(fd, 0x80) != 0:\n"  # CLONE_NEWTIME
    "    sys.exit(f'setns: {os.strerror(ctypes.get_errno())}')\n"
    "os.close(fd)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class TimeNamespace:
    """A time namespace whose monotonic and boot-time clocks run ``ahead`` seconds ahead:
    held open by a sleeping process in it (``unshare --time``), entered by ``enter_argv``."""

    def __init__(self, ahead: int = DAY) -> None:
        self.ahead = ahead
        self._holder = subprocess.Popen(
            ["unshare", "--time", "--fork", "--monotonic", str(ahead), "--boottime", str(ahead),
             "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # (killed at the end, unshare says so)
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not (children := psutil.Process(self._holder.pid).children()):
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"unshare --time did not start (exit {self._holder.poll()}): this kernel "
                    "or this user cannot make a time namespace"
                )
            time.sleep(0.01)
        self.path = f"/proc/{children[0].pid}/ns/time"

    def enter_argv(self, argv: list[str]) -> list[str]:
        """``argv`` (its first item a path) run inside the namespace, as the same process."""
        return [sys.executable, "-c", _ENTER, self.path, *argv]

    def close(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self._holder.pid).children():
                child.kill()
        self._holder.kill()
        self._holder.wait(timeout=10)
