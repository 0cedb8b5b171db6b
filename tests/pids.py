"""A pids cgroup for tests: a bound on how many processes a daemon and everything it
starts may have, so that a fork really fails (EAGAIN) when a test wants it to, and a
process flood can never reach the rest of the machine.

Root makes it: RLIMIT_NPROC does not hold root back, a pids cgroup does. Made in the
cgroup v2 hierarchy where its root delegates ``pids``, else in the v1 ``pids``
hierarchy; ``PidsRefused`` says why neither is there, in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from tests.daemon import Daemon

CGROUP_ROOT = Path("/sys/fs/cgroup")


class PidsRefused(Exception):
    """This machine gives the test no pids cgroup (the reason is the message)."""


class PidsCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs(self) -> Path:
        """Write a pid here to move that process in (``0``: the writer itself)."""
        return self.path / "cgroup.procs"

    def limit(self, value: int | None) -> None:
        """At most ``value`` processes and threads (None: no bound)."""
        (self.path / "pids.max").write_text("max" if value is None else str(value))

    def current(self) -> int:
        return int((self.path / "pids.current").read_text())

    def pids(self) -> list[int]:
        return [int(line) for line in self.procs.read_text().split()]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this cgroup from its first instruction on."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs), *argv]

    def kill_all(self, timeout: float = 20.0) -> None:
        """SIGKILL every process in the cgroup until none is left (a flood forks on while
        it is being killed, but never past the bound)."""
        deadline = time.monotonic() + timeout
        while (found := self.pids()) and time.monotonic() < deadline:
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def _hierarchy() -> Path:
    """Where a pids cgroup can be made here, or PidsRefused."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # cgroup v2 mounted on its own
        enabled = (CGROUP_ROOT / "cgroup.subtree_control").read_text().split()
        if "pids" in enabled and os.access(CGROUP_ROOT, os.W_OK):
            return CGROUP_ROOT
        raise PidsRefused(f"{CGROUP_ROOT} does not delegate pids to a test run as this user")
    v1 = CGROUP_ROOT / "pids"
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    raise PidsRefused(f"no writable pids cgroup hierarchy under {CGROUP_ROOT}")


@contextlib.contextmanager
def pids_cgroup(name: str) -> Iterator[PidsCgroup]:
    """A fresh pids cgroup, unbounded until ``limit``; every process left in it is killed
    and the cgroup removed at the end."""
    path = _hierarchy() / f"agentd-test-{name}-{os.getpid()}"
    path.mkdir()
    cgroup = PidsCgroup(path)
    try:
        yield cgroup
    finally:
        cgroup.limit(None)
        cgroup.kill_all()
        deadline = time.monotonic() + 10.0
        while True:  # the last killed may take a moment to leave
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def confine(daemon: Daemon, cgroup: PidsCgroup) -> Daemon:
    """``daemon`` (a ``tests.daemon.Daemon`` of any host) with every process it starts in
    ``cgroup``: the daemon, its fork server, its workers and their tools."""
    launch = daemon.launch  # (outside any jail of the host: the cgroup is root's to join)
    daemon.launch = lambda *args: cgroup.wrap(launch(*args))  # type: ignore[method-assign]
    return daemon
