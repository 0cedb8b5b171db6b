"""The throwaway PostgreSQL server (supervisor/pgcluster.py), started for real."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from supervisor.pgcluster import HOW_TO_GET, ThrowawayCluster, find_binaries
from tests.postgres import server_binaries
from worker.errors import ClusterError


def test_missing_binaries_say_in_one_line_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(ClusterError) as caught:
        find_binaries(path=str(tmp_path), fallbacks=[tmp_path])
    assert str(caught.value) == HOW_TO_GET
    assert "apt-get install postgresql" in HOW_TO_GET
    assert "\n" not in HOW_TO_GET


def test_a_folder_with_only_some_of_the_binaries_is_not_taken(tmp_path: Path) -> None:
    (tmp_path / "pg_ctl").write_text("#!/bin/sh\n")
    (tmp_path / "pg_ctl").chmod(0o755)
    with pytest.raises(ClusterError):
        find_binaries(path=str(tmp_path), fallbacks=[])


def test_a_cluster_serves_on_loopback_survives_a_restart_and_leaves_nothing() -> None:
    server_binaries()
    with ThrowawayCluster.create() as cluster:
        assert stat.S_IMODE(cluster.root.stat().st_mode) == 0o700
        assert cluster.data.stat().st_uid != 0, "PostgreSQL must not run as root"
        with psycopg.connect(cluster.url) as conn:
            where = conn.execute("SELECT host(inet_server_addr()), inet_server_port()")
            assert where.fetchone() == ("127.0.0.1", cluster.port)
            conn.execute("CREATE TABLE kept (v int)")
            conn.execute("INSERT INTO kept VALUES (7)")
        url = cluster.url
        cluster.stop(immediate=True)  # as a power loss: recovery on the next start
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=2)
        cluster.start()
        assert cluster.url == url
        with psycopg.connect(cluster.url) as conn:
            assert conn.execute("SELECT v FROM kept").fetchone() == (7,)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(cluster.url.replace(cluster.password, "wrong"))
    assert not cluster.root.exists()


def test_up_and_down_from_the_command_line() -> None:
    """What .ci/run does: a server that outlives the command that started it."""
    server_binaries()
    run = [sys.executable, "-m", "supervisor.pgcluster"]
    up = subprocess.run([*run, "up"], capture_output=True,
                        text=True, check=True, timeout=120)  # fmt: skip
    folder, url = up.stdout.split()
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        subprocess.run([*run, "down", folder], check=True, timeout=120)
    assert not Path(folder).exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_under_root_a_folder_the_server_user_cannot_reach_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    server_binaries()
    tmp_path.chmod(0o700)
    with pytest.raises(ClusterError, match="cannot enter") as caught:
        ThrowawayCluster.create(tmp_path)
    assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []
