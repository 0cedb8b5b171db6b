"""Storage faults in a real worker process: a full or read-only spool is exit 7, from
wherever it strikes, never exit 1 or a traceback (docs/design.md invariant 8).

The spool is a small tmpfs (``tests.mounts``: root only, skipped with mount's reason
elsewhere), filled with a file until it refuses more, or remounted read-only. Each test
then frees the space and runs the task again, to its end: nothing recorded was lost.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounts import fill, mount, small_disk
from tests.support import (
    finish,
    journal_records,
    of_kind,
    poll_for,
    reply,
    run_worker,
    scripted_task,
    start_worker,
    text,
    tool_use,
)
from worker.config import Config
from worker.errors import STORAGE_ERRNOS, StorageError, storage_fault
from worker.protocol import ExitCode
from worker.spool import Spool


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", size_mb=2) as path:
        yield path


def steps(n: int, delay: float = 0.0) -> list[dict[str, object]]:
    writes = [
        reply(text(f"Step {i}."), tool_use("write_file", path=f"f{i}.txt", content="x" * 100))
        for i in range(1, n)
    ]
    return [*writes, reply(text("Done."), delay=delay)]


def config_file(root: Path, *, interval: float = 0.1, timeout: float = 1.0) -> Path:
    path = root / "agentd.toml"
    path.write_text(f"[heartbeat]\ninterval = {interval}\ntimeout = {timeout}\n")
    return path


def test_storage_fault_names_storage_errnos_whatever_raised_them() -> None:
    for code in STORAGE_ERRNOS:
        fault = storage_fault(OSError(code, os.strerror(code), "/spool/x"))
        assert fault is not None and fault.errno == code and "/spool/x" in str(fault)
    assert storage_fault(OSError(errno.EACCES, "Permission denied")) is None
    assert storage_fault(StorageError("a record over the limit")) is None
    wrapped = StorageError("opening journal failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage_fault(wrapped) is not None


def test_a_full_disk_stops_the_worker_with_exit_7_and_the_task_resumes(
    tmp_path: Path, disk: Path
) -> None:
    spool = Spool(disk / "spool").ensure()
    task = scripted_task(spool, steps(40))
    filler = disk / "fill"
    fill(filler)
    code, err = finish(start_worker(task))
    assert code == ExitCode.STORAGE, err
    assert "Traceback" not in err and "ENOSPC" in err
    kept = journal_records(task)
    filler.unlink()
    assert run_worker(task) == ExitCode.DONE
    assert journal_records(task)[: len(kept)] == kept
    assert of_kind(journal_records(task), "end")[0]["state"] == "done"


def test_a_full_disk_mid_run_is_exit_7_with_the_records_before_it_kept(disk: Path) -> None:
    spool = Spool(disk / "spool").ensure()
    task = scripted_task(spool, [*steps(200)[:-1], reply(text("Done."))])
    proc = start_worker(task)
    poll_for(lambda: len(of_kind(journal_records(task), "turn")) >= 3, 20, what="3 turns")
    filler = disk / "fill"
    fill(filler)
    code, err = finish(proc)
    assert code == ExitCode.STORAGE, err
    assert "Traceback" not in err
    kept = journal_records(task)
    filler.unlink()
    assert run_worker(task) == ExitCode.DONE
    assert journal_records(task)[: len(kept)] == kept


def test_a_heartbeat_that_cannot_be_written_is_exit_7_before_the_worker_looks_hung(
    tmp_path: Path, disk: Path
) -> None:
    """A worker waiting on a slow model writes nothing but its heartbeat: a full disk
    would leave it silent until the daemon killed it as hung (a crash). It exits with the
    storage code after half the heartbeat timeout instead."""
    spool = Spool(disk / "spool").ensure()
    task = scripted_task(spool, [reply(text("Done."), delay=30)])
    proc = start_worker(task, args=["--config", str(config_file(tmp_path, timeout=1.0))])
    poll_for(task.heartbeat.exists, 20, what="the first heartbeat")
    fill(disk / "fill")
    code, err = finish(proc, timeout=10)  # well before the model's 30 s
    assert code == ExitCode.STORAGE, err
    assert "heartbeat" in err and "Traceback" not in err


def test_a_read_only_spool_is_exit_7_from_the_lock_on(disk: Path) -> None:
    spool = Spool(disk / "spool").ensure()
    task = scripted_task(spool, steps(3), config=Config())
    refused = mount("-o", "remount,ro", str(disk))
    if refused is not None:
        pytest.skip(f"cannot remount read-only: {refused}")
    try:
        code, err = finish(start_worker(task))
    finally:
        assert mount("-o", "remount,rw", str(disk)) is None
    assert code == ExitCode.STORAGE, err
    assert "EROFS" in err and "Traceback" not in err
    assert run_worker(task) == ExitCode.DONE
