"""A blank or cut journal is damage, never a fresh task (docs/design.md invariants 1, 2, 9).

On a real daemon: a task charges a ledger three times with unsafe calls, then waits on
its model. Its worker ends (stopped with the daemon, or killed with it), its journal is
truncated to 0 bytes or zeroed, the daemon starts again. The task must fail with one
reason that names the journal, ``history`` must say the same, the journal must be left as
it was found, and the ledger must hold each charge once.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import Daemon, alive, config_text
from tests.support import poll_for, reply, text, tool_use
from worker.spool import TaskDir
from worker.store.base import PROGRESS

CHARGES = ["charge1", "charge2", "charge3"]


def charges() -> list[dict[str, Any]]:
    """Three unsafe charges, then a model call that takes a minute (the worker waits)."""
    turns = [
        reply(text(f"Charging {c}."), tool_use("run_command", command=f"echo {c} >> ledger"))
        for c in CHARGES
    ]
    return [*turns, reply(text("Done."), delay=60)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path, config_text())
    try:
        yield daemon
    finally:
        daemon.cleanup()


def ledger(task: TaskDir) -> list[str]:
    return (task.path / "workspace" / "ledger").read_text().split()


def beat_progress(task: TaskDir) -> int:
    try:
        value = json.loads(task.heartbeat.read_bytes()).get(PROGRESS)
    except (OSError, ValueError):
        return 0
    return value if isinstance(value, int) else 0


@pytest.mark.parametrize(
    ("damage", "ending"), [("truncated", "stop"), ("zeroed", "kill"), ("zeroed", "stop")]
)
def test_a_blank_journal_fails_the_task_and_no_charge_runs_again(
    daemon: Daemon, damage: str, ending: str
) -> None:
    daemon.start()
    name = daemon.submit(charges(), name="charges")
    task = daemon.task(name)
    row = daemon.wait_row(
        name,
        lambda r: r["phase"] == "model" and r["turn"] == len(CHARGES),
        what="the three charges done and the model called",
    )
    assert ledger(task) == CHARGES
    size = task.journal.stat().st_size
    if ending == "stop":
        code, _, err = daemon.stop()
        assert code == 0, err
        record = json.loads(task.state.read_bytes())
        assert record[PROGRESS] == size, "the daemon keeps the worker's progress in the record"
    else:  # nothing is written at the end: the last heartbeat alone says it
        poll_for(lambda: beat_progress(task) == size, 15, what="a beat with the progress")
        daemon.kill()
        os.kill(row["pid"], signal.SIGKILL)
        poll_for(lambda: not alive(row["pid"]), 15, what="the worker to die")
    if damage == "truncated":
        os.truncate(task.journal, 0)
    else:
        task.journal.write_bytes(bytes(size))
    blank = task.journal.read_bytes()
    if ending == "stop":  # queued, no daemon: status reads the journal and says why
        assert "damaged" in (daemon.row(name)["reason"] or ""), daemon.row(name)

    daemon.start()
    row = daemon.wait_state(name, "failed", "done", "held", timeout=30)
    assert row["state"] == "failed", row
    reason = row["reason"]
    assert str(task.journal) in reason and "damaged" in reason, reason
    assert f"recorded {size} bytes" in reason, reason
    assert "\n" not in reason
    assert ledger(task) == CHARGES, "no charge ran again"
    assert task.journal.read_bytes() == blank, "the refusal changed no byte of the journal"

    code, out, err = daemon.cli("history", name)
    assert code != 0 and out == "", (code, out)
    assert err.strip().endswith(reason) or reason in err, err
    assert len(err.strip().splitlines()) == 1, err
