"""Each task's processes in a cgroup of its own, where cgroups v2 can be delegated.

A fork bomb or a memory hog in one task's ``run_command`` must not starve the other
tasks. Where the daemon's own cgroup is delegated to it (systemd: ``Delegate=pids
memory``, with ``ProtectControlGroups=no``; or a container that gives it a writable
cgroup2 of its own), ``delegate`` arranges that cgroup as::

    OWN/               the cgroup the daemon was started in: +pids +memory for its children
    OWN/daemon/        the daemon, its fork server, its hooks (a leaf: cgroup v2 keeps
                       processes out of a cgroup that hands controllers down)
    OWN/tasks/ID/      one task: its worker and every process its tools start, with
                       pids.max = [tools] max_processes, memory.max = [tools] max_memory

The worker joins its task's cgroup itself, first thing (``worker.__main__.join_cgroup``,
from ``CGROUP_ENV``),
so nothing it starts is ever outside it. The limits are written at each start of a
worker, so a reload's new values hold from the next one.

Where that cannot be done, ``Cgroups.verdict`` says why (``none: WHY``, shown in the
status header), and a task still cannot fail for a neighbour: a worker the machine
cannot start waits in ``backoff`` (``supervisor.daemon``, ``_resource_wait``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from worker.protocol import CGROUP_ENV

CGROUP_FS = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
#: The hint every "none" verdict ends with: what gives the daemon its own cgroup.
HOW = "systemd: Delegate=pids memory and ProtectControlGroups=no"


@dataclass(frozen=True)
class Cgroups:
    """The daemon's cgroup as ``delegate`` left it: ``own`` is its folder when the tasks
    get cgroups, None with ``why`` when they cannot."""

    own: Path | None
    why: str = ""

    @property
    def verdict(self) -> str:
        """``delegated``, or ``none: WHY``."""
        return "delegated" if self.own is not None else f"none: {self.why}"

    def prepare(self, task_id: str, max_processes: int, max_memory: int) -> dict[str, str]:
        """Make (or keep) ``tasks/ID`` with the limits; the environment that makes the
        task's worker join it. Empty when cgroups are not delegated."""
        if self.own is None:
            return {}
        path = self.own / "tasks" / task_id
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        (path / "pids.max").write_text(f"{max_processes}\n")
        (path / "memory.max").write_text(f"{max_memory}\n")
        return {CGROUP_ENV: str(path)}

    def release(self, task_id: str) -> None:
        """Remove ``tasks/ID`` once its processes are gone (one still dying keeps it, and
        the next start uses it again)."""
        if self.own is not None:
            with contextlib.suppress(OSError):
                (self.own / "tasks" / task_id).rmdir()


def own_cgroup(proc_cgroup: str) -> str | None:
    """The cgroup v2 path in a ``/proc/PID/cgroup`` text (its ``0::`` line), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def delegate(fs: Path = CGROUP_FS) -> Cgroups:
    """Move the daemon into ``OWN/daemon`` and make ``OWN/tasks`` for the tasks, when the
    machine lets it; else say why not (the processes stay where they are)."""
    if not (fs / "cgroup.controllers").is_file():
        return Cgroups(None, f"{fs} is not a cgroup v2 (unified) hierarchy")
    found = own_cgroup(Path("/proc/self/cgroup").read_text())
    if found is None:
        return Cgroups(None, "this process is in no cgroup v2")
    if found == "/":
        return Cgroups(None, f"the daemon runs in the root cgroup, not one of its own ({HOW})")
    own = fs / found.lstrip("/")
    if own.name == "daemon" and (own.parent / "tasks").is_dir():
        own = own.parent  # started again from the leaf an earlier daemon made
    available = (own / "cgroup.controllers").read_text().split()
    missing = [c for c in CONTROLLERS if c not in available]
    if missing:
        return Cgroups(None, f"its cgroup {found} has no {' or '.join(missing)} controller ({HOW})")
    try:
        leaf = own / "daemon"
        with contextlib.suppress(FileExistsError):
            leaf.mkdir()
        for pid in (own / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # (one that ended meanwhile)
                (leaf / "cgroup.procs").write_text(pid)
        enable = " ".join(f"+{c}" for c in CONTROLLERS)
        (own / "cgroup.subtree_control").write_text(enable)
        tasks = own / "tasks"
        with contextlib.suppress(FileExistsError):
            tasks.mkdir()
        (tasks / "cgroup.subtree_control").write_text(enable)
    except OSError as exc:
        return Cgroups(None, f"cannot arrange its cgroup {found}: {exc.strerror} ({HOW})")
    return Cgroups(own)
