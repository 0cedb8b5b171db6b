"""What ``ps`` shows for each agentd process (``setproctitle``): the daemon with its spool,
the fork server, and each worker with its task and spool; a worker forked from the fork
server says so. Titles keep the spool's path (what finds a spool's processes) and the fork
server's module name (what tells a forked worker from a fresh one)."""

from __future__ import annotations

from pathlib import Path

import setproctitle

FORK_SERVER = "agentd: fork server (worker.forkserver)"
#: A worker forked ahead of need, before it has a task (``worker.standby``).
STANDBY = "agentd: standby worker (forked by worker.forkserver)"


def daemon(spool: Path) -> None:
    setproctitle.setproctitle(f"agentd: daemon {spool}")


def fork_server() -> None:
    setproctitle.setproctitle(FORK_SERVER)


def standby() -> None:
    setproctitle.setproctitle(STANDBY)


def worker(task_id: str, spool: Path) -> None:
    """A worker's title; forked from the fork server (whose title it inherited, or a
    standby's), it says so."""
    forked = (
        " (forked by worker.forkserver)"
        if setproctitle.getproctitle() in (FORK_SERVER, STANDBY)
        else ""
    )
    setproctitle.setproctitle(f"agentd: worker {task_id} in {spool}{forked}")
