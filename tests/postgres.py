"""A real PostgreSQL for the tests, and a TCP proxy in front of it that a test can cut.

Where the server comes from (``server_url``), first that applies:

1. ``$AGENTD_TEST_POSTGRES``, a URL: what ``.ci/run`` exports for its throwaway server, or
   a developer's own database (the tests only ever create and drop schemas named
   ``agentd_test_*`` in it);
2. a throwaway server (``supervisor.pgcluster``) when the PostgreSQL binaries are here;
3. otherwise the PostgreSQL tests skip, saying how to run them, except in CI (``$CI``
   set), where they fail: CI has the server, so a skip there would hide a broken setup.

Each test gets its own schema (``schema_url``): the URL carries ``search_path``, so every
connection made from it, by the test or by a process it starts, sees only that schema.

``SeverableProxy`` stands for the network between a node and its database: ``sever``
drops every connection through it and refuses new ones, ``restore`` listens again on
the same port; ``sever_at_reply`` cuts a statement's reply on its way back (its COMMIT
made, or not: the outcome unknown to the client).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest

from supervisor.pgcluster import ThrowawayCluster, find_binaries
from worker.errors import ClusterError

ENV = "AGENTD_TEST_POSTGRES"

HOW_TO_RUN = (
    f"these tests need PostgreSQL: install the server (apt-get install postgresql) for a "
    f"throwaway one, or set {ENV}=postgresql://USER:PASSWORD@HOST:PORT/DB"
)


def server_url() -> Iterator[str]:
    """The body of the session fixture ``postgres_url`` (see the module docstring)."""
    given = os.environ.get(ENV)
    if given:
        yield given
        return
    try:
        find_binaries()
    except ClusterError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (CI must run the PostgreSQL tests: .ci/run sets {ENV})")
        pytest.skip(HOW_TO_RUN)
    with ThrowawayCluster.create() as cluster:
        yield cluster.url


def server_binaries() -> Path:
    """The PostgreSQL server's bin folder, for a test that starts a server of its own
    (``agentd demo --cluster``, ``supervisor.pgcluster``): it skips without one, saying
    how to get it, except in CI, where it fails (CI has the server)."""
    try:
        return find_binaries()
    except ClusterError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (CI must run the PostgreSQL tests)")
        pytest.skip(str(exc))


def with_query(url: str, **params: str) -> str:
    """``url`` with ``params`` added to (or replacing those of) its query string."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def with_address(url: str, host: str, port: int) -> str:
    """``url`` pointing at ``host:port`` instead (user, password, database kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def fresh_schema(url: str) -> Iterator[str]:
    """A new, empty schema, dropped afterwards; yields ``url`` with it as the search_path."""
    import psycopg

    name = f"agentd_test_{secrets.token_hex(6)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    try:
        yield with_query(url, options=f"-csearch_path={name}")
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")


class SeverableProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (host, port), on threads so that
    synchronous clients and child processes can use it alike.

    ``sever()`` cuts the link: every open connection is dropped (its client reads EOF, as
    when a router resets it) and new ones are refused, until ``restore()``. The port
    stays the same throughout, so URLs made from ``url_for`` keep working after.

    ``exchanges`` counts round trips: each time the server answers after the client
    sent something (how a test proves a step costs one).
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._asked = False
        self._cut_reply = False
        self.severed_at_reply = 0
        self.exchanges = 0
        self._listener: socket.socket | None = None
        self.port = 0
        self._listen()

    def url_for(self, url: str) -> str:
        """``url`` (a URL of the upstream server) routed through this proxy."""
        return with_address(url, "127.0.0.1", self.port)

    @classmethod
    def in_front_of(cls, url: str) -> SeverableProxy:
        parts = urlsplit(url)
        return cls((parts.hostname or "127.0.0.1", parts.port or 5432))

    @property
    def connections(self) -> int:
        """Sockets open through the proxy, both ends counted."""
        with self._lock:
            return len(self._open)

    def sever(self) -> None:
        """Drop every connection and refuse new ones (connection refused)."""
        with self._lock:
            listener, self._listener = self._listener, None
            doomed = list(self._open)
            self._open.clear()
        if listener is not None:
            _close(listener)
        for sock in doomed:
            _close(sock)

    def sever_at_reply(self) -> None:
        """Sever (as ``sever``) as soon as the server answers the next thing a client sent,
        before the answer reaches it: a statement that ran, and maybe committed, whose
        client learns nothing but a lost connection. Once; ``severed_at_reply`` counts."""
        with self._lock:
            self._cut_reply = True
            self._asked = False

    def restore(self) -> None:
        """Accept connections again, on the same port."""
        with self._lock:
            if self._listener is not None:
                return
        self._listen()

    def close(self) -> None:
        self.sever()

    def __enter__(self) -> SeverableProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the plumbing -----------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # severed or closed
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # severed while connecting
                    _close(client)
                    _close(server)
                    continue
                self._open |= {client, server}
            for source, sink, asking in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump, args=(source, sink, asking), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, asking: bool) -> None:
        """Copy one direction until either end goes; then close both."""
        try:
            while chunk := source.recv(65536):
                with self._lock:
                    cut = not asking and self._asked and self._cut_reply
                    if asking:
                        self._asked = True
                    elif self._asked:
                        self._asked = False
                        self.exchanges += 1
                    if cut:
                        self._cut_reply = False
                        self.severed_at_reply += 1
                if cut:
                    self.sever()
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        with self._lock:
            self._open -= {source, sink}
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    """Shut down (which wakes a thread blocked in recv or accept on it), then close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
