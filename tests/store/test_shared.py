"""The cluster's part of the PostgreSQL store (``SharedStore``) where it is PostgreSQL's
own: a node name held by a live daemon on another host, or by this host's crashed one
(the rows say which), and the console's tokens through the console's own functions.
What every ``SharedStore`` promises is the cluster conformance suite's
(``test_shared_conformance.py``), run on this store and the in-memory one."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.console.tokens import SpoolTokens, TokenStore, bearer, listed, mint, revoke
from worker.errors import (
    ConfigError,
    NotFoundError,
    RecordConflictError,
)
from worker.spool import Spool
from worker.store.postgres import PostgresStore


def gone_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def two(postgres_schema: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    a = PostgresStore(postgres_schema, node="a", lease=30.0, migrate=True)
    b = PostgresStore(postgres_schema, node="b", lease=30.0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_live_name_on_another_host_is_refused_and_a_crashed_one_is_taken(
    two: tuple[PostgresStore, PostgresStore], postgres_schema: str
) -> None:
    """A node's row names the daemon's host and pid: another host's live one refuses the
    name, this host's whose process is gone (the node's crashed life, restarted at once
    by its service manager, before a lease is over) does not."""
    a, _ = two
    a.join(4)
    impostor = PostgresStore(postgres_schema, node="a")
    try:
        with impostor.db.step() as conn:  # a live node of this name on another machine
            conn.execute("UPDATE nodes SET host = 'elsewhere' WHERE name = 'a'")
        with pytest.raises(ConfigError, match="in use by a live node"):
            impostor.join(1)
        with impostor.db.step() as conn:  # this node's last life on this host, crashed
            conn.execute(
                "UPDATE nodes SET host = %s, pid = %s WHERE name = 'a'",
                (socket.gethostname(), gone_pid()),
            )
        assert impostor.join(1) == 2  # restarted at once: not refused
    finally:
        impostor.close()


def test_console_tokens_are_shared_by_every_node_and_kept_as_digests(
    two: tuple[PostgresStore, PostgresStore], tmp_path: Path
) -> None:
    """An API token minted through one node's store is found through another's (its
    digest, never the token, in the table); revoked through either, it is gone for both.
    The spool's file keeps the same promises (``SpoolTokens``)."""
    a, b = two
    spool = SpoolTokens(Spool(tmp_path))
    pairs: list[tuple[TokenStore, TokenStore]] = [(a, b), (spool, spool)]
    for minting, reading in pairs:
        token, secret = mint(minting, "erin")
        found = bearer(reading, secret)
        assert found == token and found is not None and found.by == "erin"
        assert secret not in str(reading.tokens())
        with pytest.raises(RecordConflictError):
            minting.add_token(token.to_json())
        assert bearer(reading, secret + "x") is None and bearer(reading, "nope") is None
        assert [t.id for t in listed(reading)] == [token.id]
        revoke(reading, token.id)
        assert bearer(minting, secret) is None
        with pytest.raises(NotFoundError):
            revoke(minting, token.id)
