"""The PostgreSQL store's schema (worker/store/pgschema.py), on a real server."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import psycopg
import pytest

from worker.errors import SchemaVersionError
from worker.protocol import CLAIMABLE, TaskStatus
from worker.store import pglease
from worker.store.pgschema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    check,
    migrate,
    sql_states,
    stored_version,
)

TABLES = {"agentd_schema", "nodes", "tasks", "journal", "snapshots", "decisions", "events",
          "heartbeats", "exits", "console_tokens"}  # fmt: skip


def tables(conn: psycopg.Connection[tuple[object, ...]]) -> set[str]:
    rows = conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
    ).fetchall()
    return {str(name) for (name,) in rows}


def test_migrate_creates_every_table_at_the_version_and_a_second_run_changes_nothing(
    postgres_schema: str,
) -> None:
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        assert stored_version(conn) is None
        assert migrate(conn) == SCHEMA_VERSION == len(MIGRATIONS)
        assert tables(conn) == TABLES
        assert stored_version(conn) == SCHEMA_VERSION
        check(conn)
        assert migrate(conn) == SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM agentd_schema").fetchone() == (1,)


def test_nodes_starting_at_once_migrate_once(postgres_schema: str) -> None:
    results: list[int | BaseException] = []

    def start() -> None:
        try:
            with psycopg.connect(postgres_schema, autocommit=True) as conn:
                results.append(migrate(conn))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [SCHEMA_VERSION] * 4


def test_a_failed_migration_leaves_the_database_as_it_was(postgres_schema: str) -> None:
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        conn.execute("CREATE TABLE journal (not_ours int)")  # something else owns the name
        with pytest.raises(psycopg.errors.DuplicateTable):
            migrate(conn)
        assert tables(conn) == {"journal"}
        assert stored_version(conn) is None


def test_an_older_schema_is_upgraded_in_place(postgres_schema: str) -> None:
    upgrade = "ALTER TABLE tasks ADD COLUMN priority integer NOT NULL DEFAULT 0"
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        migrate(conn)
        conn.execute("INSERT INTO tasks (id, spec) VALUES ('t1', '{}')")
        with pytest.raises(SchemaVersionError, match="older than this release's"):
            check(conn, latest=SCHEMA_VERSION + 1)
        assert migrate(conn, (*MIGRATIONS, upgrade)) == SCHEMA_VERSION + 1
        assert conn.execute("SELECT id, priority FROM tasks").fetchall() == [("t1", 0)]
        check(conn, latest=SCHEMA_VERSION + 1)


def test_an_older_node_refuses_a_newer_schema_in_one_line(postgres_schema: str) -> None:
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        migrate(conn)
        conn.execute("UPDATE agentd_schema SET version = %s", (SCHEMA_VERSION + 1,))
        for refuse in (migrate, check):
            with pytest.raises(SchemaVersionError) as caught:
                refuse(conn)
            message = str(caught.value)
            assert "newer than this release's" in message
            assert "upgrade agentd" in message
            assert "\n" not in message
            assert caught.value.exit_code == 78
        assert stored_version(conn) == SCHEMA_VERSION + 1


def test_a_database_without_the_schema_is_refused_with_how_to_create_it(
    postgres_schema: str,
) -> None:
    with (
        psycopg.connect(postgres_schema, autocommit=True) as conn,
        pytest.raises(SchemaVersionError, match="agentd store init"),
    ):
        check(conn)


def test_the_schema_refuses_rows_no_store_may_write(postgres_schema: str) -> None:
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        migrate(conn)
        for bad_id in ("../x", "UPPER", "", "a" * 65):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("INSERT INTO tasks (id, spec) VALUES (%s, '{}')", (bad_id,))
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO tasks (id, spec, state) VALUES ('t', '{}', 'lost')")
        conn.execute("INSERT INTO tasks (id, spec) VALUES ('t', '{}')")
        decision = "INSERT INTO decisions (task, key, attempt, decision) VALUES ('t', 'k', 1, '{}')"
        conn.execute(decision)
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(decision)


def test_every_state_the_sql_names_is_a_task_status() -> None:
    """The states live in ``TaskStatus`` alone: every list of them in the schema and the
    statements is rendered from it (``sql_states``), none is written by hand, and every
    single state a statement of the PostgreSQL store names is one of them."""
    named: set[str] = set()
    for path in sorted((Path(__file__).parents[2] / "worker" / "store").glob("p*.py")):
        text = path.read_text()
        assert not re.search(r"IN\s*\('", text), f"{path.name}: a list of states by hand"
        named |= set(re.findall(r"state\s*(?:=|<>)\s*'([a-z_]+)'", text))
        named |= set(re.findall(r"'\{\{?state\}?\}', '\"([a-z_]+)\"'", text))
    assert {"running", "backoff"} <= named  # the pattern still reads the SQL
    assert named <= {s.value for s in TaskStatus}
    rendered = re.findall(r"state IN (\([^)]*\))", pglease.CLAIM + MIGRATIONS[0])
    assert rendered.count(sql_states(CLAIMABLE)) == 3  # the claim's two, the index's
    assert sql_states(CLAIMABLE) == "('queued', 'backoff', 'running')"
    assert set(rendered) == {sql_states(CLAIMABLE), sql_states(TaskStatus)}
    assert MIGRATIONS[0].count("'cancelled'") == 1  # the CHECK, rendered from TaskStatus
