"""The standby worker (worker/forkserver.py, worker/standby.py): forked by the fork server
ahead of need, it becomes the next started worker, is replaced after use and at a
reload, holds no task's file or secret before it has a task, is no worker of the daemon
(not counted, not a stray) and dies with the daemon. Real daemons, real processes."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import psutil

from supervisor.status import read_heartbeat
from tests.daemon import Daemon
from tests.support import poll_for, reply, text
from worker.proctitle import FORK_SERVER, STANDBY

SECRET = "sk-ant-standby-test-secret"  # noqa: S105  (a made-up key, to look for)


def title(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline()).strip()
    return ""


def alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def standbys(daemon_pid: int) -> list[int]:
    """The live standbys under the daemon's fork server."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(daemon_pid).children():
            if title(child.pid) == FORK_SERVER:
                return [
                    p.pid
                    for p in child.children(recursive=True)
                    if title(p.pid) == STANDBY and alive(p.pid)
                ]
    return []


def one_standby(daemon_pid: int, *, other_than: int | None = None) -> int | None:
    found = [pid for pid in standbys(daemon_pid) if pid != other_than]
    return found[0] if len(found) == 1 else None


def logged(daemon: Daemon, name: str) -> list[dict[str, object]]:
    return [e for e in daemon.log_events() if e.get("event") == name]


def started(tmp_path: Path, config: str = "") -> tuple[Daemon, int]:
    """A daemon (one place: max_workers 1) whose fork server keeps a standby: (it, the
    standby's pid)."""
    daemon = Daemon(tmp_path, "max_workers = 1\n[restart]\nbackoff_initial = 0.05\n" + config)
    proc = daemon.start({"ANTHROPIC_API_KEY": SECRET})
    standby = poll_for(lambda: one_standby(proc.pid), 60, what="a standby")
    return daemon, standby


def test_the_next_worker_is_the_standby_and_another_stands_by_after_it(tmp_path: Path) -> None:
    daemon, standby = started(tmp_path)
    try:
        assert daemon.proc is not None
        daemon_pid = daemon.proc.pid
        spool = daemon.spool.root
        # before its task: no worker of the daemon (not its child, not counted), no task
        # file open, no secret in its environment
        assert standby not in {c.pid for c in psutil.Process(daemon.proc.pid).children()}
        process = psutil.Process(standby)
        tasks = str(daemon.spool.root / "tasks")
        assert not [f.path for f in process.open_files() if f.path.startswith(tasks)]
        assert SECRET not in "".join(f"{k}={v}" for k, v in process.environ().items())
        os.kill(daemon.proc.pid, signal.SIGUSR1)
        (status,) = poll_for(lambda: logged(daemon, "supervisor_status"), 10, what="a summary")
        assert status["workers"] == 0 and status["forkserver"] == "ready"

        task_id = daemon.submit([reply(text("Done."), delay=60.0)], "first")
        spawned = poll_for(lambda: daemon.events(task_id, "worker_spawned"), 30, what="a worker")
        assert spawned[0]["pid"] == standby  # the one place went to the task, to the standby
        forked = f"agentd: worker {task_id} in {spool} (forked by worker.forkserver)"
        poll_for(lambda: title(standby) == forked, 30, what=f"{forked!r}, not {title(standby)!r}")
        poll_for(lambda: psutil.Process(standby).ppid() == daemon_pid, 30, what="its child now")
        assert daemon.row(task_id)["state"] == "running"

        after = poll_for(lambda: one_standby(daemon_pid, other_than=standby), 30)
        assert after != standby and alive(standby)

        os.kill(standby, signal.SIGKILL)  # the restart is the new standby
        restarted = poll_for(
            lambda: daemon.events(task_id, "worker_spawned")[1:], 30, what="the restart"
        )
        assert restarted[0]["pid"] == after
        assert not logged(daemon, "strays_killed")  # no standby was ever taken for a stray
    finally:
        daemon.cleanup()


def test_a_reload_replaces_the_standby(tmp_path: Path) -> None:
    daemon, standby = started(tmp_path)
    try:
        assert daemon.proc is not None
        daemon_pid = daemon.proc.pid
        daemon.config_path.write_text(
            "max_workers = 1\n[restart]\nbackoff_initial = 0.05\n[heartbeat]\ninterval = 0.7\n"
        )
        os.kill(daemon.proc.pid, signal.SIGHUP)
        poll_for(lambda: logged(daemon, "config_reloaded"), 30, what="the reload")
        renewed = poll_for(lambda: one_standby(daemon_pid, other_than=standby), 30)
        poll_for(lambda: not alive(standby), 30, what="the stale standby to exit")
        task_id = daemon.submit([reply(text("Done."), delay=60.0)], "after")
        spawned = poll_for(lambda: daemon.events(task_id, "worker_spawned"), 30, what="a worker")
        assert spawned[0]["pid"] == renewed
        # it runs on the config read after the reload: its beats say the new interval
        beat = poll_for(lambda: read_heartbeat(daemon.task(task_id)), 30, what="a heartbeat")
        assert beat.get("interval") == 0.7, beat
    finally:
        daemon.cleanup()


def test_a_standby_dies_with_the_daemon(tmp_path: Path) -> None:
    daemon, standby = started(tmp_path)
    try:
        daemon.kill()  # kill -9: the fork server's input closes, and the standby's
        poll_for(lambda: not alive(standby), 30, what="the standby to exit")
    finally:
        daemon.cleanup()


def test_a_standby_dies_with_its_fork_server_and_the_next_server_has_its_own(
    tmp_path: Path,
) -> None:
    daemon, standby = started(tmp_path)
    try:
        assert daemon.proc is not None
        daemon_pid = daemon.proc.pid
        (server,) = [
            c.pid for c in psutil.Process(daemon.proc.pid).children() if title(c.pid) == FORK_SERVER
        ]
        os.kill(server, signal.SIGKILL)
        poll_for(lambda: not alive(standby), 30, what="the standby to exit")
        poll_for(lambda: len(logged(daemon, "forkserver_ready")) == 2, 60, what="a new server")
        poll_for(lambda: one_standby(daemon_pid, other_than=standby), 30, what="a standby")
    finally:
        daemon.cleanup()
