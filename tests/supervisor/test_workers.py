"""What a dead worker left in its journal: the progress and turn its crash is judged by."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from supervisor.workers import Progress, WorkerProcess, journal_progress, process_started
from tests.support import make_spool, reply, scripted_task, text
from worker.spool import TaskDir
from worker.store.base import Cursor
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


def test_a_process_that_cannot_be_read_has_no_start_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a /proc mounted with ``hidepid`` (``ProtectProc=invisible``), psutil raises a
    bare ``FileNotFoundError`` for a process that was hidden while it read its ``stat`` and
    visible when it looked for its folder: the daemon must not die of it."""
    assert process_started(os.getpid()) is not None

    def hidden(pid: int) -> None:
        raise FileNotFoundError(2, "No such file or directory", f"/proc/{pid}/stat")

    monkeypatch.setattr(psutil, "Process", hidden)
    assert process_started(os.getpid()) is None
