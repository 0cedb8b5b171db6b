"""Cluster benchmark (DESIGN.md section 10): what a fenced step costs on PostgreSQL, against
the floor of a bare ``INSERT`` + ``COMMIT`` of the same bytes on the same server.

Both sides run on one throwaway server (``supervisor.pgcluster``: fsync and
``synchronous_commit`` on, as in production), through the same client (psycopg 3, one
autocommit connection per client, so every statement is its own transaction and one WAL
flush), with the same record bytes:

* **floor**: ``INSERT INTO floor_journal (task, seq, record) VALUES (...)``, a table with
  the journal's primary key and nothing else: the least a durable step can cost here.
* **agentd**: the fenced append (``worker.store.pglease.append``): the epoch and seq
  checked and the record written in one statement. This is the statement a step of the
  PostgreSQL store makes; the store around it (``worker/store/postgres.py``) is measured
  once it exists.

Rows: one client's step latency (median, p99), then the aggregate steps/s of many
concurrent clients, each on its own task (where group commit shares WAL flushes: the
median of three runs). The two sides take turns throughout, so a change in the load of a
shared machine does not fall on one side only. Full mode: 2,000 steps for one client,
200 clients x 50 steps; quick: 200, and 40 x 10.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from bench.report import Row, percentile
from supervisor.pgcluster import ThrowawayCluster, find_binaries
from worker.errors import ClusterError
from worker.store import pgschema
from worker.store.pglease import append, claim

if TYPE_CHECKING:
    from worker.store.pgschema import Connection

NAME = "cluster"
LATENCY_TARGET = 1.5  # fenced step latency at most 1.5x the floor's
THROUGHPUT_TARGET = 0.7  # aggregate steps/s at least 0.7x the floor's
BLOCK = 100  # one-client steps a side makes before the other side's turn
ROUNDS = 3  # concurrent runs of each side, taking turns; the median is reported

#: One step's record: a tool turn's JSON, about 1.5 KB (under TOAST's threshold, as most
#: records are).
RECORD = json.dumps(
    {
        "kind": "turn",
        "turn": 42,
        "message": {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading the file before editing it. " * 20},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "read_file",
                    "input": {"path": "src/module.py"},
                },
            ],
        },
        "usage": {"input_tokens": 12034, "output_tokens": 311},
    }
).encode()

FLOOR_TABLE = """
CREATE TABLE floor_journal (
    task text NOT NULL, seq bigint NOT NULL, record bytea NOT NULL, PRIMARY KEY (task, seq)
)
"""

Step = Callable[["Connection", str, int], None]


def _floor_step(conn: Connection, task: str, seq: int) -> None:
    conn.execute(
        "INSERT INTO floor_journal (task, seq, record) VALUES (%s, %s, %s)", (task, seq, RECORD)
    )


def _fenced_step(conn: Connection, task: str, seq: int) -> None:
    append(conn, task, 1, seq - 1, [RECORD])


def _prepare(url: str, clients: int, prefix: str) -> list[str]:
    """Tasks for ``clients`` writers, each claimed (epoch 1) so its appends are fenced."""
    import psycopg

    tasks = [f"{prefix}-{n}" for n in range(clients)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO tasks (id, spec) SELECT unnest(%s::text[]), '{}'", (tasks,))
        while claim(conn, "bench", clients, 3600):
            pass
    return tasks


def _latencies(
    url: str, sides: Mapping[str, tuple[Step, str]], steps: int
) -> dict[str, list[float]]:
    """One client per side stepping its own task, the sides taking turns in blocks of
    ``BLOCK`` steps, so that a change in the machine's load falls on both alike."""
    import psycopg

    took: dict[str, list[float]] = {name: [] for name in sides}
    conns = {name: psycopg.connect(url, autocommit=True) for name in sides}
    try:
        for first in range(1, steps + 1, BLOCK):
            for name, (step, task) in sides.items():
                for seq in range(first, min(first + BLOCK, steps + 1)):
                    t0 = time.perf_counter()
                    step(conns[name], task, seq)
                    took[name].append(time.perf_counter() - t0)
    finally:
        for conn in conns.values():
            conn.close()
    warm = min(20, steps // 10)  # past connection warm-up and statement preparation
    return {name: [t * 1000 for t in times[warm:]] for name, times in took.items()}


def _steps_per_second(url: str, step: Step, tasks: list[str], steps: int) -> float:
    """Every client steps ``steps`` times on its own task, all at once."""
    import psycopg

    conns = [psycopg.connect(url, autocommit=True) for _ in tasks]
    start = threading.Barrier(len(tasks) + 1)
    errors: list[BaseException] = []

    def client(conn: Connection, task: str) -> None:
        try:
            start.wait(60)
            for seq in range(1, steps + 1):
                step(conn, task, seq)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=client, args=pair) for pair in zip(conns, tasks, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        start.wait(60)
        t0 = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - t0
    finally:
        for conn in conns:
            conn.close()
    if errors:
        raise errors[0]
    return len(tasks) * steps / elapsed


def measure(url: str, quick: bool) -> list[Row]:
    import psycopg

    one, clients, each = (200, 40, 10) if quick else (2000, 200, 50)
    with psycopg.connect(url, autocommit=True) as conn:
        pgschema.migrate(conn)
        conn.execute(FLOOR_TABLE)
    sides = {"floor": (_floor_step, "one"), "agentd": (_fenced_step, _prepare(url, 1, "one")[0])}
    latencies = _latencies(url, sides, one)
    floor_ms, agentd_ms = latencies["floor"], latencies["agentd"]
    floor_rates, agentd_rates = [], []
    for n in range(ROUNDS):  # taking turns, as above
        floor_tasks = [f"floor{n}-{c}" for c in range(clients)]
        floor_rates.append(_steps_per_second(url, _floor_step, floor_tasks, each))
        fenced_tasks = _prepare(url, clients, f"many{n}")
        agentd_rates.append(_steps_per_second(url, _fenced_step, fenced_tasks, each))
    floor_rate, agentd_rate = statistics.median(floor_rates), statistics.median(agentd_rates)

    rows = []
    for name, q in (("median", 0.5), ("p99", 0.99)):
        ours, floor = percentile(agentd_ms, q), percentile(floor_ms, q)
        rows.append(Row(
            NAME, f"fenced step latency, one task ({name})", "ms", ours, floor,
            target=f"<= {LATENCY_TARGET}x floor", met=ours <= LATENCY_TARGET * floor,
        ))  # fmt: skip
    rows.append(Row(
        NAME, f"aggregate steps/s, {clients} concurrent tasks", "steps/s", agentd_rate,
        floor_rate, target=f">= {THROUGHPUT_TARGET}x floor",
        met=agentd_rate >= THROUGHPUT_TARGET * floor_rate,
        note=f"{NAME}: agentd = the fenced append statement (worker/store/pglease.py); "
        f"floor = a bare INSERT + COMMIT of the same {len(RECORD)} bytes; one psycopg "
        f"connection per client; steps/s of each run, floor {_rates(floor_rates)}, agentd "
        f"{_rates(agentd_rates)}",
    ))  # fmt: skip
    return rows


def _rates(rates: list[float]) -> str:
    return "/".join(f"{rate:,.0f}" for rate in rates)


def run(quick: bool) -> list[Row]:
    try:
        find_binaries()
    except ClusterError as exc:
        return [Row(NAME, "fenced step latency, one task (median)", "ms", None, note=str(exc))]
    print(f"{NAME}: starting a throwaway PostgreSQL", flush=True)
    with ThrowawayCluster.create() as cluster:
        return measure(cluster.url, quick)
