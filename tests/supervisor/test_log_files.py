"""The daemon's own log file (``supervisor.log``) and the fork server's
(``forkserver.log``) are bounded as a worker's ``worker.log`` is (``worker.output``):
past ``LOG_FILE_LIMIT`` the file is moved to ``.1`` and a new one started, by the process
that writes it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.daemon import Daemon
from tests.support import REPO, poll_for, worker_env
from worker.output import LOG_FILE_LIMIT

pytestmark = pytest.mark.usefixtures("subreaper")


def test_the_daemon_and_fork_server_logs_are_moved_aside_at_their_limit(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d", "[heartbeat]\ninterval = 0.2\n")
    daemon.spool.ensure()
    logs = [daemon.spool.root / "supervisor.log", daemon.spool.root / "forkserver.log"]
    for log in logs:
        log.write_bytes(b"old line\n" * (LOG_FILE_LIMIT // 9 + 1))  # past the limit
    try:
        started = subprocess.run(
            daemon.command("--log-format", "json", "start", "--detach"),
            cwd=REPO,
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert started.returncode == 0, started.stderr
        for log in logs:
            rotated = log.with_name(log.name + ".1")
            poll_for(rotated.exists, 60, what=f"{rotated.name}")
            assert rotated.read_bytes().startswith(b"old line\n")
        log = logs[0]
        poll_for(lambda: b"supervisor_ready" in log.read_bytes(), 60, what="the new log")
        assert b"old line" not in log.read_bytes()
        assert log.stat().st_size < LOG_FILE_LIMIT
        stopped = daemon.run_cli("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert b"supervisor_stopped" in log.read_bytes()  # the last lines are not lost
    finally:
        daemon.cleanup()
