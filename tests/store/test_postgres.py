"""What only the PostgreSQL store promises, on a real server: two nodes fenced by the
lease, a lost database as a storage fault (through a proxy the test cuts), the password
kept out of every message, ``synchronous_commit`` on whatever the server's default, and
psycopg imported by no other module."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from tests.postgres import SeverableProxy, with_query
from tests.store.conftest import new_task
from tests.store.test_loop_on_store import make_loop
from tests.support import REPO, poll_for
from worker.errors import ConfigError, FencedError, LockBusyError, StorageError, storage_fault
from worker.loop import Outcome
from worker.protocol import ExitCode
from worker.spool import TaskSpec
from worker.state import TaskState
from worker.store.base import JSON, Snapshot
from worker.store.postgres import PostgresStore

SECRET = "not-to-be-shown-7f3a"  # noqa: S105  (a made-up password the test looks for)


def user(text: str) -> JSON:
    return {"k": "user", "content": [{"type": "text", "text": text}]}


def with_secret(url: str) -> tuple[str, str]:
    """``url`` with a password, and the password: the server's own when the URL has one,
    else ``SECRET`` (a server that trusts local users ignores it)."""
    scheme, _, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    name, colon, password = userinfo.partition(":")
    if at and colon and password:
        return url, password
    name = name or os.environ.get("USER", "postgres")
    return f"{scheme}://{name}:{SECRET}@{host if at else rest}", SECRET


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[SeverableProxy]:
    with SeverableProxy.in_front_of(postgres_url) as cut:
        yield cut


def make(url: str, node: str, lease: float = 30.0) -> PostgresStore:
    return PostgresStore(url, node=node, lease=lease, migrate=True)


def test_a_node_whose_lease_ran_out_is_fenced_by_the_node_that_took_over(
    postgres_schema: str,
) -> None:
    a, b = make(postgres_schema, "node-a", lease=0.5), make(postgres_schema, "node-b")
    try:
        task = new_task(a)
        mine = a.acquire(task)
        writer, _ = a.open_journal(mine, header={"task": task})
        a.renew(mine)  # renewed on the server's clock: still a's
        with pytest.raises(LockBusyError, match="node-a"):
            b.acquire(task)
        theirs = b.acquire(task, wait=5)  # once a's lease has run out
        assert theirs.epoch > mine.epoch and b.owned(task)
        with pytest.raises(FencedError):
            writer.append([user("by a, too late")])
        with pytest.raises(FencedError):
            a.renew(mine)
        taken, _ = b.open_journal(theirs, header={"task": task})
        taken.append([user("by b")])
        assert [r["k"] for r in b.replay(task)] == ["header", "user"]
        assert b.replay(task)[-1] == user("by b")  # nothing of a's after the fence
    finally:
        a.close()
        b.close()


def test_every_step_costs_one_round_trip(postgres_schema: str, proxy: SeverableProxy) -> None:
    """One statement a step, in its own transaction: no BEGIN, no COMMIT, no read of the
    fence first (a held record's check is a read, and rides on nothing)."""
    store = make(proxy.url_for(postgres_schema), "node-a")
    try:
        task = new_task(store)
        owner = store.acquire(task)
        writer, _ = store.open_journal(owner, header={"task": task})
        _, version = store.get_record(task)
        steps: dict[str, Callable[[int], object]] = {
            "append": lambda i: writer.append([user(f"step {i}")]),
            "put_snapshot": lambda i: store.put_snapshot(
                owner, Snapshot(writer.cursor, TaskState("Do the thing."))
            ),
            "record_decision": lambda i: store.record_decision(task, "agentd-k", i, {"n": i}),
            "request_cancel": lambda i: store.request_cancel(task, {"n": i}),
            "append_event": lambda i: store.append_event(task, {"event": "e", "n": i}),
            "publish_heartbeat": lambda i: store.publish_heartbeat(task, {"turn": i}),
            "renew": lambda i: store.renew(owner),
            "get_record": lambda i: store.get_record(task),
            "replay": lambda i: store.replay(task, writer.cursor),
        }
        for i in range(8):  # past psycopg's prepare_threshold: the steady state
            for step in steps.values():
                step(i)
        version = store.get_record(task)[1]
        for name, step in steps.items():
            before = proxy.exchanges
            step(100)
            assert proxy.exchanges - before == 1, name
        before = proxy.exchanges
        store.cas_record(task, version, {"state": "running"})
        assert proxy.exchanges - before == 1, "cas_record"
    finally:
        store.close()


def test_a_lost_database_is_a_storage_fault_and_the_store_comes_back_with_it(
    postgres_schema: str, proxy: SeverableProxy
) -> None:
    store = make(proxy.url_for(postgres_schema), "node-a")
    try:
        task = new_task(store)
        owner = store.acquire(task)
        writer, _ = store.open_journal(owner, header={"task": task})
        writer.append([user("before the cut")])

        proxy.sever()
        with pytest.raises(StorageError) as cut:
            writer.append([user("during the cut")])
        assert storage_fault(cut.value) is cut.value  # a wait (invariant 8), not a crash
        with pytest.raises(StorageError) as refused:
            store.get_record(task)  # a new connection is refused: a fault as well
        assert refused.value.fault
        with pytest.raises(StorageError, match="failed write"):
            writer.append([user("on a writer that failed")])

        proxy.restore()
        poll_for(lambda: _reachable(store), what="the store to reconnect")
        again, records = store.open_journal(owner, header={"task": task})
        assert records[1:] == [user("before the cut")]  # the cut step recorded nothing
        again.append([user("after the cut")])
        assert store.replay(task)[1:] == [user("before the cut"), user("after the cut")]
    finally:
        store.close()


def test_a_worker_that_loses_the_database_waits_and_then_finishes_the_task(
    postgres_schema: str, proxy: SeverableProxy, tmp_path: Path
) -> None:
    """Invariant 8 on the loop: the cut is a storage fault (exit 7, "stopped"), never
    a failure of the task, and a worker started once the database is back finishes it."""
    store = make(proxy.url_for(postgres_schema), "node-a")
    try:
        store.create(TaskSpec(id="t1", prompt="Write a file."), {"state": "queued"})
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        loop = make_loop(store, workspace)
        loop.open()
        writer = loop.recorder.writer
        real_append = writer.append

        def cut_after_the_first_turn(records: Iterable[JSON], *, sync: bool = True) -> None:
            records = list(records)
            real_append(records, sync=sync)
            if any(r["k"] == "turn" for r in records):
                proxy.sever()

        writer.append = cut_after_the_first_turn  # type: ignore[method-assign]
        cut = loop.run()
        assert (cut.state, cut.exit_code) == ("stopped", ExitCode.STORAGE)
        assert "cannot be reached" in cut.reason
        proxy.restore()
        poll_for(lambda: _reachable(store), what="the store to reconnect")
        loop.close()
        assert store.get_record("t1")[0] == {"state": "queued"}  # nothing counted

        resumed = make_loop(store, workspace)
        assert resumed.run() == Outcome("done", "end_turn", ExitCode.DONE)
        resumed.close()
        assert (workspace / "a.txt").read_text() == "hi!"
        kinds = [r["k"] for r in store.replay("t1")]
        assert kinds.count("turn") == 3 and kinds[-1] == "end"  # no turn recorded twice
    finally:
        store.close()


def _reachable(store: PostgresStore) -> bool:
    try:
        store.task_ids()
    except StorageError:
        return False
    return True


def test_the_password_is_in_no_message_no_repr_and_no_log(
    postgres_schema: str, proxy: SeverableProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # psycopg's own logger included
    url, secret = with_secret(proxy.url_for(postgres_schema))
    store = make(url, "node-a")
    try:
        assert secret not in repr(store) and secret not in str(store)
        new_task(store)
        proxy.sever()
        with pytest.raises(StorageError) as cut:
            store.get_record("t1")
        shown = "".join(traceback.format_exception(cut.value))
        assert "cannot be reached" in shown and secret not in shown
    finally:
        store.close()
    proxy.close()  # nothing listens there now: the first connection is refused
    with pytest.raises(StorageError) as refused:
        PostgresStore(url, node="node-b")
    shown = "".join(traceback.format_exception(refused.value))
    assert refused.value.fault and secret not in shown
    malformed = url.replace("@", "@[", 1)  # a URL the driver refuses, quoting all of it
    with pytest.raises(ConfigError) as bad:
        PostgresStore(malformed, node="node-c")
    shown = "".join(traceback.format_exception(bad.value))
    assert "store URL" in shown and secret not in shown
    assert secret not in caplog.text


def test_journal_records_are_committed_with_synchronous_commit_on(postgres_schema: str) -> None:
    relaxed = with_query(
        postgres_schema,
        options=_options(postgres_schema) + " -csynchronous_commit=off",
    )
    store = make(relaxed, "node-a")
    try:
        with store.db.step() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    finally:
        store.close()


def _options(url: str) -> str:
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(url).query).get("options", [""])[0]


def test_no_module_but_the_postgres_store_imports_psycopg() -> None:
    """psycopg is the ``postgres`` extra: the file store, the loop, the daemon and the
    CLI run without it, and so do the schema and lease modules (types only)."""
    code = (
        "import sys, supervisor.cli, supervisor.daemon, worker.loop, worker.store.files, "
        "worker.store.pgschema, worker.store.pglease\n"
        "assert 'psycopg' not in sys.modules, 'psycopg imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_an_event_carrying_a_nul_is_kept_with_a_replacement_character(
    postgres_schema: str,
) -> None:
    """jsonb holds no NUL, and a tool's output may carry one into an event."""
    store = make(postgres_schema, "node-a")
    try:
        task = new_task(store)
        store.append_event(task, {"event": "tool_failed", "error": "bad\0byte \\u0000 kept"})
        (event,), _ = store.read_events(task)
        assert event["error"] == "bad\ufffdbyte \\u0000 kept"
    finally:
        store.close()


@pytest.mark.parametrize(
    "written",
    [
        "p%zzss-" + SECRET,  # bad percent-encoding: the driver quotes the token
        "s3 cr3t-" + SECRET,  # a space: the same
        "pa/ss-" + SECRET,  # a bare slash: read as host, port and database instead
    ],
)
def test_a_password_libpq_cannot_read_is_refused_without_a_trace_of_it(written: str) -> None:
    url = f"postgresql://agentd:{written}@127.0.0.1:1/agentd"
    with pytest.raises(ConfigError) as bad:
        PostgresStore(url, node="node-a")
    shown = "".join(traceback.format_exception(bad.value))
    assert "store URL cannot be parsed" in shown
    for piece in (SECRET, "zzss", "cr3t", "ss-"):
        assert piece not in shown


def test_status_reads_of_every_task_cost_one_round_trip(
    postgres_schema: str, proxy: SeverableProxy
) -> None:
    """``read_all``: one statement, and then the reads status makes of each task (spec,
    record, heartbeat, snapshot, the journal after it) go to no database at all."""
    store = make(proxy.url_for(postgres_schema), "node-a")
    try:
        tasks = [new_task(store, f"t{n}") for n in range(20)]
        for task in tasks[::2]:
            writer, _ = store.open_journal(store.acquire(task), header={"task": task})
            writer.append([user("go")])
            writer.close()
        before = proxy.exchanges
        with store.read_all():
            assert proxy.exchanges - before == 1
            for task in store.task_ids():
                store.load_spec(task)
                store.get_record(task)
                store.read_heartbeat(task)
                store.get_snapshot(task)
                store.replay(task)
        assert proxy.exchanges - before == 1
    finally:
        store.close()
