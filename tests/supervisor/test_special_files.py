"""Only regular files are read: a FIFO, a device or a socket named where agentd expects a
file (the config, also at a SIGHUP reload; a prompt, a script or a result file; a file
planted in the spool) is refused in one line, at once: the open never blocks
(``worker.store.durable.open_regular``: ``O_NONBLOCK``, then ``fstat``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon, alive
from tests.support import REPO, poll_for, reply, scripted_task, text, worker_env
from worker.spool import Spool
from worker.store.durable import NotRegularFileError, read_bytes, read_regular

pytestmark = pytest.mark.usefixtures("subreaper")

#: Long enough for a loaded machine to start the CLI; a blocked open never returns.
PATIENCE = 60


@pytest.fixture(params=["fifo", "device", "socket"])
def special(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A path that names no regular file."""
    path = tmp_path / f"a-{request.param}"
    if request.param == "fifo":
        os.mkfifo(path)
        yield path
    elif request.param == "device":
        os.symlink("/dev/zero", path)  # a file an operator names may be a symlink
        yield path
    else:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))
            yield path


def agentd(spool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "--spool", str(spool), *args],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=PATIENCE,  # a blocked open fails the test here
        check=False,
        stdin=subprocess.DEVNULL,
    )


def refused_in_one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert "not a regular file" in line
    return line


def test_read_regular_refuses_at_once(special: Path) -> None:
    with pytest.raises(NotRegularFileError, match="not a regular file"):
        read_regular(special, 10, follow_symlinks=True)


def test_a_spool_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "state.json")
    with pytest.raises(NotRegularFileError, match="a FIFO, not a regular file"):
        read_bytes(tmp_path / "state.json")


@pytest.mark.parametrize("option", ["--prompt-file", "--script"])
def test_submit_refuses_a_prompt_or_script_that_is_no_file(
    special: Path, tmp_path: Path, option: str
) -> None:
    spool = tmp_path / "spool"
    args = [option, str(special)]
    args += ["--prompt", "p"] if option == "--script" else []
    line = refused_in_one_line(agentd(spool, "submit", *args, "--name", "t1"), 2)
    assert str(special) in line
    assert not (spool / "tasks" / "t1").exists()


def test_config_check_refuses_a_config_that_is_no_file(special: Path, tmp_path: Path) -> None:
    refused_in_one_line(agentd(tmp_path / "spool", "config", "check", str(special)), 78)


def test_a_result_file_that_is_no_file_is_refused(special: Path, tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    scripted_task(spool, [reply(text("Done."))], name="t1")
    done = agentd(spool.root, "approve-dangling", "t1", "c1", "--result-file", str(special))
    refused_in_one_line(done, 2)


def test_a_hup_with_the_config_turned_fifo_is_refused_and_the_daemon_serves_on(
    tmp_path: Path,
) -> None:
    daemon = Daemon(tmp_path / "d", "[heartbeat]\ninterval = 0.2\n")
    try:
        daemon.start()
        daemon.config_path.unlink()
        os.mkfifo(daemon.config_path)
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGHUP)

        def refusal() -> list[dict[str, object]]:
            return [e for e in daemon.log_events() if e.get("event") == "config_reload_failed"]

        (failed,) = poll_for(refusal, PATIENCE, what="the refused reload")
        assert "a FIFO, not a regular file" in str(failed["reason"])
        late = daemon.submit([reply(text("Done."))], name="late")
        daemon.wait_state(late, "done", timeout=PATIENCE)  # supervision goes on
        assert alive(daemon.proc.pid)
    finally:
        daemon.cleanup()
