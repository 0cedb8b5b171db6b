"""The daemon's placement on one machine (``supervisor.placement.LocalPlacement``): a task
at rest (held, finished) is read again when its doorbell rings or its files changed, not
at every rescan, and a decision or a request whose doorbell was lost is still found by
the next rescan; a running worker's task, whose doorbell rings for it, is looked at by one
rescan in a stride."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from supervisor.control import RETRY_REQUEST
from supervisor.coordination import request
from supervisor.daemon import Supervisor
from supervisor.decisions import decide, pending_decisions
from supervisor.placement import WORKER_RESCAN_STRIDE
from supervisor.record import TaskRecord
from supervisor.stores import store_of
from supervisor.workers import WorkerProcess
from tests.support import scripted_task, text
from worker.config import Config
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir
from worker.store import files
from worker.testing.journals import HELD_CALL as CALL
from worker.testing.journals import held_call, long_journal

#: Seconds past any file system's clock tick: a change made after it has another time.
TICK = 0.05


def held_task(spool: Spool, name: str, turns: int = 20) -> TaskDir:
    """A task of ``turns`` turns whose last call, unsafe, was held (as a worker leaves it)."""
    task = scripted_task(spool, [{"content": [text("hi")]}], name=name)
    long_journal(store_of(task), task.id, turns)
    held_call(store_of(task), task.id, turns + 1)
    record = TaskRecord.load(task)
    record.state = TaskStatus.HELD
    record.save(task)
    return task


def state_of(daemon: Supervisor, task_id: str) -> TaskStatus:
    return daemon.slots[task_id].record.state


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tasks whose decisions the placement read, in order; the files' change times
    taken as settled at once (a change is then made a clock tick or more after the last
    look: ``TICK``)."""
    seen: list[str] = []

    def counted(task: TaskDir) -> bool:
        seen.append(task.id)
        return pending_decisions(task)

    monkeypatch.setattr("supervisor.placement.pending_decisions", counted)
    monkeypatch.setattr(files, "RACY_NS", -(10**10))
    return seen


def scanned(tmp_path: Path, name: str) -> tuple[TaskDir, Supervisor]:
    """A held task, and a daemon (not serving) that has scanned its spool once."""
    spool = Spool(tmp_path / "spool")
    task = held_task(spool, name)
    daemon = Supervisor(spool, Config(), preload=False)
    daemon.rescan()
    return task, daemon


def test_a_rescan_reads_a_held_task_again_only_once_its_files_changed(
    tmp_path: Path, reads: list[str]
) -> None:
    task, daemon = scanned(tmp_path, "h1")
    assert reads == ["h1"] and state_of(daemon, "h1") == TaskStatus.HELD
    for _ in range(3):
        daemon.rescan()
    assert reads == ["h1"]  # nothing changed: not read again
    daemon.placement.ring({"h1"})
    assert reads == ["h1", "h1"]  # a doorbell reads it whatever the mark says
    time.sleep(TICK)
    decide(task, CALL, action="skip", reason="checked by hand")  # its doorbell lost
    daemon.rescan()
    assert reads == ["h1", "h1", "h1"]
    assert state_of(daemon, "h1") == TaskStatus.QUEUED  # released by the rescan


def test_a_journal_changed_under_a_held_task_is_read_again(
    tmp_path: Path, reads: list[str]
) -> None:
    task, daemon = scanned(tmp_path, "h2")
    time.sleep(TICK)
    with task.journal.open("ab") as journal:  # (a rewind cuts it; here it grows: the same)
        journal.write(b"\n")
    daemon.rescan()
    assert reads == ["h2", "h2"]


def test_a_finished_task_at_rest_is_skipped_until_a_request_lands_in_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "RACY_NS", -(10**10))
    spool = Spool(tmp_path / "spool")
    task = scripted_task(spool, [{"content": [text("hi")]}], name="f1")
    record = TaskRecord.load(task)
    record.state = TaskStatus.FAILED
    record.save(task)
    daemon = Supervisor(spool, Config(), preload=False)
    daemon.rescan()
    looked: list[str] = []
    monkeypatch.setattr(daemon.requests, "apply", lambda slot: looked.append(slot.task.id))
    daemon.rescan()
    assert looked == []  # at rest, nothing changed: skipped
    time.sleep(TICK)
    request(task, RETRY_REQUEST)  # `agentd retry`, its doorbell lost
    daemon.rescan()
    assert looked == ["f1"]


def test_a_mark_is_not_trusted_while_a_change_could_hide_in_the_clock_tick(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool")
    task = held_task(spool, "h3")
    journal = task.journal.stat()
    changed = max(journal.st_ctime_ns, task.path.stat().st_ctime_ns)  # (the latest change)
    store = store_of(task)
    assert store.rest_mark(task.id, now_ns=changed + files.RACY_NS - 1) is None
    settled = store.rest_mark(task.id, now_ns=changed + files.RACY_NS + 1)
    assert settled is not None
    assert settled[9:] == (journal.st_ino, journal.st_size, journal.st_ctime_ns)


def test_a_running_worker_s_task_is_looked_at_by_one_rescan_in_the_stride_and_at_each_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path / "spool")
    scripted_task(spool, [{"content": [text("hi")]}], name="r1")
    daemon = Supervisor(spool, Config(), preload=False)
    daemon.rescan()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        slot = daemon.slots["r1"]
        slot.worker = WorkerProcess(slot.task, sleeper.pid, os.pidfd_open(sleeper.pid), sleeper)
        looked: list[str] = []
        monkeypatch.setattr(daemon.requests, "apply", lambda slot: looked.append(slot.task.id))
        for _ in range(3 * WORKER_RESCAN_STRIDE):
            daemon.rescan()
        assert looked == ["r1"] * 3  # the net: one rescan in the stride (a lost doorbell)
        daemon.placement.ring({"r1"})
        assert looked == ["r1"] * 4  # its doorbell: at once
        slot.paused = True  # (a pause's holder may die: looked at by every rescan)
        daemon.rescan()
        assert looked == ["r1"] * 5
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_doorbell_for_every_task_looks_at_each_running_worker_s_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path / "spool")
    scripted_task(spool, [{"content": [text("hi")]}], name="r2")
    daemon = Supervisor(spool, Config(), preload=False)
    daemon.rescan()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        slot = daemon.slots["r2"]
        slot.worker = WorkerProcess(slot.task, sleeper.pid, os.pidfd_open(sleeper.pid), sleeper)
        looked: list[str] = []
        monkeypatch.setattr(daemon.requests, "apply", lambda slot: looked.append(slot.task.id))
        for _ in range(WORKER_RESCAN_STRIDE - 1):
            daemon.placement.ring(None)  # a name it could not read: any task's command
        assert looked == ["r2"] * (WORKER_RESCAN_STRIDE - 1)
    finally:
        sleeper.kill()
        sleeper.wait()
