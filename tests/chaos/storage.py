"""Storage chaos: fault class 16 of the campaign, a real daemon on a spool that fills up
and goes read-only (docs/design.md invariant 8).

The spool is a small tmpfs mounted for the run (root only; where the mount is refused the
class says so in its one row and runs nothing). A real daemon (``tests.daemon.Daemon``)
serves it with its log inside the spool, as ``agentd start --detach`` puts it, so the
daemon's own log, records and events meet the fault with its workers. Scripted tasks of
idempotent steps (``write_file``, ``read_file``) run on it, and while every one of them
is mid-run:

1. *full disk*: a file fills what is left of the spool (writes until ENOSPC), stays for
   ``hold`` seconds (longer than half the heartbeat timeout, so workers meet the fault in
   their heartbeats as well as in their journals), and is deleted;
2. *read-only spool*: the spool goes read-only for ``hold`` seconds, then read-write.
   ``mount -o remount,ro`` is refused while files are open for writing (every worker
   holds its journal open), so where it is refused a read-only bind mount is laid over
   the spool instead: every open from then on meets EROFS, as after a remount, while the
   descriptors already open keep writing below it. The row ``read-only by`` says which.

After each fault the audit reads every task's status row 5 s after the fault cleared: a
row that says ``running`` for a dead pid, or with a heartbeat older than the timeout, is
stale (a record the daemon failed to write and never rewrote). At the end every task must
be ``done``, and every record read before a fault must still be in its journal.

Figures, violations when not 0: tasks failed, records lost, daemon deaths, stale status
rows, restarts spent (storage faults must never spend the restart budget), crash loops;
and tasks completed, which must be all of them. The rest (worker exits 7, the daemon's
``storage_fault``/``storage_recovered`` lines) show that the faults were met.

``python -m tests.chaos.storage [--full]`` prints the table and exits 1 on any violation;
``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.daemon import Daemon, alive, config_text, subreaper
from tests.faults.report import Figure, campaign_main
from tests.mounts import MountRefused, fill, read_only, tmpfs
from tests.support import poll_for, reply, text, tool_use
from worker.models.base import JSON
from worker.store.journal import read_file

FAULT = "storage"
STALE_AFTER = 5.0  # seconds after a fault clears by which every status row must be true
HEARTBEAT_TIMEOUT = 6.0  # (20 fresh workers on a loaded machine: their first beats come late)
CONFIG = config_text(
    max_workers=20,
    interval=0.25,
    timeout=HEARTBEAT_TIMEOUT,
    model_call=30.0,
    tool_call=30.0,
    backoff_initial=0.2,
    backoff_max=2.0,
    model="scripted",
    sandbox=None,
    tool_modules=(),
)
ENDED = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class Plan:
    tasks: int
    turns: int
    delay: float  # seconds a scripted reply takes
    hold: float  # seconds each fault lasts
    size_mb: int  # the tmpfs

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(tasks=20, turns=120, delay=0.1, hold=3.5, size_mb=16)
        return cls(tasks=20, turns=300, delay=0.1, hold=8.0, size_mb=16)


def say(message: str) -> None:
    print(f"storage: {message}", file=sys.stderr, flush=True)


def script(turns: int, delay: float) -> list[JSON]:
    """``turns`` - 1 steps that write a file and read one back, then a final answer: every
    tool is safe to re-run, so a call cut off by a fault resumes by itself."""
    steps = []
    for i in range(1, turns):
        call = (
            tool_use("write_file", path=f"notes/{i}.txt", content=f"step {i}\n" * 20)
            if i % 2
            else tool_use("read_file", path=f"notes/{i - 1}.txt")
        )
        steps.append(reply(text(f"Step {i}."), call, delay=delay))
    return [*steps, reply(text("All done."), delay=delay)]


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Tally:
    daemon_deaths: int = 0
    stale_rows: int = 0
    failed_seen: set[str] = field(default_factory=set)
    stale_examples: list[str] = field(default_factory=list)


def records(daemon: Daemon, task_id: str) -> list[dict[str, Any]]:
    try:
        return [record for record, _ in read_file(daemon.task(task_id).journal).records]
    except Exception:  # a journal that cannot be read is compared as empty: lost
        return []


def stale(daemon: Daemon, task_id: str) -> str | None:
    """Why ``task_id``'s status row is not true, or None."""
    row = daemon.row(task_id)
    if row["state"] != "running":
        return None
    pid, age = row.get("pid"), row.get("heartbeat_age")
    if not isinstance(pid, int) or not alive(pid):
        return f"{task_id} running with dead pid {pid}"
    if age is None or age > HEARTBEAT_TIMEOUT:
        return f"{task_id} running, heartbeat {age} s old"
    return None


def watch(daemon: Daemon, ids: list[str], tally: Tally, seconds: float) -> None:
    """Sample for ``seconds``: a daemon that died, a task that failed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if daemon.proc is not None and daemon.proc.poll() is not None:
            tally.daemon_deaths += 1
            say(f"the daemon died (code {daemon.proc.returncode}):\n{daemon.log()}")
            with contextlib.suppress(AssertionError):  # it dies again: counted again
                daemon.start()
        for task_id in ids:
            with contextlib.suppress(Exception):
                if daemon.row(task_id)["state"] == "failed":
                    tally.failed_seen.add(task_id)
        time.sleep(0.1)


def audit_after_fault(daemon: Daemon, ids: list[str], tally: Tally) -> None:
    """Status rows ``STALE_AFTER`` seconds after a fault cleared."""
    watch(daemon, ids, tally, STALE_AFTER)
    found = [why for why in (stale(daemon, t) for t in ids) if why]
    tally.stale_rows += len(found)
    tally.stale_examples += found[:3]


def unfinished(daemon: Daemon, ids: list[str]) -> int:
    return sum(1 for t in ids if daemon.row(t)["state"] not in ENDED)


def mid_run(daemon: Daemon, ids: list[str], turn: int, timeout: float = 30.0) -> bool:
    """Wait until every task has recorded ``turn`` turns or ended; False if that took
    longer than ``timeout`` (tasks that stopped moving: the campaign goes on, and counts)."""

    def ready() -> bool:
        rows = [daemon.row(t) for t in ids]
        return all(r["state"] in ENDED or r["turn"] >= turn for r in rows)

    return within(ready, timeout)


def campaign(root: Path, plan: Plan) -> list[Figure]:
    spool = root / "spool"
    daemon = Daemon(root, CONFIG)
    figures: list[Figure] = []
    with tmpfs(spool, plan.size_mb):
        daemon.log_path = spool / "supervisor.log"  # where `agentd start --detach` puts it
        tally = Tally()
        try:
            daemon.start()
            ids = [
                daemon.submit(script(plan.turns, plan.delay), f"s{i:02d}")
                for i in range(plan.tasks)
            ]
            mid_run(daemon, ids, 3)
            before = {t: records(daemon, t) for t in ids}
            hit = [unfinished(daemon, ids)]
            say("filling the disk ...")
            taken = fill(spool / "fill")
            watch(daemon, ids, tally, plan.hold)
            (spool / "fill").unlink()
            say(f"space returned ({taken >> 10} KiB were taken)")
            audit_after_fault(daemon, ids, tally)
            lost_first = sum(1 for t in ids if records(daemon, t)[: len(before[t])] != before[t])
            mid_run(daemon, ids, min(daemon.row(t)["turn"] for t in ids) + 2)  # moving again
            before = {t: records(daemon, t) for t in ids}
            hit.append(unfinished(daemon, ids))
            with read_only(spool) as how:
                say(f"the spool is read-only ({how}) ...")
                watch(daemon, ids, tally, plan.hold)
            say("the spool is writable again")
            audit_after_fault(daemon, ids, tally)

            def ended() -> bool:
                watch(daemon, ids, tally, 0.0)
                return all(daemon.row(t)["state"] in ENDED for t in ids)

            finished = within(ended, 60.0)
            rows = {t: daemon.row(t) for t in ids}
            after = {t: records(daemon, t) for t in ids}
            lost = sum(1 for t in ids if after[t][: len(before[t])] != before[t]) + lost_first
            log = daemon.log_events()
            exits = [e for t in ids for e in daemon.events(t, "worker_exited")]
            exits_7 = sum(1 for e in exits if e.get("code") == 7)
            crashes = [e for e in exits if e.get("code") not in (0, 7) or e.get("signal")]
            figures += [
                Figure(FAULT, "tasks", plan.tasks),
                Figure(FAULT, "tasks mid-run when the disk filled", hit[0]),
                Figure(FAULT, "tasks mid-run when the spool went read-only", hit[1]),
                Figure(FAULT, "read-only by", how),
                Figure(FAULT, "KiB taken by the fill", taken >> 10),
                Figure(FAULT, "worker exits 7 (storage)", exits_7),
                Figure(
                    FAULT,
                    "daemon storage_fault lines",
                    sum(1 for e in log if e.get("event") == "storage_fault" and "task" not in e),
                ),
                Figure(
                    FAULT,
                    "daemon storage_recovered lines",
                    sum(1 for e in log if e.get("event") == "storage_recovered"),
                ),
            ]
            failed = len(tally.failed_seen | {t for t in ids if rows[t]["state"] == "failed"})
            restarts = sum(int(rows[t]["restarts"]) for t in ids)
            loops = sum(1 for e in log if e.get("event") == "crash_loop")
            done = sum(1 for t in ids if rows[t]["state"] == "done")
            figures += [
                must_be_zero("tasks failed", failed),
                must_be_zero("records lost", lost),
                must_be_zero("daemon deaths", tally.daemon_deaths),
                must_be_zero(f"stale status rows {STALE_AFTER:g} s after", tally.stale_rows),
                must_be_zero("worker crashes (not exit 0 or 7)", len(crashes)),
                must_be_zero("restarts spent", restarts),
                must_be_zero("crash loops", loops),
                Figure(
                    FAULT,
                    "tasks completed",
                    f"{done}/{plan.tasks}",
                    not finished or done != plan.tasks,
                ),
            ]
            if crashes:
                figures.append(Figure(FAULT, "crashes seen", "; ".join(map(str, crashes[:3]))))
            if tally.stale_examples:
                figures.append(Figure(FAULT, "stale rows seen", "; ".join(tally.stale_examples)))
        finally:
            with contextlib.suppress(Exception):
                (spool / "fill").unlink()
            daemon.cleanup()
    return figures


def within(predicate: Callable[[], bool], timeout: float) -> bool:
    """``poll_for`` that answers False instead of failing: a campaign counts, not asserts."""
    try:
        poll_for(predicate, timeout, interval=0.1)
    except AssertionError:
        return False
    return True


def must_be_zero(name: str, value: int) -> Figure:
    return Figure(FAULT, name, value, value != 0)


def run(quick: bool) -> list[Figure]:
    plan = Plan.of(quick)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-storage-") as folder, subreaper():
        try:
            figures = campaign(Path(folder), plan)
        except MountRefused as exc:
            return [Figure(FAULT, "NOT RUN: the tmpfs spool could not be mounted", str(exc))]
        except Exception as exc:
            traceback.print_exc()
            figures = [Figure(FAULT, "could not run", f"{type(exc).__name__}: {exc}", True)]
    figures.append(Figure(FAULT, "runtime s", round(time.monotonic() - started, 1)))
    return figures


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.storage", __doc__ or "", argv, seeded=False)


if __name__ == "__main__":
    sys.exit(main())
