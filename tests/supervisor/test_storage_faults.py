"""A real daemon on a spool that fills up (docs/design.md invariant 8): its workers' storage
faults are waits, not crashes, and the records it could not write are rewritten once the
disk takes writes again, so ``status`` is true within seconds.

The spool is a small tmpfs (``tests.mounts``: root only, skipped with mount's reason
elsewhere), filled with a file until it refuses more and then freed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.coordination import running_pid, supervisor_info
from supervisor.record import TaskRecord
from tests.daemon import Daemon, alive, subreaper
from tests.mounts import fill, mount, small_disk
from tests.support import poll_for, reply, text, tool_use
from worker.events import read_events

HEARTBEAT_TIMEOUT = 1.0


def config() -> str:
    return (
        f"[heartbeat]\ninterval = 0.1\ntimeout = {HEARTBEAT_TIMEOUT}\n"
        "[restart]\nbackoff_initial = 0.1\nbackoff_max = 1.0\ncrash_loop_limit = 2\n"
        "stop_grace = 1.0\n"
    )


def slow_steps(n: int, delay: float) -> list[dict[str, object]]:
    return [
        *(
            reply(text(f"Step {i}."), tool_use("write_file", path=f"{i}.txt", content="x"))
            for i in range(1, n)
        ),
        reply(text("Done."), delay=delay),
    ]


@pytest.fixture(scope="module", autouse=True)
def _reaper() -> Iterator[None]:
    with subreaper():
        yield


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with small_disk(tmp_path / "spool", size_mb=4):
        daemon = Daemon(tmp_path, config())
        try:
            yield daemon
        finally:
            daemon.cleanup()


def test_records_the_daemon_could_not_write_are_rewritten_and_nothing_is_a_crash(
    daemon: Daemon,
) -> None:
    daemon.start()
    task_id = daemon.submit(slow_steps(3, delay=3.0), "slow")
    row = daemon.wait_row(task_id, lambda r: r["state"] == "running" and r["turn"] >= 2)
    filler = daemon.spool.root / "fill"
    fill(filler)
    # The worker, waiting on its model, can write no heartbeat: it exits 7 after half the
    # timeout. The daemon's `backoff` record is refused, so the file still says `running`.
    poll_for(lambda: not alive(row["pid"]), 10, what="the worker to stop on the full disk")

    def refused() -> bool:  # the daemon's own write (no task named): its `backoff` record
        return any(e["event"] == "storage_fault" and "task" not in e for e in daemon.log_events())

    poll_for(refused, 10, what="the daemon's record refused")  # (not merely not yet written)
    assert daemon.row(task_id)["state"] == "running"
    filler.unlink()
    fresh = daemon.wait_row(
        task_id,
        lambda r: r["state"] != "running" or (r["pid"] != row["pid"] and r["pid"] is not None),
        timeout=3.0,
        what="the refused record rewritten",
    )
    assert fresh["pid"] is None or alive(fresh["pid"])
    done = daemon.wait_state(task_id, "done", timeout=30)
    assert done["restarts"] == 0  # a storage fault spends no restart
    record = TaskRecord.load(daemon.task(task_id))
    assert record.crashes == []
    exits = daemon.events(task_id, "worker_exited")
    assert any(e["code"] == 7 for e in exits)
    assert all(e["code"] in (0, 7) for e in exits)
    assert daemon.events(task_id, "storage_fault")
    log = daemon.log_events()
    assert sum(1 for e in log if e["event"] == "storage_fault" and "task" not in e) == 1
    recovered = [e for e in log if e["event"] == "storage_recovered"]
    assert len(recovered) == 1 and recovered[0]["rewritten"] >= 1


def test_a_task_waiting_on_storage_shows_backoff_with_the_reason(daemon: Daemon) -> None:
    """A journal that cannot be opened for writing (a read-only bind mount of that one
    file) while the rest of the spool can be written: the task is shown waiting, with the
    worker's own words on the fault as its reason, and resumes once the fault clears."""
    task_id = daemon.submit(slow_steps(3, delay=0.0), "waits")
    journal = daemon.task(task_id).journal
    journal.touch(mode=0o600)
    refused = mount("--bind", str(journal), str(journal)) or mount(
        "-o", "remount,bind,ro", str(journal)
    )
    if refused is not None:
        pytest.skip(f"cannot bind-mount a file read-only: {refused}")
    try:
        daemon.start()
        row = daemon.wait_row(
            task_id, lambda r: r["state"] == "backoff" and r["reason"], timeout=10
        )
        assert row["reason"].startswith("storage_fault: opening ")
        assert "EROFS" in row["reason"]
        daemon.wait_row(task_id, lambda r: len(daemon.events(task_id, "worker_exited")) >= 3)
    finally:
        subprocess.run(["umount", str(journal)], check=False)
    done = daemon.wait_state(task_id, "done", timeout=30)
    assert done["restarts"] == 0 and TaskRecord.load(daemon.task(task_id)).crashes == []
    assert len(daemon.events(task_id, "storage_fault")) == 1  # once per fault, not per retry


def test_a_detached_daemon_with_its_log_on_the_full_spool_keeps_serving(
    daemon: Daemon,
) -> None:
    """``agentd start --detach`` logs into the spool: a full spool must not kill it."""
    done = daemon.run_cli("start", "--detach")
    assert done.returncode == 0, done.stderr
    pid = running_pid(daemon.spool)
    assert pid is not None
    ids = [daemon.submit(slow_steps(20, delay=0.0), f"d{i}") for i in range(3)]
    for task_id in ids:
        daemon.wait_row(task_id, lambda r: r["turn"] >= 1 or r["state"] == "done")
    filler = daemon.spool.root / "fill"
    fill(filler)
    # A worker that ends as the disk fills has its exit in the events, while its `done`
    # record may wait for space (the daemon keeps it and rewrites it later).
    poll_for(
        lambda: (
            any(e.get("code") == 7 for t in ids for e in daemon.events(t, "worker_exited"))
            or all(
                daemon.row(t)["state"] == "done" or daemon.events(t, "worker_exited") for t in ids
            )
        ),
        10,
        what="a worker to meet the full disk",
    )
    assert alive(pid), "the daemon died on its own full log"
    filler.unlink()
    for task_id in ids:
        assert daemon.wait_state(task_id, "done", timeout=30)["restarts"] == 0
    assert alive(pid) and (supervisor_info(daemon.spool) or {}).get("pid") == pid
    log = read_events(daemon.spool.root / "supervisor.log")
    names = [e["event"] for e in log]
    assert "storage_recovered" in names or "storage_fault" not in names
    os.kill(pid, signal.SIGTERM)
    poll_for(lambda: not alive(pid), 15, what="the detached daemon to stop")
