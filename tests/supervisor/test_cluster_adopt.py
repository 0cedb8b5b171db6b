"""A node started again on a shared store adopts the workers its killed daemon left
(docs/design.md section 10), as a daemon on a spool does: real daemons, real workers on a
real PostgreSQL, ``kill -9`` of the daemon alone. The task goes on under the same claim,
without waiting for its lease to run out and without a second claim; a worker the
heartbeat does not name is never adopted."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import psutil

from tests.daemon import subreaper
from tests.supervisor.test_cluster import Node, journal, running_on, steps
from tests.support import poll_for


def test_a_node_whose_daemon_was_killed_adopts_its_running_workers(
    tmp_path: Path, postgres_schema: str
) -> None:
    with subreaper():
        a = Node(tmp_path, "a", postgres_schema)
        try:
            a.start()
            for n in (1, 2):
                a.submit(f"t{n}", steps(20, pause=0.5))
            running_on(a, "t1")
            pids = {t: poll_for(functools.partial(_pid, a, t)) for t in ("t1", "t2")}
            claims = {t: len(a.events_json(t)) for t in pids}
            a.daemon.kill()  # the daemon alone: its workers run on, orphans
            assert all(psutil.pid_exists(pid) for pid in pids.values())
            a.start()  # the same node, started again at once (as systemd would)
            for task, pid in pids.items():
                adopted = functools.partial(_adopted, a, task, pid)
                poll_for(adopted, 30, interval=0.2, what=f"{task}'s worker {pid} adopted")
            for task in pids:
                done = functools.partial(_done, a, task)
                row = poll_for(done, 60, interval=0.2, what=f"{task} done")
                assert (row["reason"], row["restarts"]) == ("end_turn", 0)
                lines = (Path(row["workspace"]) / "log.txt").read_text().split()
                assert lines == [str(i) for i in range(20)]  # each call once, none cut off
                events = a.events_json(task)
                later = [e["event"] for e in events[claims[task] :]]
                assert "task_claimed" not in later and "lease_lost" not in later, later
                assert {epoch for _, epoch in journal(postgres_schema, task)} == {1}  # one claim
        finally:
            a.daemon.cleanup()


def _pid(node: Node, task_id: str) -> int | None:
    return node.row(task_id)["pid"] or None


def _adopted(node: Node, task_id: str, pid: int) -> bool:
    events = node.events_json(task_id)
    return any(e["event"] == "worker_adopted" and e["pid"] == pid for e in events)


def _done(node: Node, task_id: str) -> dict[str, Any] | None:
    row = node.row(task_id)
    return row if row["state"] == "done" else None
