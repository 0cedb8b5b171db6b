"""The console's server: connections taken within bounds, requests answered, streams fed.

It runs in the console's own process (``python -m supervisor.console``), on its own
asyncio loop, with the API's work on a few threads (``WORKERS``): nothing it does, and
nothing a client does to it, takes a moment of the daemon's loop (docs/design.md section 12).
The listening socket is the daemon's, bound before the process starts and handed to it.

Bounds: at most ``MAX_CONNECTIONS`` connections at once (one more is closed as it comes);
each must send its request within the limits of ``supervisor.console.http`` (size and
time: a slow or silent client is cut off) and take its answer within ``WRITE_TIMEOUT``;
a TLS handshake has ``HEAD_TIMEOUT`` seconds. A stream (``GET /api/stream``) is a
connection too: it gets a comment after ``KEEPALIVE`` quiet seconds, ends within two
``ALIVE_CHECK`` intervals of its session's end or its token's revocation (checked whether
rows come or not), and ends when it falls ``STREAM_BACKLOG`` rows behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from http import HTTPStatus

from supervisor.console.app import SECURITY_HEADERS, Console, Stream, refused
from supervisor.console.http import (
    HEAD_LIMIT,
    HEAD_TIMEOUT,
    HttpError,
    Request,
    Response,
    head_bytes,
    read_request,
    write,
)
from worker.config import ConsoleConfig
from worker.errors import ConfigError
from worker.store.durable import dump_json

#: Connections open at once; past it a new one is closed at once.
MAX_CONNECTIONS = 128
#: Threads the API's functions run on (reads and actions alike).
WORKERS = 4
#: Seconds between two comments on an idle stream (proxies keep it open; a gone client
#: is found).
KEEPALIVE = 15.0
#: Seconds between two checks that a stream's session or token still holds: a stream of a
#: revoked token or an ended session ends within two of them (docs/design.md section 12).
ALIVE_CHECK = 1.0


class ConsoleServer:
    """Serve ``console`` on ``sock`` (a listening socket), over TLS with ``context``."""

    def __init__(
        self, console: Console, sock: socket.socket, context: ssl.SSLContext | None
    ) -> None:
        self.console = console
        self.sock = sock
        self.context = context
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._connection,
            sock=self.sock,
            ssl=self.context,
            ssl_handshake_timeout=HEAD_TIMEOUT if self.context else None,
            limit=HEAD_LIMIT,
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await self.console.feed.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else "local"
        try:
            await self._serve(reader, writer, client)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went, or took too long: its own business
        finally:
            self.connections -= 1
            if task is not None:
                self._tasks.discard(task)
            writer.transport.abort()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: str
    ) -> None:
        first = True
        while True:
            try:
                request = await read_request(reader, client, first=first)
            except HttpError as exc:  # refused before it was whole: said, then closed
                await self._write(writer, refused(exc.status, {"error": exc.message}), None)
                return
            if request is None:
                return
            first = False
            try:
                answer = await self.console.respond(request)
            except Exception as exc:  # a bug: answered 500 and said in the daemon's log
                self.console.announce.error(request.path, exc)
                answer = refused(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error: "
                                 "the daemon's log says more"})  # fmt: skip
            if isinstance(answer, Stream):
                await self._stream(writer, answer)
                return
            await self._write(writer, answer, request)
            if not request.keep_alive or answer.status >= 400:
                return

    async def _write(
        self, writer: asyncio.StreamWriter, response: Response, request: Request | None
    ) -> None:
        keep = request is not None and request.keep_alive and response.status < 400
        headers = [("Content-Type", response.content_type), *SECURITY_HEADERS, *response.headers]
        head = head_bytes(response.status, headers, length=len(response.body), keep_alive=keep)
        body = b"" if request is not None and request.method == "HEAD" else response.body
        await write(writer, head + body)

    async def _stream(self, writer: asyncio.StreamWriter, stream: Stream) -> None:
        """Server-sent events: a ``task`` event (the row as JSON) per change."""
        self.console.streams += 1
        queue = None
        try:
            headers = [
                ("Content-Type", "text/event-stream; charset=utf-8"),
                *SECURITY_HEADERS,
                ("X-Accel-Buffering", "no"),  # (a proxy passes each event on at once)
            ]
            await write(writer, head_bytes(HTTPStatus.OK, headers, length=None, keep_alive=False))
            await write(writer, b"retry: 3000\n\n")
            queue = await self.console.feed.subscribe()
            loop = asyncio.get_running_loop()
            checked = written = loop.time()
            while True:
                try:  # (woken at least every ALIVE_CHECK: a quiet stream is checked too)
                    row = await asyncio.wait_for(queue.get(), ALIVE_CHECK)
                except TimeoutError:
                    row = None
                now = loop.time()
                if now - checked >= ALIVE_CHECK:  # (not each row: a token is a read)
                    checked = now
                    held = (
                        await self.console.off_loop(stream.alive)
                        if stream.reads
                        else stream.alive()
                    )
                    if not held:
                        return
                if row is None:
                    if self.console.feed.dropped(queue):
                        return
                    if now - written >= KEEPALIVE:
                        await write(writer, b": keep-alive\n\n")
                        written = now
                    continue
                await write(writer, b"event: task\ndata: " + dump_json(row) + b"\n\n")
                written = loop.time()
        finally:
            self.console.streams -= 1
            if queue is not None:
                self.console.feed.unsubscribe(queue)


def tls_context(console: ConsoleConfig) -> ssl.SSLContext:
    """A server context for ``[console] tls_cert`` (a PEM chain) and ``tls_key``: TLS 1.2
    at least, the standard library's default ciphers; ``ConfigError`` in one line when
    they cannot be loaded (missing, unreadable, not PEM, not a pair)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(console.tls_cert), str(console.tls_key))
    except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        raise ConfigError(
            f"console.tls_cert {console.tls_cert} and console.tls_key {console.tls_key} "
            f"cannot be served ({exc}); give a PEM certificate chain and its key, readable "
            "by the daemon's user"
        ) from None
    return context
