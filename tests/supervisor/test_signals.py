"""Signals a user may send by habit, against a real daemon (docs/design.md section 7).

HUP reloads the config file (a bad one is refused with one line and the old one kept, for
the daemon and for the workers it starts) and reopens the log file; USR1 logs a summary;
USR2 and PIPE are survived; a HUP sent to the daemon's process group reaches neither the
fork server nor any worker. Every wait is a deadline poll.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.reload import WORKER_CONFIG
from tests.daemon import Daemon, alive
from tests.daemon import config_text as daemon_config
from tests.support import poll_for, reply, text, tool_use

pytestmark = pytest.mark.usefixtures("subreaper")


def config_text(max_workers: int = 1, timeout: float = 2.0) -> str:
    return daemon_config(
        max_workers=max_workers,
        timeout=timeout,
        model_call=None,
        tool_call=None,
        crash_loop_limit=None,
        sandbox=None,
        tool_modules=(),
    )


def slow(turns: int, delay: float) -> list[dict[str, Any]]:
    """``turns`` turns of ``delay`` seconds each, a tool call in every one but the last."""
    steps = [
        reply(text(f"Step {i}."), tool_use("write_file", path=f"{i}.txt", content="x"), delay=delay)
        for i in range(1, turns)
    ]
    return [*steps, reply(text("Done."), delay=delay)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    made = Daemon(tmp_path / "d", config_text())
    yield made
    made.cleanup()


def logged(daemon: Daemon, event: str) -> Callable[[], list[dict[str, Any]]]:
    return lambda: [e for e in daemon.log_events() if e.get("event") == event]


def signal_daemon(daemon: Daemon, sig: int) -> None:
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, sig)


def test_hup_applies_a_good_config_and_refuses_a_bad_one(daemon: Daemon) -> None:
    daemon.start()
    ids = [daemon.submit(slow(3, 0.4), name=f"t{i}") for i in range(3)]
    poll_for(lambda: sum(daemon.row(t)["state"] == "running" for t in ids) == 1, 10)
    daemon.config_path.write_text(config_text(max_workers=3, timeout=3.0))
    signal_daemon(daemon, signal.SIGHUP)
    (event,) = poll_for(logged(daemon, "config_reloaded"), 10, what="config_reloaded")
    assert event["changed"] == ["max_workers", "heartbeat.timeout"]
    assert event["applied"] == ["max_workers", "heartbeat.timeout"]
    assert event["restart_needed"] == []
    poll_for(lambda: sum(daemon.row(t)["state"] == "running" for t in ids) == 3, 10)

    daemon.config_path.write_text("max_workers = 0\n")
    signal_daemon(daemon, signal.SIGHUP)
    (failed,) = poll_for(logged(daemon, "config_reload_failed"), 10, what="the refusal")
    assert failed["level"] == "warning"
    assert "max_workers" in failed["reason"]
    assert "\n" not in failed["reason"]
    # The old config stays, for the daemon and for every worker it starts from now on
    # (a worker reading the bad file would exit 78 and fail its task).
    late = daemon.submit(slow(2, 0.05), name="late")
    for task_id in [*ids, late]:
        assert daemon.wait_state(task_id, "done", timeout=30)["restarts"] == 0
    assert len(logged(daemon, "config_reloaded")()) == 1
    assert (daemon.spool.root / WORKER_CONFIG).read_text() == config_text(3, 3.0)
    assert alive(daemon.proc.pid)  # type: ignore[union-attr]


def test_hup_reopens_the_log_file_after_logrotate_moved_it(daemon: Daemon) -> None:
    log = daemon.root / "agentd.log"
    daemon.start(args=("--log-file", str(log)))
    poll_for(lambda: "supervisor_ready" in log.read_text(), 10, what="the daemon's log file")
    rotated = log.rename(log.with_name("agentd.log.1"))
    signal_daemon(daemon, signal.SIGHUP)
    poll_for(lambda: log.exists() and "config_reloaded" in log.read_text(), 10, what="a new log")
    assert "log_reopened" in log.read_text()
    assert "config_reloaded" not in rotated.read_text()
    assert log.stat().st_mode & 0o777 == 0o600


def test_usr1_logs_a_summary_and_usr2_and_pipe_are_survived(daemon: Daemon) -> None:
    daemon.start()
    task_id = daemon.submit(slow(4, 0.2), name="busy")
    daemon.wait_state(task_id, "running")
    signal_daemon(daemon, signal.SIGUSR1)
    (status,) = poll_for(logged(daemon, "supervisor_status"), 10, what="a summary")
    assert status["max_workers"] == 1
    assert status["workers"] == 1
    signal_daemon(daemon, signal.SIGUSR2)
    (ignored,) = poll_for(logged(daemon, "signal_ignored"), 10)
    assert ignored["signal"] == "SIGUSR2"
    signal_daemon(daemon, signal.SIGPIPE)
    signal_daemon(daemon, signal.SIGUSR1)  # (one signal at a time: a pending one absorbs another)
    poll_for(lambda: len(logged(daemon, "supervisor_status")()) == 2, 10, what="still serving")
    assert daemon.wait_state(task_id, "done", timeout=30)["restarts"] == 0
    assert alive(daemon.proc.pid)  # type: ignore[union-attr]


def test_a_hup_to_the_daemons_process_group_reaches_no_worker(daemon: Daemon) -> None:
    daemon.config_path.write_text(config_text(max_workers=4))
    daemon.start()
    poll_for(logged(daemon, "forkserver_ready"), 30, what="the fork server")  # workers from it
    ids = [daemon.submit(slow(6, 0.3), name=f"w{i}") for i in range(3)]
    pids = {t: daemon.wait_state(t, "running")["pid"] for t in ids}
    assert daemon.proc is not None
    for n in range(1, 4):
        os.killpg(daemon.proc.pid, signal.SIGHUP)  # (its own session: its group is its pid)

        def reloaded(n: int = n) -> bool:
            return len(logged(daemon, "config_reloaded")()) == n

        poll_for(reloaded, 10, what="a reload")
    assert all(alive(pid) for pid in pids.values())
    for task_id in ids:
        row = daemon.wait_state(task_id, "done", timeout=30)
        assert row["restarts"] == 0, row
    assert alive(daemon.proc.pid)
    assert not logged(daemon, "forkserver_exited")()  # the fork server got no HUP either
