"""worker.descendants: a worker's tools leave nothing alive once it leaves ``contained``.

The processes under test are real: a child Python process enters ``contained``, runs shell
commands that leave loops behind in every way a tool can (``tests.chaos.escape.ESCAPES``),
leaves the block and then waits, alive, for the test to look: whatever it killed died
because it left the block, not because it exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.chaos.escape import ESCAPES, PID_FILE
from tests.support import REPO, poll_for, worker_env
from worker.descendants import children, descendants, reap
from worker.events import read_events

CONTAINED = """
import os, subprocess, sys
from pathlib import Path
from worker.descendants import contained
from worker.events import append_event
events = Path(sys.argv[1])
def killed(pids):
    append_event(events, "processes_killed", pid=os.getpid(), pids=pids, task="t")
with contained(killed):
    for line in sys.stdin:
        if not line.strip():
            break
        subprocess.run(line, shell=True, check=True)
print("left the block", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def contained_process(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTAINED, str(tmp_path / "events.jsonl")],
        cwd=REPO,
        env=worker_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:  # (a failed test leaves its loops: killed while the subreaper still keeps them)
        poll_for(lambda: not any(map(alive, kill_below(proc.pid))), 10, what="loops killed")
        proc.kill()
        proc.communicate(timeout=10)


def kill_below(pid: int) -> list[int]:
    below = descendants(pid)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    return below


def command(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def leave_block(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    command(proc, "")
    assert proc.stdout.readline() == "left the block\n"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_leaving_the_block_kills_what_every_escape_left(
    tmp_path: Path, contained_process: subprocess.Popen[str]
) -> None:
    folders = {}
    for name, launch in ESCAPES.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        folders[name] = folder
        command(contained_process, f"cd {folder}; {launch(f'agentd-test-{folder.name}')}")
    pid_files = {name: folder / PID_FILE for name, folder in folders.items()}
    poll_for(lambda: all(f.exists() and f.read_text().strip() for f in pid_files.values()), 10)
    pids = {name: int(f.read_text()) for name, f in pid_files.items()}
    # Once the shell that started it has exited, each loop is an orphan the subreaper keeps.
    poll_for(lambda: set(pids.values()) <= set(children(contained_process.pid)), 10)
    assert os.getsid(pids["setsid"]) == pids["setsid"]  # out of the group, and the session
    leave_block(contained_process)
    assert [name for name, pid in pids.items() if alive(pid)] == []
    assert children(contained_process.pid) == []  # killed and reaped
    (event,) = read_events(tmp_path / "events.jsonl")
    assert event["event"] == "processes_killed" and event["task"] == "t"
    assert set(pids.values()) <= set(event["pids"])
    assert event["pid"] == contained_process.pid


def test_a_process_that_keeps_forking_is_outrun(
    tmp_path: Path, contained_process: subprocess.Popen[str]
) -> None:
    # A loop that makes a new orphan as fast as it can (and ignores SIGTERM), out of the
    # group: each round of kills finds more children than the last one killed.
    command(
        contained_process,
        f'setsid sh -c \'trap "" TERM; echo $$ > {tmp_path}/forker; '
        "while :; do (sleep 30 &); done' >/dev/null 2>&1 </dev/null &",
    )
    poll_for(lambda: len(descendants(contained_process.pid)) > 20, 10)
    leave_block(contained_process)
    assert descendants(contained_process.pid) == []
    assert not alive(int((tmp_path / "forker").read_text()))


def test_a_block_with_nothing_left_says_nothing(
    tmp_path: Path, contained_process: subprocess.Popen[str]
) -> None:
    command(contained_process, "true")
    leave_block(contained_process)
    assert not (tmp_path / "events.jsonl").exists()


def test_children_are_listed_until_reaped_and_descendants_parents_first() -> None:
    parent = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30' & sleep 30 & wait"])
    quick = subprocess.Popen(["true"])
    try:
        poll_for(lambda: len(descendants(parent.pid)) == 3, 10)
        below = descendants(parent.pid)
        inner = next(pid for pid in children(parent.pid) if children(pid))
        assert below.index(inner) < below.index(children(inner)[0])  # parents first
        poll_for(lambda: psutil.Process(quick.pid).status() == psutil.STATUS_ZOMBIE, 10)
        assert {parent.pid, quick.pid} <= set(children(os.getpid()))  # the zombie too
        assert reap(quick.pid) == 0  # its wait status: exit code 0
        quick.returncode = 0  # (reaped here, not by Popen)
        assert quick.pid not in children(os.getpid())
        assert reap(parent.pid) is None  # still running
        assert children(2**22 + 1) == []  # no such process
    finally:
        kill_below(parent.pid)
        parent.kill()
        parent.wait()
