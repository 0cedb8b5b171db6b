"""What a dead worker left in its journal: the progress and turn its crash is judged by."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from supervisor.stores import store_of
from supervisor.workers import (
    Progress,
    WorkerProcess,
    adopt_claimed,
    journal_progress,
    process_started,
    worker_exit,
)
from tests.support import journal_records, make_spool, reply, run_worker, scripted_task, text
from worker.errors import StorageError
from worker.identity import boot_id, start_ticks
from worker.protocol import ExitCode
from worker.spool import TaskDir
from worker.store.base import Cursor, Owner
from worker.store.journal import Journal


def _worker_after(task: TaskDir, *records: dict[str, object]) -> WorkerProcess:
    """A worker that started on ``task``'s journal as it is and appended ``records``."""
    journal, _ = Journal.open(task.journal, task=task.id)
    with journal:
        start = Cursor(journal.size)
        if records:
            journal.append(list(records))
    return WorkerProcess(task, pid=0, pidfd=-1, popen=None, journal_at=start)


def _task(tmp_path: Path) -> TaskDir:
    return scripted_task(make_spool(tmp_path), [reply(text("hi"))], name="crashed")


def test_the_last_turn_or_rewind_it_recorded_is_the_crash_turn(tmp_path: Path) -> None:
    task = _task(tmp_path)
    worker = _worker_after(
        task,
        {"k": "turn", "turn": 4, "message": {}},
        {"k": "intent", "call_id": "a"},
        {"k": "rewind", "to": 2},
        {"k": "turn", "turn": 3, "message": {}},
    )
    assert journal_progress(worker) == Progress(True, 3)
    rewound = _worker_after(task, {"k": "rewind", "to": 1})
    assert journal_progress(rewound) == Progress(True, 1)


def test_an_intent_alone_is_no_progress_and_names_no_turn(tmp_path: Path) -> None:
    task = _task(tmp_path)
    assert journal_progress(_worker_after(task, {"k": "intent", "call_id": "a"})) == Progress(
        False, None
    )
    assert journal_progress(_worker_after(task)) == Progress(False, None)


def test_a_tail_that_is_not_a_record_is_judged_by_size(tmp_path: Path) -> None:
    task = _task(tmp_path)
    worker = _worker_after(task)
    with task.journal.open("ab") as f:
        f.write(b"\x07\x00\x00\x00torn")  # a torn frame: no whole record, some bytes
    assert journal_progress(worker) == Progress(True, None)


def test_a_verdict_exit_says_what_its_record_says_or_why_the_store_could_not_give_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _task(tmp_path)
    worker = WorkerProcess(task, pid=4321, pidfd=-1, popen=None)
    store = store_of(task)
    store.publish_exit(task.id, {"pid": 4321, "code": 0, "reason": "end_turn"})
    heard = worker_exit(worker, ExitCode.DONE, None, 3)
    assert (heard.said, heard.unread) == ("end_turn", None)

    def away(task_id: str) -> None:
        raise StorageError("the database is away")

    monkeypatch.setattr(store, "read_exit", away)
    unheard = worker_exit(worker, ExitCode.DONE, None, 3)
    assert (unheard.said, unheard.unread) == (None, "the database is away")
    crashed = worker_exit(worker, None, "SIGKILL", 3)  # (no verdict: no words asked for)
    assert (crashed.said, crashed.unread) == (None, None)


def test_a_worker_started_again_on_an_ended_journal_ends_the_same_way_and_says_why(
    tmp_path: Path,
) -> None:
    """What a wait on an unread exit record counts on (``exits.settle``): the next worker
    finds the end in the journal, calls no model (the script has no reply left) and
    writes its exit record again."""
    task = _task(tmp_path)
    assert run_worker(task) == ExitCode.DONE
    before = journal_records(task)
    store = store_of(task)
    first = store.read_exit(task.id)
    assert first is not None and first["reason"] == "end_turn"
    task.exit.unlink()  # (the record a daemon could not read)
    assert run_worker(task) == ExitCode.DONE
    again = store.read_exit(task.id)
    assert again is not None and again["reason"] == "end_turn" and again["pid"] != first["pid"]
    assert journal_records(task) == before


def test_a_process_that_cannot_be_read_has_no_start_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a /proc mounted with ``hidepid`` (``ProtectProc=invisible``), psutil raises a
    bare ``FileNotFoundError`` for a process that was hidden while it read its ``stat`` and
    visible when it looked for its folder: the daemon must not die of it."""
    assert process_started(os.getpid()) is not None

    def hidden(pid: int) -> None:
        raise FileNotFoundError(2, "No such file or directory", f"/proc/{pid}/stat")

    monkeypatch.setattr(psutil, "Process", hidden)
    assert process_started(os.getpid()) is None


# -- a claim's worker, found again by its heartbeat (a shared store) ---------------------------

#: A process that titles itself as ``worker.proctitle`` titles a worker, then waits.
TITLED = (
    "import sys, time, setproctitle\n"
    "setproctitle.setproctitle(sys.argv[1])\n"
    "print('titled', flush=True)\n"
    "time.sleep(600)\n"
)


@contextlib.contextmanager
def _titled(title: str) -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen(
        [sys.executable, "-c", TITLED, title], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "titled\n"
            yield proc
        finally:
            proc.kill()


def _beat(pid: int, epoch: int = 7, **changed: object) -> dict[str, object]:
    ticks = start_ticks(pid)
    assert ticks is not None
    process = {"boot": boot_id(), "pid": pid, "started": ticks, **changed}
    return {"pid": pid, "epoch": epoch, "process": process}


def test_a_claim_s_worker_is_adopted_only_when_its_beat_names_this_very_process(
    tmp_path: Path,
) -> None:
    """The beat must carry the claim's epoch, this machine's boot, the pid and the tick
    it started at, and the process must be titled as this task's worker in this spool:
    a reused pid, another boot (machine), another epoch, or a worker of another node's
    spool on this machine is never adopted."""
    task = _task(tmp_path)
    owner = Owner(task.id, "a", 7)
    with _titled(f"agentd: worker {task.id} in {task.root}") as proc:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        for beat in (
            _beat(proc.pid, epoch=6),  # the lease moved on since it beat
            _beat(proc.pid, started=ticks + 1),  # a pid reused since
            _beat(proc.pid, boot="0b7f16e0-0000-4000-8000-000000000000"),  # another machine
            {"pid": proc.pid, "epoch": 7},  # a beat that names no process
        ):
            assert adopt_claimed(task, owner, beat) is None, beat
        adopted = adopt_claimed(task, owner, _beat(proc.pid))
        assert adopted is not None and adopted.pid == proc.pid
        proc.kill()
        proc.wait()
        assert adopted.exited()  # (its pidfd tells the exit, as a child's would)
        adopted.close()
    elsewhere = TaskDir(tmp_path / "other-spool", task.id)
    with _titled(f"agentd: worker {task.id} in {elsewhere.root}") as proc:
        assert adopt_claimed(task, owner, _beat(proc.pid)) is None  # another node's spool
    with _titled("sleeping") as proc:
        assert adopt_claimed(task, owner, _beat(proc.pid)) is None  # no worker at all
