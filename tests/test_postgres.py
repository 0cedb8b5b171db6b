"""The PostgreSQL test support (tests/postgres.py): the server fixtures and the proxy
that cuts a connection, each against the real server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

from tests.postgres import ENV, SeverableProxy, with_address, with_query
from tests.support import poll_for


def test_the_server_fixture_gives_a_real_server(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT 1 + 1").fetchone() == (2,)


def test_a_schema_of_its_own_is_empty_and_is_what_unqualified_names_mean(
    postgres_url: str, postgres_schema: str
) -> None:
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        assert row is not None
        schema = row[0]
        assert schema.startswith("agentd_test_")
        conn.execute("CREATE TABLE mine (v int)")
    with psycopg.connect(postgres_url) as conn:
        found = conn.execute(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = 'mine'"
        ).fetchall()
    assert found == [(schema,)]


def test_urls_keep_their_credentials_and_query_when_rerouted() -> None:
    url = "postgresql://u:p%40ss@db.example:6543/app?sslmode=disable"
    moved = with_address(with_query(url, options="-csearch_path=s"), "127.0.0.1", 7)
    assert moved == (
        "postgresql://u:p%40ss@127.0.0.1:7/app?sslmode=disable&options=-csearch_path%3Ds"
    )


def test_a_severed_proxy_breaks_live_connections_refuses_new_ones_and_comes_back(
    postgres_url: str,
) -> None:
    with SeverableProxy.in_front_of(postgres_url) as proxy:
        url = proxy.url_for(postgres_url)
        port = proxy.port
        conn = psycopg.connect(url, autocommit=True)
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert proxy.connections == 2

        proxy.sever()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
        assert conn.closed
        with pytest.raises(psycopg.OperationalError, match="refused"):
            psycopg.connect(url, connect_timeout=2)

        proxy.restore()
        assert proxy.port == port
        with psycopg.connect(url, autocommit=True) as again:
            assert again.execute("SELECT 2").fetchone() == (2,)
        poll_for(lambda: proxy.connections == 0, what="the closed connection to leave")


def test_a_transaction_cut_mid_way_commits_nothing(postgres_url: str, postgres_schema: str) -> None:
    """What the store relies on: a connection lost before COMMIT leaves no trace."""
    with psycopg.connect(postgres_schema, autocommit=True) as setup:
        setup.execute("CREATE TABLE steps (seq int)")
    with SeverableProxy.in_front_of(postgres_url) as proxy:
        conn = psycopg.connect(proxy.url_for(postgres_schema))
        conn.execute("INSERT INTO steps VALUES (1)")
        proxy.sever()
        with pytest.raises(psycopg.OperationalError):
            conn.commit()
    with psycopg.connect(postgres_schema) as check:
        assert check.execute("SELECT count(*) FROM steps").fetchone() == (0,)


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_a_server_the_tests_skip_off_ci_and_fail_in_ci(tmp_path: Path, ci: str) -> None:
    """No server binaries and no URL: a developer's run skips with how to run them; a CI
    run fails (a skip would hide a broken CI image)."""
    (tmp_path / "test_needs_pg.py").write_text(
        textwrap.dedent(
            """
            def test_uses_it(postgres_url):
                pass
            """
        )
    )
    (tmp_path / "conftest.py").write_text(
        "import supervisor.pgcluster as pg\n"
        "pg._versioned_bins = lambda: []\n"
        "from tests.conftest import postgres_url  # noqa: F401\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "CI")}
    env["PATH"] = str(tmp_path)  # no initdb, no pg_ctl
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    if ci:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    if ci:
        assert done.returncode == 1, done.stdout
        assert "1 error" in done.stdout, done.stdout
        assert "apt-get install postgresql" in done.stdout
    else:
        assert done.returncode == 0, done.stdout
        assert "1 skipped" in done.stdout, done.stdout
        assert "apt-get install postgresql" in done.stdout
        assert ENV in done.stdout
