"""The console's reads (docs/design.md section 12): one API read of every task, and of one
task's timeline, at the sizes an operator's page asks for.

A real daemon serves the console; a script reads it over one kept-open connection with an
API token, as the page's fetches do:

* ``GET /api/tasks`` with 500 tasks (quick: 40) submitted at once, ``max_workers`` 8 of
  them in their model call and the rest queued (the status benchmark's backlog);
* ``GET /api/tasks/ID`` (its row, its history, its events) and ``GET /api/tasks/ID/messages``
  (every message of the live branch, as ``agentd show --json`` gives them) of one task of
  1,000 turns (quick: 100), each a 900-character answer, a tool call and its result.

Each read is timed ``READS`` times, start of request to last byte: the median and the
worst. The floor is the CLI reading the same (``agentd status --json`` and ``agentd show
--json`` as fresh processes): the console answers from a process that is up already.
"""

from __future__ import annotations

import http.client
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import Row
from bench.supervision import (
    Daemon,
    bench_run,
    config_text,
    idle_script,
    idle_workers,
    say,
    submit_scripted,
    timed_run,
    wait_until,
)
from supervisor.console.tokens import SpoolTokens, mint
from supervisor.record import TaskRecord
from supervisor.submit import submit
from worker.config import Config
from worker.protocol import TaskStatus
from worker.spool import Spool
from worker.testing.journals import long_journal

NAME = "console"
RUNNING = 8
READS = 15
BODY = "y" * 900


@dataclass(frozen=True)
class Plan:
    tasks: int
    turns: int


FULL = Plan(tasks=500, turns=1000)
QUICK = Plan(tasks=40, turns=100)


@dataclass(frozen=True)
class Read:
    path: str
    seconds: list[float]
    size: int  # bytes of the answer

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.seconds)

    @property
    def worst_ms(self) -> float:
        return 1000 * max(self.seconds)


def long_task(spool: Spool, workdir: Path, turns: int) -> str:
    """A task of ``turns`` turns, written as its worker would have, and ended ``done``."""
    script = workdir / "long.json"
    script.write_text('{"responses": [{"content": [{"type": "text", "text": "x"}]}]}')
    made = submit(spool, Config(), prompt="A long task.", name="long", script=script)
    long_journal(made.journal, made.id, turns, BODY)
    TaskRecord(state=TaskStatus.DONE, reason="end_turn").save(made)
    return made.id


def timed_reads(port: int, token: str, path: str) -> Read:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Authorization": f"Bearer {token}", "Host": f"127.0.0.1:{port}"}
    seconds, size = [], 0
    try:
        for _ in range(READS):
            started = time.perf_counter()
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            seconds.append(time.perf_counter() - started)
            if response.status != 200:
                raise RuntimeError(f"{path}: {response.status} {body[:200]!r}")
            size = len(body)
    finally:
        conn.close()
    return Read(path, seconds, size)


def measure(plan: Plan, workdir: Path) -> list[Row]:
    port = _free_port()
    config = config_text(max_workers=RUNNING) + f'[console]\nlisten = "127.0.0.1:{port}"\n'
    with Daemon(workdir / "d", config) as daemon:
        long_id = long_task(daemon.spool, workdir, plan.turns)
        found = [
            submit_scripted(daemon.spool, daemon.config, idle_script(), f"b{k:05d}", workdir)
            for k in range(plan.tasks - 1)
        ]
        daemon.start()
        daemon.launch(found)
        ids = [task.id for task in found]
        wait_until(
            lambda: len(idle_workers(daemon.spool, ids)) >= min(RUNNING, len(ids)),
            120 + plan.tasks / 50,
            0.5,
            f"{RUNNING} of {plan.tasks} tasks in their model call",
        )
        _, token = mint(SpoolTokens(daemon.spool), "bench")
        reads = [
            timed_reads(port, token, "/api/tasks"),
            timed_reads(port, token, f"/api/tasks/{long_id}"),
            timed_reads(port, token, f"/api/tasks/{long_id}/messages"),
        ]
        cli = [sys.executable, "-m", "supervisor", "--spool", str(daemon.spool.root)]
        floors = [
            statistics.median(timed_run([*cli, "status", "--json"], daemon.env, workdir)
                              for _ in range(3)),
            statistics.median(timed_run([*cli, "history", long_id, "--json"], daemon.env, workdir)
                              for _ in range(3)),
            statistics.median(timed_run([*cli, "show", long_id, "--json"], daemon.env, workdir)
                              for _ in range(3)),
        ]  # fmt: skip
    labels = [
        f"console GET /api/tasks @ {plan.tasks:,} tasks, {RUNNING} running",
        f"console GET /api/tasks/ID @ {plan.turns:,} turns (row, history, events)",
        f"console GET /api/tasks/ID/messages @ {plan.turns:,} turns",
    ]
    floor_names = ["status --json", f"history {long_id} --json", f"show {long_id} --json"]
    rows: list[Row] = []
    for i, (read, floor, label) in enumerate(zip(reads, floors, labels, strict=True)):
        say(
            NAME,
            f"{read.path}: median {read.median_ms:.1f} ms, worst {read.worst_ms:.1f} ms, "
            f"{read.size / 1024:.0f} KiB; the CLI's `agentd {floor_names[i]}` "
            f"{1000 * floor:.0f} ms",
        )
        rows.append(
            Row(
                NAME,
                f"{label}, median",
                "ms",
                read.median_ms,
                floor=1000 * floor,
                note=(
                    f"{READS} reads over one kept-open connection with an API token, request "
                    "to last byte. Floor: the CLI command that reads the same, a fresh "
                    "process (status --json, history --json, show --json)."
                )
                if i == 0
                else "",
            )
        )
        rows.append(Row(NAME, f"{label}, worst", "ms", read.worst_ms))
        rows.append(Row(NAME, f"{label}, size", "KiB", read.size / 1024, compare=False))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir))
