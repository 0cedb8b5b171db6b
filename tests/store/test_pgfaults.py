"""Every database fault is a wait (invariant 8), told by its SQLSTATE: each fault made on
a real PostgreSQL (a read-only database, an administrator's terminate, a serialization
failure, a refused password, a role out of connections) is a ``StorageError`` naming its
cause, and the store goes on once it clears. A write whose reply was cut after the server
ran it (``SeverableProxy.sever_at_reply``) is read back by the fence when it is retried:
written once, reported as written."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests.postgres import SeverableProxy, with_query
from tests.store.conftest import new_task
from tests.store.test_postgres import _reachable
from tests.support import poll_for
from worker.errors import ConfigError, StorageError, storage_fault
from worker.store.pgdatabase import DatabaseFault, database_fault
from worker.store.pglease import TAKEOVER_MARGIN
from worker.store.postgres import PostgresStore


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[SeverableProxy]:
    with SeverableProxy.in_front_of(postgres_url) as cut:
        yield cut


def make(url: str, node: str = "node-a", **kw: Any) -> PostgresStore:
    return PostgresStore(url, node=node, lease=30.0, migrate=True, **kw)


def fault_of(step: Callable[[], object]) -> StorageError:
    with pytest.raises(StorageError) as caught:
        step()
    assert storage_fault(caught.value) is caught.value  # a wait, not a crash
    return caught.value


def admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def options_of(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query)).get("options", "")


def test_a_read_only_database_is_a_wait_and_reads_go_on(postgres_schema: str) -> None:
    """25006, which psycopg raises as an ``InternalError``: what a standby after a failover
    answers, or a server set ``default_transaction_read_only``."""
    make(postgres_schema).close()  # the schema, made while it may be written
    read_only = with_query(
        postgres_schema,
        options=f"{options_of(postgres_schema)} -cdefault_transaction_read_only=on",
    )
    store = PostgresStore(read_only, node="node-a")
    try:
        with (
            pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as raw,
            admin(read_only) as conn,
        ):
            conn.execute("INSERT INTO nodes VALUES ('x', 'h', 1, 1, 1)")
        assert database_fault(raw.value) is DatabaseFault.READ_ONLY
        fault = fault_of(lambda: store.join(4))
        assert fault.cause == "read_only" and "is read-only" in str(fault)
        fault_of(lambda: store.append_event("t1", {"event": "e"}))
        assert store.task_ids() == []  # reads are served all along
    finally:
        store.close()


def test_an_administrator_terminate_is_a_wait_and_the_next_step_reconnects(
    postgres_schema: str,
) -> None:
    """57P01 (``pg_terminate_backend``, and what every connection meets when the server is
    shut down or restarted)."""
    store = make(postgres_schema)
    try:
        task = new_task(store)
        store.get_record(task)  # a connection, idle in the store
        with admin(postgres_schema) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'agentd node-a'"
            )
        fault = fault_of(lambda: store.get_record(task))
        assert fault.cause in ("shutdown", "lost")  # the FATAL line, or only the EOF after it
        assert store.get_record(task)[0] == {"state": "queued"}  # reconnected by itself
    finally:
        store.close()


def test_a_serialization_failure_is_a_wait(postgres_schema: str) -> None:
    """40001, from two serializable transactions that each read what the other writes."""
    make(postgres_schema).close()
    with admin(postgres_schema) as setup:
        setup.execute("CREATE TABLE pair (k int PRIMARY KEY, v int)")
        setup.execute("INSERT INTO pair VALUES (1, 0), (2, 0)")
    one, two = psycopg.connect(postgres_schema), psycopg.connect(postgres_schema)
    try:
        for conn in (one, two):
            conn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        one.execute("SELECT sum(v) FROM pair").fetchone()
        two.execute("SELECT sum(v) FROM pair").fetchone()
        one.execute("UPDATE pair SET v = 1 WHERE k = 1")
        two.execute("UPDATE pair SET v = 1 WHERE k = 2")
        one.commit()
        with pytest.raises(psycopg.errors.SerializationFailure) as raw:
            two.commit()
    finally:
        one.close()
        two.close()
    assert database_fault(raw.value) is DatabaseFault.CONFLICT
    store = PostgresStore(postgres_schema, node="node-a")
    try:
        fault = store.db.fault(raw.value)
        assert fault is not None and fault.fault and fault.cause == "conflict"
    finally:
        store.close()


def test_a_refused_password_is_a_setting_at_start_and_a_wait_once_the_node_runs(
    postgres_schema: str,
) -> None:
    """28P01: ``agentd start`` stops on it (``ConfigError``, exit 78, one line); a running
    node's store waits for it, names it, and logs in again with the URL it is given."""
    wrong = make_conninfo(postgres_schema, password="not-the-password")  # noqa: S106
    with pytest.raises(ConfigError, match="refused the login"):
        PostgresStore(wrong, node="node-a")
    assert fault_of(lambda: PostgresStore(wrong, node="node-a", waits=True)).cause == "login"

    store = make(postgres_schema)
    try:
        task = new_task(store)
        store.db.relogin(wrong)  # the password changed under the running node
        fault = fault_of(lambda: store.get_record(task))
        assert fault.cause == "login" and "not-the-password" not in str(fault)
        store.db.relogin(postgres_schema)  # SIGHUP read the new one
        assert store.get_record(task)[0] == {"state": "queued"}
    finally:
        store.close()


def test_a_role_out_of_connections_is_a_wait(postgres_schema: str) -> None:
    """53300: ``too many connections for role`` (a role's CONNECTION LIMIT; the server's
    ``max_connections`` says much the same)."""
    make(postgres_schema).close()
    role = "agentd_test_limited"
    with admin(postgres_schema) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {role}")
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'limited' CONNECTION LIMIT 0")
    try:
        limited = make_conninfo(postgres_schema, user=role, password="limited")  # noqa: S106
        fault = fault_of(lambda: PostgresStore(limited, node="node-a"))
        assert fault.cause == "resources" and "out of resources" in str(fault)
    finally:
        with admin(postgres_schema) as conn:
            conn.execute(f"DROP ROLE {role}")


def test_what_is_no_fault_is_raised_as_it_is(postgres_schema: str) -> None:
    """A statement the server refuses for what it says (a bug of ours) is no wait."""
    with admin(postgres_schema) as conn, pytest.raises(psycopg.errors.UndefinedTable) as raw:
        conn.execute("SELECT * FROM no_such_table")
    assert database_fault(raw.value) is None
    assert database_fault(ValueError("not a driver's")) is None


# -- a write whose reply was lost ---------------------------------------------------------


def test_writes_whose_reply_was_cut_are_read_back_when_retried(
    postgres_schema: str, proxy: SeverableProxy
) -> None:
    """The server ran each write and the reply never came: the retry finds its own commit
    and reports it as made, once (no second event, no refused decision or cancel)."""
    store = make(proxy.url_for(postgres_schema))
    try:
        task = new_task(store)
        owner = store.acquire(task)
        writer, _ = store.open_journal(owner, header={"task": task})
        _, version = store.get_record(task)
        event = {"event": "e", "timestamp": "2026-01-01T00:00:00.000001Z"}
        steps: dict[str, Callable[[], object]] = {
            "append_event": lambda: store.append_event(task, event),
            "record_decision": lambda: store.record_decision(task, "agentd-k", 1, {"a": 1}),
            "request_cancel": lambda: store.request_cancel(task, {"by": "op"}),
            "cas_record": lambda: store.cas_record(task, version, {"state": "held"}),
        }
        answers: dict[str, Any] = {}
        for name, step in steps.items():
            proxy.sever_at_reply()
            fault_of(step)
            proxy.restore()
            poll_for(lambda: _reachable(store), what="the store to reconnect")
            answers[name] = step()  # as the daemon's backlog or a worker retries it
        assert answers["record_decision"] is True and answers["request_cancel"] is True
        assert answers["cas_record"].token == str(int(version.token) + 1)
        assert proxy.severed_at_reply == len(steps)
        events, _ = store.read_events(task)
        assert events.count(event) == 1

        record = {"k": "user", "content": "once"}
        proxy.sever_at_reply()
        fault_of(lambda: writer.append([record]))
        proxy.restore()
        poll_for(lambda: _reachable(store), what="the store to reconnect")
        _, after = store.open_journal(owner, after=writer.cursor)  # (a worker reopens it)
        assert after == [record] and store.replay(task)[1:] == [record]

        released = {"state": "backoff", "reason": "cut"}
        proxy.sever_at_reply()
        fault_of(lambda: store.put_record(owner, released, release=True))
        proxy.restore()
        poll_for(lambda: _reachable(store), what="the store to reconnect")
        store.put_record(owner, released, release=True)  # its own release: no fence refusal
        assert store.get_record(task)[0] == released and not store.owned(task)
    finally:
        store.close()


def test_a_handover_whose_reply_was_cut_is_read_back(
    postgres_schema: str, proxy: SeverableProxy
) -> None:
    store = make(proxy.url_for(postgres_schema))
    try:
        new_task(store)
        (owner,) = store.claim(1)
        proxy.sever_at_reply()
        fault_of(lambda: store.handover(owner))
        proxy.restore()
        poll_for(lambda: _reachable(store), what="the store to reconnect")
        assert store.handover(owner).epoch == owner.epoch + 1
    finally:
        store.close()


def test_time_a_node_could_not_read_the_leases_does_not_count(
    postgres_schema: str, proxy: SeverableProxy
) -> None:
    """While the database was away from a node, it cannot tell whether a holder could
    renew: that time does not count toward a lease standing still. A holder that waited
    out the same fault (with a call's result in hand) renews once the database is back,
    before the node may take its lease; one that does not is taken over a lease after."""
    holder = PostgresStore(postgres_schema, node="a", lease=0.5, migrate=True)
    taker = PostgresStore(proxy.url_for(postgres_schema), node="b", lease=30.0)
    try:
        new_task(holder, "t1")
        (held,) = holder.claim(1)
        new_task(holder, "t2")
        assert [o.task_id for o in taker.claim(1, expired=False)] == ["t2"]  # t1 watched
        proxy.sever()  # the database away (for the holder too: it renews nothing)
        fault_of(lambda: taker.claim(1))
        time.sleep(0.5 + TAKEOVER_MARGIN + 0.5)  # longer than the lease and the margin
        proxy.restore()
        poll_for(lambda: _reachable(taker), what="the store to reconnect")
        assert taker.claim(1) == []  # (the first read after a fault judges nothing)
        holder.renew(held)  # the holder, back too, renews: its lease was never over
        stopped = time.monotonic()  # (and renews no more)
        assert taker.claim(1) == []
        (taken,) = poll_for(lambda: taker.claim(1), 10, interval=0.05, what="t1 taken")
        assert time.monotonic() - stopped >= 0.5 + TAKEOVER_MARGIN
        assert (taken.task_id, taken.epoch) == ("t1", held.epoch + 1)
        assert taken.previous is not None and taken.previous.node == "a"
    finally:
        holder.close()
        taker.close()
