"""Which machine, clock and process a heartbeat comes from, told apart across machines,
reboots and time namespaces (docs/design.md section 10).

On a shared store a worker's heartbeat is read on other machines, and by a daemon that
may not be the one that started the worker. Two things must not be guessed there:

* whether the beat's monotonic instants (``at_mono``) are on the reader's clock: only
  when both run on one boot of one machine in one time namespace (``clock_id``); else an
  age is the database's to tell (``worker.store.postgres``), never a difference of two
  machines' clocks;
* whether a live process is the worker that wrote the beat (``ProcessId``): its pid, and
  the instant it started in clock ticks since boot, on this boot of this machine. A pid
  reused by another process started at another tick; a pid of another machine or of an
  earlier boot has another boot id. ``ProcessId.alive_here`` checks a pid against it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_TIME_OFFSETS = Path("/proc/self/timens_offsets")


@functools.cache
def boot_id() -> str:
    """This boot of this machine (the kernel's random boot id); "" where it is unknown."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


@functools.cache
def clock_id() -> str:
    """This process's monotonic clock: its boot id and its time namespace's offsets. Two
    processes with the same ``clock_id`` read one CLOCK_MONOTONIC; "" where unknown."""
    boot = boot_id()
    if not boot:
        return ""
    try:
        offsets = " ".join(_TIME_OFFSETS.read_text().split())
    except OSError:
        offsets = "monotonic 0 0 boottime 0 0"  # (a kernel without time namespaces)
    return f"{boot} {offsets}"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field
    22: an integer the kernel keeps, which no wall-clock step moves); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # (the command name may hold spaces)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessId:
    """One process of one boot of one machine: what a worker's heartbeat carries, so that
    a daemon started later can tell it from any other process."""

    boot: str
    pid: int
    started: int  # clock ticks since boot

    @classmethod
    def mine(cls) -> ProcessId | None:
        started = start_ticks(os.getpid())
        if not boot_id() or started is None:
            return None
        return cls(boot_id(), os.getpid(), started)

    def to_json(self) -> dict[str, Any]:
        return {"boot": self.boot, "pid": self.pid, "started": self.started}

    @classmethod
    def from_json(cls, data: Any) -> ProcessId | None:
        """The identity a beat carries, or None when it carries none (or garbage)."""
        if not isinstance(data, dict):
            return None
        boot, pid, started = data.get("boot"), data.get("pid"), data.get("started")
        if not isinstance(boot, str) or type(pid) is not int or type(started) is not int:
            return None
        return cls(boot, pid, started)

    def alive_here(self) -> bool:
        """Whether this very process runs now on this machine: this boot, its pid, and
        the tick it started at (a pid reused since started at another)."""
        return bool(self.boot) and self.boot == boot_id() and start_ticks(self.pid) == self.started
