"""A database at fault is a wait for a whole node (invariant 8), end to end: a real daemon
and its workers on a database that turns read-only (as a failover onto a standby does)
for longer than the lease, then writable again. The node never dies, no task fails, no
crash is counted, no unsafe call runs twice, and none that ran is held."""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import psycopg
import pytest

from tests.daemon import subreaper
from tests.postgres import with_address
from tests.supervisor.test_cluster import CONFIG as CLUSTER_CONFIG
from tests.supervisor.test_cluster import LEASE, Node, running_on, steps
from tests.support import poll_for

#: The cluster's config, but an unsafe call cut off would be held (no ``rerun``).
CONFIG = CLUSTER_CONFIG.replace('[tools.policy]\nrun_command = "rerun"\n', "")


class Standby:
    """A role of its own for the node, whose sessions an administrator turns read-only
    (``default_transaction_read_only``) or writable again, ending the sessions it has so
    that every one comes back as the new setting says: what a node sees when its database
    fails over onto a standby (read-only), then is promoted."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.role = f"agentd_test_{secrets.token_hex(4)}"
        password = secrets.token_hex(8)
        schema = dict(parse_qsl(urlsplit(admin_url).query))["options"].partition("=")[2]
        parts = urlsplit(admin_url)
        self.url = with_address(admin_url, parts.hostname or "127.0.0.1", parts.port or 5432)
        self.url = self.url.replace(
            f"//{parts.netloc.rpartition('@')[0]}@", f"//{self.role}:{password}@", 1
        )
        self.schema = schema
        self._sql(
            f"CREATE ROLE {self.role} LOGIN PASSWORD '{password}'",
            f"GRANT ALL ON SCHEMA {schema} TO {self.role}",
        )

    def _sql(self, *statements: str) -> None:
        """Run ``statements`` (of constants and the role's name), then end the role's
        sessions: each comes back as the role's settings now say."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # (of constants and the role's name)
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (self.role,),
            )

    def read_only(self, on: bool) -> None:
        setting = (
            "SET default_transaction_read_only = on"
            if on
            else "RESET default_transaction_read_only"
        )
        self._sql(f"ALTER ROLE {self.role} {setting}")

    def drop(self) -> None:
        self._sql(f"REVOKE ALL ON SCHEMA {self.schema} FROM {self.role}")
        self._sql(
            f"DROP OWNED BY {self.role} CASCADE",
            f"DROP ROLE {self.role}",
        )


@pytest.fixture
def standby(postgres_schema: str) -> Iterator[Standby]:
    made = Standby(postgres_schema)
    try:
        yield made
    finally:
        made.drop()


def test_a_read_only_database_past_the_lease_is_waited_out_by_the_node(
    tmp_path: Path, standby: Standby
) -> None:
    with subreaper():
        node = Node(tmp_path, "a", standby.url, CONFIG)
        try:
            node.start()
            for n in (1, 2):
                node.submit(f"t{n}", steps(10, pause=0.3))
            running_on(node, "t1")
            standby.read_only(True)
            poll_for(
                lambda: "storage_fault" in [e["event"] for e in node.daemon.log_events()],
                20,
                what="the node to see the database read-only",
            )
            assert node.daemon.proc is not None
            time.sleep(LEASE * 2)  # the fault lasts past the lease
            assert node.daemon.proc.poll() is None  # the node waits
            standby.read_only(False)
            for n in (1, 2):
                row = poll_for(
                    functools.partial(ended, node, f"t{n}"),
                    60,
                    interval=0.2,
                    what=f"t{n} ended once the database is writable",
                )
                assert isinstance(row, dict) and row["restarts"] == 0
                lines = (Path(row["workspace"]) / "log.txt").read_text().split()
                assert len(lines) == len(set(lines))  # no unsafe call ran twice
                if row["state"] == "held":
                    # only an intent whose own write met the fault (the call never ran:
                    # its line is missing) may be held, its outcome unknown to the next
                    # worker; a call that ran is never held (its result waited)
                    assert lines == [str(i) for i in range(len(lines))], lines
                    (held,) = node.row(f"t{n}")["dangling"]
                    assert held["call_id"] == f"c{len(lines)}", (held, lines)
                else:
                    assert (row["state"], row["reason"]) == ("done", "end_turn")
                    # each unsafe call ran once (else: what the journal says of each call)
                    assert lines == [str(i) for i in range(10)], calls_told(node, f"t{n}")
            assert node.daemon.proc.poll() is None
            events = [e["event"] for e in node.daemon.log_events()]
            assert "storage_recovered" in events and "crash_loop" not in events
            assert "worker_hung" not in events and "task_failed" not in events
        finally:
            node.daemon.cleanup()


def ended(node: Node, task_id: str) -> dict[str, Any] | None:
    row = node.row(task_id)
    return row if row["state"] in ("done", "held", "failed") else None


def calls_told(node: Node, task_id: str) -> str:
    """What the task's journal says of each tool call (``agentd show --json``): for a
    failure's message."""
    done = node.agentd("show", task_id, "--json")
    return "\n".join(
        line for line in done.stdout.splitlines() if '"tool_use"' in line or '"tool_result"' in line
    )[:6000]
