"""Several nodes on one PostgreSQL (docs/design.md section 10), end to end: real daemons
(``agentd start`` with ``$AGENTD_STORE`` and ``$AGENTD_NODE``), real workers, a real
server, kill -9 and SIGSTOP of a node's whole process tree, and the CLI as operators
run it, from any node.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import psycopg
import pytest

from supervisor.daemon import Supervisor
from supervisor.pgcluster import free_port
from supervisor.placement import ClusterPlacement
from supervisor.record import TaskRecord
from supervisor.slot import TaskSlot
from tests.chaos.trees import freeze_tree, thaw
from tests.daemon import Daemon, subreaper
from tests.postgres import SeverableProxy
from tests.supervisor.test_metrics import readme_metrics
from tests.support import poll_for, reply, scripted_task, text, tool_use
from worker.config import Config
from worker.errors import StorageError
from worker.spool import Spool
from worker.store.base import Owner, SharedStore
from worker.store.postgres import PostgresStore

LEASE = 2.0
CONFIG = f"""
max_workers = 4
[heartbeat]
interval = 0.25
timeout = 5.0
[cluster]
lease = {LEASE}
[tools.policy]
run_command = "rerun"
"""


class Node:
    """One node: a spool of its own, the shared store, and its name."""

    def __init__(self, root: Path, name: str, url: str, config: str = CONFIG) -> None:
        self.name = name
        self.daemon = Daemon(root / name, config)
        self.env = {"AGENTD_STORE": url, "AGENTD_NODE": name}

    def start(self) -> None:
        self.daemon.start(self.env)

    def agentd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.daemon.run_cli(*args, env=self.env, timeout=60)

    def status(self) -> dict[str, Any]:
        done = self.agentd("status", "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def row(self, task_id: str) -> dict[str, Any]:
        return next(t for t in self.status()["tasks"] if t["id"] == task_id)

    def events_json(self, task_id: str) -> list[dict[str, Any]]:
        """The task's lifecycle events, as ``agentd logs --json`` gives them from here."""
        done = self.agentd("logs", task_id, "--json")
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        return [line for line in lines if "event" in line]

    def submit(self, task_id: str, responses: list[dict[str, Any]]) -> None:
        script = self.daemon.root / f"{task_id}.json"
        script.write_text(json.dumps({"responses": responses}))
        done = self.agentd("submit", "--name", task_id, "--prompt", "go", "--script", str(script))
        assert done.returncode == 0, done.stderr

    def signal_tree(self, sig: int) -> None:
        """``sig`` to the daemon and every process under it (fork server, workers, tools)."""
        assert self.daemon.proc is not None
        top = psutil.Process(self.daemon.proc.pid)
        for proc in [top, *top.children(recursive=True)]:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                continue
        if sig == signal.SIGKILL:
            self.daemon.proc.wait(timeout=10)


@pytest.fixture
def nodes(tmp_path: Path, postgres_schema: str) -> Iterator[list[Node]]:
    made = [Node(tmp_path, name, postgres_schema) for name in ("a", "b")]
    with subreaper():
        try:
            for node in made:
                node.start()
            yield made
        finally:
            for node in made:
                node.daemon.cleanup()


def test_a_node_spool_without_a_store_works_on_the_cluster_or_says_how(
    nodes: list[Node], tmp_path: Path, postgres_schema: str
) -> None:
    a = nodes[0]
    a.submit("first", steps(1, pause=0))
    record = (a.daemon.spool.root / "store.json").read_text()
    parts = urllib.parse.urlsplit(postgres_schema)
    assert parts.password and parts.password not in record, record

    def agentd(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        # a shell without AGENTD_STORE: only the spool says where its tasks are
        return a.daemon.run_cli(*args, env=env, timeout=60)

    refused = agentd("status", PGPASSFILE=str(tmp_path / "none"))
    assert refused.returncode == 78, refused
    assert refused.stdout == "" and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "recorded at its start" in refused.stderr and "~/.pgpass" in refused.stderr
    assert parts.password not in refused.stderr
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"{parts.hostname}:{parts.port}:*:{parts.username}:{parts.password}\n")
    pgpass.chmod(0o600)
    status = agentd("status", "--json", PGPASSFILE=str(pgpass))
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["supervisor"]["node"] == "a"
    assert [t["id"] for t in doc["tasks"]] == ["first"]
    script = tmp_path / "second.json"
    script.write_text(json.dumps({"responses": steps(1, pause=0)}))
    submitted = agentd(
        "submit",
        "--name",
        "second",
        "--prompt",
        "go",
        "--script",
        str(script),
        PGPASSFILE=str(pgpass),
    )
    assert submitted.returncode == 0, submitted.stderr
    poll_for(lambda: a.row("second")["state"] == "done", 30, what="the task submitted there done")


def steps(count: int, pause: float = 0.3) -> list[dict[str, Any]]:
    """A task of ``count`` tool turns, each a short command that logs its turn."""
    return [
        *(
            reply(tool_use("run_command", f"c{i}", command=f"sleep {pause}; echo {i} >> log.txt"))
            for i in range(count)
        ),
        reply(text("done")),
    ]


def journal(url: str, task_id: str) -> list[tuple[int, int]]:
    """(seq, epoch) of every journal record of the task, from the database itself."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT seq, epoch FROM journal WHERE task = %s ORDER BY seq", (task_id,)
        ).fetchall()
    return [(int(seq), int(epoch)) for seq, epoch in rows]


def running_on(node: Node, task_id: str) -> str:
    return str(
        poll_for(
            lambda: (
                (row := node.row(task_id))["state"] == "running"
                and row["turn"] >= 2
                and row["node"]
            ),
            20,
            interval=0.1,
            what=f"{task_id} running past turn 2",
        )
    )


def test_a_killed_node_s_task_resumes_on_the_other_within_the_lease(
    nodes: list[Node], postgres_schema: str
) -> None:
    a, b = nodes
    a.submit("t1", steps(12))
    holder = running_on(b, "t1")  # status from either node sees the whole cluster
    dead, alive = (a, b) if holder == "a" else (b, a)
    dead.signal_tree(signal.SIGKILL)

    row = poll_for(
        lambda: (r := alive.row("t1"))["state"] == "done" and r,
        40,
        interval=0.2,
        what="t1 done on the surviving node",
    )
    assert row["reason"] == "end_turn" and row["turn"] == 13
    claims = [e for e in alive.events_json("t1") if e["event"] == "task_claimed"]
    assert [c["node"] for c in claims][:1] == [dead.name]
    assert claims[-1]["node"] == alive.name
    # fencing: epochs only grow along the journal, and no seq was written twice
    epochs = [epoch for _, epoch in journal(postgres_schema, "t1")]
    assert epochs == sorted(epochs) and len(set(epochs)) >= 2
    lines = (Path(row["workspace"]) / "log.txt").read_text().split()
    assert sorted(set(lines), key=int) == [str(i) for i in range(12)]  # each turn ran
    assert len(lines) - len(set(lines)) <= 1  # only the call cut off may run again (rerun)


def test_a_node_stopped_past_its_lease_is_fenced_and_records_nothing(
    nodes: list[Node], postgres_schema: str
) -> None:
    a, b = nodes
    a.submit("t2", steps(14))
    holder = running_on(a, "t2")
    stopped, other = (a, b) if holder == "a" else (b, a)
    stopped.signal_tree(signal.SIGSTOP)
    poll_for(
        lambda: other.row("t2")["node"] == other.name,
        LEASE * 4,
        interval=0.1,
        what="the other node taking t2 over",
    )
    taken_at = len(journal(postgres_schema, "t2"))
    stopped.signal_tree(signal.SIGCONT)
    row = poll_for(
        lambda: (r := other.row("t2"))["state"] == "done" and r, 40, interval=0.2, what="t2 done"
    )
    assert row["reason"] == "end_turn"
    records = journal(postgres_schema, "t2")
    first_epoch = records[0][1]
    late = [seq for seq, epoch in records[taken_at:] if epoch == first_epoch]
    assert late == []  # nothing of the stopped node's worker after the takeover
    assert "lease_lost" in [e["event"] for e in stopped.events_json("t2")]
    assert stopped.daemon.proc is not None and stopped.daemon.proc.poll() is None  # serving


def test_every_command_works_from_any_node(nodes: list[Node]) -> None:
    a, b = nodes
    a.submit("t3", steps(30, pause=0.2))
    running_on(a, "t3")
    doc = b.status()
    assert {n["name"] for n in doc["nodes"]} == {"a", "b"}
    assert all(n["alive"] for n in doc["nodes"])
    assert doc["supervisor"]["node"] == "b"
    table = b.agentd("status").stdout.splitlines()
    assert "; node b, 2 of 2 node(s) alive" in table[0] and " NODE " in table[1]
    assert next(line for line in table if line.startswith("t3 ")).split()[9] in ("a", "b")
    listed = b.agentd("nodes", "--json")
    assert {n["name"] for n in json.loads(listed.stdout)} == {"a", "b"}
    done = b.agentd("cancel", "t3")
    assert done.returncode == 0, done.stderr
    row = poll_for(
        lambda: (r := a.row("t3"))["state"] == "cancelled" and r, 15, interval=0.1, what="cancel"
    )
    assert row["node"] is None
    again = a.agentd("retry", "t3")
    assert again.returncode == 3 and "cancelled" in again.stderr
    logs = b.agentd("logs", "t3")
    assert "task_claimed" in logs.stdout and "task_cancelled" in logs.stdout


def test_a_held_call_decided_on_one_node_resumes_on_whichever_takes_it(
    tmp_path: Path, postgres_schema: str
) -> None:
    holding = CONFIG.replace('run_command = "rerun"', 'run_command = "hold"')
    made = [Node(tmp_path, name, postgres_schema, holding) for name in ("a", "b")]
    with subreaper():
        try:
            for node in made:
                node.start()
            a, b = made
            a.submit(
                "t5", [reply(tool_use("run_command", "h1", command="sleep 30")), reply(text("ok"))]
            )
            row = poll_for(
                lambda: (r := b.row("t5"))["phase"] == "tool:run_command" and r,
                20,
                interval=0.1,
                what="t5 in its tool",
            )
            dead, alive = (a, b) if row["node"] == "a" else (b, a)
            dead.signal_tree(signal.SIGKILL)  # the call's outcome is unknown: held
            held = poll_for(
                lambda: (r := alive.row("t5"))["state"] == "held" and r,
                LEASE * 6,
                interval=0.1,
                what="t5 held on the surviving node",
            )
            assert [d["call_id"] for d in held["dangling"]] == ["h1"]
            dead.start()  # back, and the decision is taken on it
            done = dead.agentd("approve-dangling", "t5", "h1", "--skip", "--reason", "checked")
            assert done.returncode == 0, done.stderr
            row = poll_for(
                lambda: (r := alive.row("t5"))["state"] == "done" and r,
                20,
                interval=0.1,
                what="t5 done after the decision",
            )
            assert row["reason"] == "end_turn"
            claims = [e["node"] for e in alive.events_json("t5") if e["event"] == "task_claimed"]
            assert len(claims) == 3  # the first run, the takeover, the run after the decision
        finally:
            for node in made:
                node.daemon.cleanup()


def test_a_password_in_the_store_url_never_reaches_a_spool(
    nodes: list[Node], postgres_schema: str
) -> None:
    a = nodes[0]
    a.submit("t6", steps(2, pause=0.0))
    poll_for(lambda: a.row("t6")["state"] == "done", 20, interval=0.1, what="t6 done")
    password = psycopg.conninfo.conninfo_to_dict(postgres_schema).get("password")
    assert password
    for node in nodes:
        for path in node.daemon.root.rglob("*"):
            if path.is_file():
                assert str(password).encode() not in path.read_bytes(), path


def test_a_database_of_a_newer_schema_is_refused_in_one_line(
    tmp_path: Path, postgres_schema: str
) -> None:
    node = Node(tmp_path, "c", postgres_schema)
    node.daemon.spool.ensure()
    assert node.agentd("store", "init").returncode == 0
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        conn.execute("UPDATE agentd_schema SET version = version + 1")
    password = psycopg.conninfo.conninfo_to_dict(postgres_schema).get("password")
    for command in (("status",), ("start",), ("store", "init")):
        done = node.agentd(*command)
        assert done.returncode != 0, command
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "newer than this release" in lines[0], (command, lines)
        assert str(password) not in done.stderr


def test_a_wrong_store_password_is_a_setting_to_fix_exit_78_but_a_wait_for_a_worker(
    tmp_path: Path, postgres_schema: str
) -> None:
    params = psycopg.conninfo.conninfo_to_dict(postgres_schema)
    wrong = psycopg.conninfo.make_conninfo(postgres_schema, password="not-the-password")  # noqa: S106  (a wrong one)
    node = Node(tmp_path, "c", wrong)
    node.daemon.spool.ensure()
    for command in (("start",), ("start", "--detach"), ("status",), ("store", "init")):
        done = node.agentd(*command)
        assert (done.returncode, done.stdout) == (78, ""), (command, done)
        (line,) = done.stderr.splitlines()
        assert "refused the login: password authentication failed" in line, line
        assert "not-the-password" not in line and str(params["password"]) not in line
    # a worker of a running node: the same refusal is a storage fault it waits out
    with pytest.raises(StorageError, match="refused the login"):
        PostgresStore(wrong, node="c", waits=True)


def test_a_cut_database_link_is_a_storage_fault_the_task_waits_out(
    tmp_path: Path, postgres_schema: str
) -> None:
    """One node alone, its link to the database cut mid-task for longer than its lease,
    then restored: its worker stops (it could neither record nor renew), the daemon keeps
    serving, and the task resumes and ends with no crash counted (invariant 8)."""
    with SeverableProxy.in_front_of(postgres_schema) as proxy, subreaper():
        node = Node(tmp_path, "a", proxy.url_for(postgres_schema))
        try:
            node.start()
            node.submit("t7", steps(16, pause=0.2))
            running_on(node, "t7")
            proxy.sever()
            time.sleep(LEASE * 2)
            assert node.agentd("status").returncode != 0  # the CLI says it cannot reach it
            assert node.daemon.proc is not None and node.daemon.proc.poll() is None
            proxy.restore()
            row = poll_for(
                lambda: (r := node.row("t7"))["state"] == "done" and r,
                60,
                interval=0.2,
                what="t7 done once the link is back",
            )
            assert row["reason"] == "end_turn" and row["restarts"] == 0
            events = [e["event"] for e in node.daemon.log_events()]
            assert "storage_fault" in events and "storage_recovered" in events, events
            assert "crash_loop" not in events
            # one node alone: no claim of it was ever taken over, so no worker of it may be
            # stopped as lease_lost (a write kept from the claim before the cut is refused
            # once the link is back, and must not stop the worker of the claim after it)
            assert "lease_lost" not in [e["event"] for e in node.events_json("t7")]
        finally:
            node.daemon.cleanup()


def test_metrics_count_nodes_and_lost_leases(tmp_path: Path, postgres_schema: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    config = CONFIG + f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    made = [Node(tmp_path, "a", postgres_schema, config), Node(tmp_path, "b", postgres_schema)]
    with subreaper():
        try:
            for node in made:
                node.start()

            def scrape() -> dict[str, float]:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                return {
                    s.name: s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                }

            def both_nodes() -> dict[str, float] | None:
                values = scrape()
                return values if values.get("agentd_nodes") == 2 else None

            assert poll_for(both_nodes, 10)["agentd_lease_lost_total"] == 0
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                served = {f.name for f in text_string_to_metric_families(r.read().decode())}
            assert readme_metrics(shared=True) == {"agentd_nodes", "agentd_lease_lost"}
            assert served == readme_metrics() | readme_metrics(shared=True)
        finally:
            for node in made:
                node.daemon.cleanup()


def test_a_task_running_on_one_node_is_rewound_from_the_other(nodes: list[Node]) -> None:
    a, b = nodes
    a.submit("t8", steps(40, pause=0.2))
    holder = running_on(a, "t8")
    operator = b if holder == "a" else a  # the command runs where the task does not
    poll_for(lambda: operator.row("t8")["turn"] >= 4, 20, interval=0.1, what="turn 4")
    done = operator.agentd("rewind", "t8", "--to", "2", "--yes")
    assert done.returncode == 0, done.stderr
    row = poll_for(
        lambda: (r := operator.row("t8"))["state"] == "done" and r, 60, interval=0.2, what="done"
    )
    assert row["reason"] == "end_turn" and row["turn"] == 41  # the live branch, whole
    rewinds = [e for e in operator.events_json("t8") if e["event"] == "task_rewound"]
    assert len(rewinds) == 1


def test_a_fork_made_on_one_node_runs_on_any(nodes: list[Node]) -> None:
    a, b = nodes
    a.submit("t9", steps(3, pause=0.0))
    poll_for(lambda: a.row("t9")["state"] == "done", 20, interval=0.1, what="t9 done")
    done = b.agentd("fork", "t9", "--at", "1", "--name", "t9-fork")
    assert done.returncode == 0, done.stderr
    row = poll_for(
        lambda: (r := a.row("t9-fork"))["state"] == "done" and r, 20, interval=0.1, what="fork"
    )
    assert row["forked_from"] == {"task": "t9", "turn": 1} and row["turn"] == 4


def test_logs_follow_a_task_run_on_another_node_to_its_end(nodes: list[Node]) -> None:
    a, b = nodes
    a.submit("t10", steps(4, pause=0.2))
    followed = b.agentd("logs", "t10", "--follow")  # returns once the task has ended
    assert followed.returncode == 0, followed.stderr
    assert "task_claimed" in followed.stdout and "task_done" in followed.stdout
    assert b.row("t10")["state"] == "done"


def test_a_hook_names_the_node_that_ran_the_task(tmp_path: Path, postgres_schema: str) -> None:
    seen = tmp_path / "done.json"
    hook = f'[hooks]\non_done = ["sh", "-c", "cat > {seen}"]\n'
    node = Node(tmp_path, "web-1", postgres_schema, CONFIG + hook)
    with subreaper():
        try:
            node.start()
            node.submit("t11", steps(1, pause=0.0))
            payload = poll_for(
                lambda: seen.exists() and seen.read_text() and json.loads(seen.read_text()),
                20,
                interval=0.1,
                what="the on_done hook",
            )
            assert payload["task"] == "t11" and payload["node"] == "web-1"
        finally:
            node.daemon.cleanup()


def test_a_lost_lease_stops_only_the_claim_it_belongs_to(tmp_path: Path) -> None:
    """A write kept from an earlier claim (the database was away) is refused once it is
    back; if this node has claimed the task again meanwhile, the refusal is the earlier
    claim's, and the task under its new claim runs on."""
    spool = Spool(tmp_path / "spool")
    task = scripted_task(spool, steps(1, pause=0.0), name="t12")
    daemon = Supervisor(spool, Config(), preload=False)
    # (a lost lease reads nothing of the store: none is needed to lose one)
    node = ClusterPlacement(daemon, cast(SharedStore, None))
    earlier, later = Owner("t12", "a", 1), Owner("t12", "a", 2)
    slot = daemon.slots["t12"] = TaskSlot(task, TaskRecord.load(task), owner=later)
    node.lease_lost(earlier, "a write of epoch 1 refused")
    assert daemon.slots.get("t12") is slot and slot.owner == later
    assert daemon.metrics.lease_lost == 1
    node.lease_lost(later, "epoch 2 was taken over")
    assert "t12" not in daemon.slots and slot.owner is None


def test_a_thawed_daemon_whose_name_was_taken_stops_its_workers_and_waits_for_it(
    tmp_path: Path, postgres_schema: str
) -> None:
    """SIGSTOP of node a's tree past its lease, a second daemon started as node a, then
    SIGCONT: the thawed one says ``node_superseded``, its worker is killed at once, it
    runs and claims nothing and does not exit, and the name stays the second's (one row,
    its pid and epoch) until that one stops; then the first registers it again."""
    first = Node(tmp_path, "a", postgres_schema)
    second = Node(tmp_path / "again", "a", postgres_schema)
    with subreaper():
        try:
            first.start()
            first.submit("t13", steps(40, pause=0.2))
            running_on(first, "t13")
            old_worker = int(first.row("t13")["pid"])
            assert first.daemon.proc is not None
            frozen = freeze_tree(first.daemon.proc.pid)
            time.sleep(LEASE + 1.0)  # its node row and its lease are stale
            second.start()
            thaw(frozen)
            event = logged(first, "node_superseded")
            assert second.daemon.proc is not None
            assert event["level"] == "error" and event["epoch"] == 1
            assert (event["new_epoch"], event["other_pid"]) == (2, second.daemon.proc.pid)
            poll_for(lambda: not _alive(old_worker), 5, what="the thawed worker killed")
            listed = json.loads(first.agentd("nodes", "--json").stdout)
            assert [(n["name"], n["pid"], n["epoch"]) for n in listed] == [
                ("a", second.daemon.proc.pid, 2)
            ]
            row = poll_for(
                lambda: (r := second.row("t13"))["state"] == "done" and r, 40, what="t13 done"
            )
            assert row["reason"] == "end_turn" and row["turn"] == 41
            assert first.daemon.proc.poll() is None  # waiting, not exited (no exit 78)
            names = [e["event"] for e in first.daemon.log_events()]
            assert names.count("node_superseded") == 1 and "node_registered" not in names
            table = first.agentd("nodes").stdout.splitlines()
            assert table[0].split()[:4] == ["NAME", "HOST", "PID", "EPOCH"]
            assert table[1].split()[2:4] == [str(second.daemon.proc.pid), "2"]

            second.daemon.stop()  # the name is free: the first registers it again
            again = logged(first, "node_registered")
            assert again["epoch"] == 3
            listed = json.loads(first.agentd("nodes", "--json").stdout)
            assert [(n["pid"], n["epoch"]) for n in listed] == [(first.daemon.proc.pid, 3)]
        finally:
            first.daemon.cleanup()
            second.daemon.cleanup()


def logged(node: Node, name: str) -> dict[str, Any]:
    """The first event ``name`` in the node's daemon log, once it is there."""
    found = poll_for(
        lambda: next((e for e in node.daemon.log_events() if e["event"] == name), None),
        LEASE * 4,
        what=f"{name} in node {node.name}'s log",
    )
    return dict(found)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
