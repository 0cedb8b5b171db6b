"""Cluster benchmark (docs/design.md section 10): what a fenced step costs on PostgreSQL, against
the floor of a bare ``INSERT`` + ``COMMIT`` of the same bytes on the same server.

Both sides run on one throwaway server (``supervisor.pgcluster``: fsync and
``synchronous_commit`` on, as in production), through the same client (psycopg 3, one
autocommit connection per client, so every statement is its own transaction and one WAL
flush), with the same record bytes:

* **floor**: ``INSERT INTO floor_journal (task, seq, record) VALUES (...)``, a table with
  the journal's primary key and nothing else: the least a durable step can cost here.
* **agentd**: the fenced append (``worker.store.pglease.append``): the epoch and seq
  checked and the record written in one statement. This is the statement a step of the
  PostgreSQL store makes; the store around it is measured by the rows below.

Rows: one client's step latency (median, p99), then the aggregate steps/s of many
concurrent clients, each on its own task (where group commit shares WAL flushes: the
median of three runs). The two sides take turns throughout, so a change in the load of a
shared machine does not fall on one side only. Full mode: 2,000 steps for one client,
200 clients x 50 steps; quick: 200, and 40 x 10.

Then real nodes (``agentd start`` daemons, each with a spool of its own, sharing the
database through ``AGENTD_STORE`` and named by ``AGENTD_NODE``), in the same run:

* **failover**: two nodes, lease 5 s; a task runs on one, that node's whole process tree
  is killed (kill -9), and the clock runs from the kill to the task's next journal record
  written by the other node, read from the database. The target is the lease + 1 s; the
  peers' figures are what they document (not measured here), in the row's note.
* **status**: ``agentd --store URL status --json`` as a fresh CLI process with 1,000
  tasks in the database (one node running 8, the rest queued); the median of 15 calls.
* **scale-out**: 1,000 one-turn scripted tasks through two nodes (max_workers 8 each),
  against the same through one node on its spool (``bench.throughput``'s agentd run).
  Both nodes and the database share this machine's cores, so this measures the cost of
  the shared store more than the gain of a second machine.

Full mode: 10 failovers, 1,000 tasks for status and for scale-out; quick: 1, 100 and 50,
with only the failover judged against its target (the others are stated at 1,000).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import throughput
from bench.report import Row, percentile
from bench.supervision import (
    Daemon,
    bench_run,
    child_env,
    config_text,
    idle_script,
    kill_tree,
    machine_load,
    one_turn_script,
    say,
    timed_call,
    timed_run,
    wait_until,
)
from supervisor.pgcluster import ThrowawayCluster, find_binaries
from supervisor.stores import open_shared
from supervisor.submit import submit
from worker.config import Config
from worker.errors import ClusterError
from worker.spool import Spool
from worker.store import pgschema
from worker.store.pgcoordination import WAKE_CHANNEL
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


# -- nodes: real agentd daemons sharing the database ----------------------------------------

FAILOVER_LEASE = 5.0  # the lease the failover figure is stated at
FAILOVER_SLACK = 1.0  # its target: p50 at most the lease + 1 s
STATUS_TARGET_MS = 200.0
SCALE_TARGET = 1.5  # 2 nodes at least 1.5x the throughput of one node on the file store
NODE_WIDTH = 8  # max_workers of every node, as in bench/throughput.py
PEERS = (
    "Hatchet reassigns a dead worker's steps after 30 s; DBOS Conductor declares an executor "
    "dead after 60 s; Kubernetes evicts the pods of a lost node after about 5 min 40 s "
    "(40 s node-monitor grace period + 300 s default toleration)"
)


@dataclass(frozen=True)
class NodesPlan:
    failovers: int  # kill -9 trials
    status_tasks: int  # tasks in the database while `status --json` is timed
    status_calls: int
    tasks: int  # one-turn tasks through 2 nodes, and through one node on the file store


NODES_FULL = NodesPlan(failovers=10, status_tasks=1000, status_calls=15, tasks=1000)
NODES_QUICK = NodesPlan(failovers=1, status_tasks=100, status_calls=3, tasks=50)

#: How the failover is watched, from the database: the claim (a new epoch) and the first
#: journal record written under it (the task's next step, on the other node).
FAILOVER_POLL = """
SELECT t.node, t.epoch, EXISTS (
    SELECT 1 FROM journal j WHERE j.task = t.id AND j.epoch > %(old)s
) FROM tasks t WHERE t.id = %(task)s
"""


def node_config(lease: float) -> str:
    """A node's config: the heartbeat (which renews the lease) at 1 s, as the default."""
    return config_text(max_workers=NODE_WIDTH) + f"[cluster]\nlease = {lease}\n"


def node(root: Path, name: str, url: str, lease: float) -> Daemon:
    """A node: a daemon with a spool of its own, on the database ``url``."""
    return Daemon(root / name, node_config(lease), env={"AGENTD_STORE": url, "AGENTD_NODE": name})


def stage(
    url: str, ids: Sequence[str], script: dict[str, Any], workdir: Path, tools: Sequence[str] = ()
) -> None:
    """Submit the tasks ``ids`` to the database as ``agentd --store URL submit`` does
    (``supervisor.submit.submit`` on the shared store), in this process: much faster than
    a CLI process each. Their workspaces are in the spool ``workdir/submitter``, which
    every node on this machine reaches."""
    store = open_shared(url, node="bench", lease=Config().cluster.lease)
    spool = Spool(workdir / "submitter").ensure().on(store)
    path = workdir / "script.json"
    path.write_text(json.dumps(script))
    try:
        for task_id in ids:
            submit(spool, Config(), prompt="benchmark", name=task_id, script=path, tools=tools,
                   max_turns=10_000)  # fmt: skip
    finally:
        store.close()


def forget_tasks(url: str) -> None:
    """An empty cluster for the next figure: no task, no node."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE tasks, nodes CASCADE")


def long_script(turns: int = 600) -> dict[str, Any]:
    """A task that lists its workspace once a 0.1 s model call, for a minute or more."""
    call = {"type": "tool_use", "name": "list_dir", "input": {"path": "."}}
    step = {"content": [{"type": "text", "text": "again"}, call], "delay": 0.1}
    return {"responses": [step] * turns + [{"content": [{"type": "text", "text": "done"}]}]}


def measure_failover(url: str, trials: int, workdir: Path) -> list[float]:
    """``trials`` node deaths on two nodes (lease FAILOVER_LEASE): a task runs on one, that
    node's whole tree is killed (kill -9), and the clock runs until the task's next step
    is recorded on the other. The dead node is started again for the next trial."""
    import psycopg

    nodes = {name: node(workdir, name, url, FAILOVER_LEASE) for name in ("a", "b")}
    took: list[float] = []
    try:
        for daemon in nodes.values():
            daemon.start()
        with psycopg.connect(url, autocommit=True) as conn:
            for k in range(trials):
                task = f"failover{k}"
                stage(url, [task], long_script(), workdir, ["list_dir"])

                def running(task: str = task) -> tuple[str, int] | None:
                    row = conn.execute(
                        "SELECT node, epoch, seq FROM tasks WHERE id = %s", (task,)
                    ).fetchone()
                    return (row[0], row[1]) if row and row[0] and row[2] >= 3 else None

                victim, epoch = wait_until(running, 60, 0.02, f"{task} to run")
                dead = nodes[victim]
                t0 = time.perf_counter()
                kill_tree(dead.pid)
                assert dead.proc is not None
                dead.proc.wait(timeout=10)
                claimed = None
                while True:
                    row = conn.execute(FAILOVER_POLL, {"task": task, "old": epoch}).fetchone()
                    now = time.perf_counter()
                    assert row is not None
                    if claimed is None and row[1] > epoch:
                        claimed = now - t0
                    if row[2]:
                        break
                    if now - t0 > 60 + FAILOVER_LEASE:
                        raise TimeoutError(f"{task} made no step on another node in 60 s")
                    time.sleep(0.01)
                took.append(now - t0)
                say(NAME, f"failover {k + 1}/{trials}: node {victim} killed; node {row[0]} "
                          f"claimed {task} after {claimed:.2f} s, its next step after "
                          f"{now - t0:.2f} s")  # fmt: skip
                survivor = nodes[row[0]]  # cancelled from there, as an operator would
                cli = [sys.executable, "-m", "supervisor", "--spool", str(survivor.spool.root)]
                timed_call([*cli, "cancel", task], survivor.env, workdir)
                dead.start()
    finally:
        for daemon in nodes.values():
            daemon.close()
    return took


def measure_status(url: str, plan: NodesPlan, workdir: Path) -> tuple[list[float], float]:
    """``status --json`` (a fresh CLI process, start to exit, ms) with
    ``plan.status_tasks`` tasks in the database: one node runs NODE_WIDTH of them (each
    in an hour-long model call), the rest wait queued. Also the floor, python -c pass."""
    import psycopg

    ids = [f"s{k:05d}" for k in range(plan.status_tasks)]
    stage(url, ids, idle_script(), workdir)
    with node(workdir, "status", url, FAILOVER_LEASE) as daemon, psycopg.connect(url) as conn:
        daemon.start()
        busy = "SELECT count(*) FROM heartbeats WHERE beat->>'phase' = 'model'"
        wait_until(
            lambda: (row := conn.execute(busy).fetchone()) and row[0] >= NODE_WIDTH,
            120, 0.2, f"{NODE_WIDTH} tasks in their model call",
        )  # fmt: skip
        conn.rollback()
        cmd = [sys.executable, "-m", "supervisor", "--spool", str(daemon.spool.root)]
        calls = [
            1000 * timed_call([*cmd, "status", "--json"], daemon.env, workdir).wall
            for _ in range(plan.status_calls)
        ]
    floor = 1000 * statistics.median(
        timed_run([sys.executable, "-c", "pass"], child_env(), workdir) for _ in range(5)
    )
    say(NAME, f"status --json, {plan.status_tasks:,} tasks in the database: "
              f"{', '.join(f'{c:.0f}' for c in calls)} ms; floor {floor:.0f} ms")  # fmt: skip
    return calls, floor


def measure_scale(url: str, n: int, workdir: Path) -> tuple[float, float]:
    """Seconds for ``n`` one-turn tasks through two nodes on the database, and through
    one node on the file store (``bench.throughput``: from the first task moved into the
    spool to the last task_done). The database's tasks are created beforehand and held
    back (an operator's pause, ``paused_until``) until both nodes serve; the clock runs from
    their release, in one statement, to the last one done."""
    import psycopg

    ids = [f"t{k:05d}" for k in range(n)]
    stage(url, ids, one_turn_script(), workdir)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE tasks SET paused_until = 'infinity'")
        a, b = node(workdir, "a", url, 10.0), node(workdir, "b", url, 10.0)
        with a, b:
            a.start()
            b.start()
            ended = "SELECT count(*) FROM tasks WHERE state IN ('done', 'failed')"
            t0 = time.monotonic()
            conn.execute("UPDATE tasks SET paused_until = NULL")
            conn.execute("SELECT pg_notify(%s, %s)", (WAKE_CHANNEL, ids[0]))  # as submit does
            wait_until(lambda: (r := conn.execute(ended).fetchone()) and r[0] >= n,
                       60 + n, 0.01, f"{n} tasks to finish on two nodes")  # fmt: skip
            two = time.monotonic() - t0
            failed = conn.execute("SELECT count(*) FROM tasks WHERE state = 'failed'").fetchone()
    one, one_failed = throughput.run_agentd(workdir / "file", n)
    say(NAME, f"{n:,} one-turn tasks: 2 nodes on PostgreSQL {two:.2f} s ({n / two:.0f}/s, "
              f"{failed[0] if failed else '?'} failed); 1 node on the file store {one:.2f} s "
              f"({n / one:.0f}/s, {one_failed} failed); {machine_load()}")  # fmt: skip
    return two, one


def measure_nodes(url: str, plan: NodesPlan, workdir: Path) -> list[Row]:
    failovers = measure_failover(url, plan.failovers, workdir / "failover")
    forget_tasks(url)
    calls, floor = measure_status(url, plan, workdir / "status")
    forget_tasks(url)
    two, one = measure_scale(url, plan.tasks, workdir / "scale")
    target = FAILOVER_LEASE + FAILOVER_SLACK
    full = plan == NODES_FULL  # the other targets are stated at 1,000 tasks: judged there only
    p50 = statistics.median(failovers)
    status_ms = statistics.median(calls)
    rows = [
        Row(
            NAME, f"failover after kill -9 of a node, lease {FAILOVER_LEASE:g} s (p50)", "s",
            p50, peer=30.0, peer_name="Hatchet", target=f"<= {target:g} s (lease + 1 s)",
            met=p50 <= target,
            note=f"{NAME}: from the SIGKILL of a node's whole tree (daemon, fork server, "
            f"workers) to the task's next journal record written by the other node "
            f"(heartbeat, which renews the lease, every 1 s); {len(failovers)} trial(s): "
            f"{', '.join(f'{t:.2f}' for t in failovers)} s. Peers, as documented, not "
            f"measured here: {PEERS}.",
        ),
        Row(
            NAME, f"failover after kill -9 of a node, lease {FAILOVER_LEASE:g} s (max)", "s",
            max(failovers), peer=60.0, peer_name="DBOS Conductor",
        ),
        Row(
            NAME, f"status --json with {plan.status_tasks:,} tasks in the database (median)",
            "ms", status_ms, floor=floor, target=f"<= {STATUS_TARGET_MS:g} ms" if full else "",
            met=status_ms <= STATUS_TARGET_MS if full else None,
            note=f"{NAME}: `agentd --store URL status --json` as a fresh CLI process, start "
            f"to exit, {len(calls)} calls, worst {max(calls):.0f} ms, while one node runs "
            f"{NODE_WIDTH} of the tasks (in their model call) and the rest are queued. "
            "Floor: `python -c pass`.",
        ),
        Row(
            NAME, f"{plan.tasks:,} one-turn scripted tasks through 2 nodes (tasks/s)", "/s",
            plan.tasks / two, peer=plan.tasks / one, peer_name="1 node, file store",
            target=f">= {SCALE_TARGET:g}x peer" if full else "",
            met=one / two >= SCALE_TARGET if full else None,
            note=f"{NAME}: max_workers {NODE_WIDTH} on each node, both nodes and the "
            "database on this one machine; from the release of the tasks (created "
            "beforehand) to the last one done. Peer: the same tasks through one node on "
            "its spool (bench/throughput.py's agentd run).",
        ),
    ]  # fmt: skip
    return rows


def run(quick: bool) -> list[Row]:
    try:
        find_binaries()
    except ClusterError as exc:
        return [Row(NAME, "fenced step latency, one task (median)", "ms", None, note=str(exc))]
    print(f"{NAME}: starting a throwaway PostgreSQL", flush=True)
    with ThrowawayCluster.create() as cluster:
        rows = measure(cluster.url, quick)
        forget_tasks(cluster.url)
        plan = NODES_QUICK if quick else NODES_FULL
        nodes = bench_run(NAME, quick, lambda workdir: measure_nodes(cluster.url, plan, workdir))
        return rows + nodes
