"""One MCP server's connection: its process (a stdio server) or endpoint (Streamable HTTP)
and the ``mcp`` SDK's ``ClientSession`` over it. Imported only where a server is used.

The SDK speaks the protocol (requests, correlation, cancellation, validation); this module
owns what agentd must decide itself about a stdio server's process, which is why it does
not use the SDK's own stdio transport, whose shutdown timings are fixed and whose process
it does not hand out:

* the process is started with ``start_new_session`` (its own process group), its argv
  already wrapped in the task's sandbox by the caller (``worker.tools.sandbox``), cwd the
  workspace, and the environment it is given (scrubbed, plus the server's ``env``);
* each line of its stdout is one JSON-RPC message (at most ``LINE_LIMIT`` bytes): a line
  that is not one is garbage, counted and logged, and the session goes on;
* its stderr is copied, a line at a time with the server's name before it, to the
  worker's stderr: the worker's bounded log (``worker.output``);
* it is stopped as the MCP stdio transport says (stdin closed, then TERM, then KILL), each
  step ``grace`` seconds apart, or killed at once (``kill``: a call past its timeout).
  Its death is seen at once, through a pidfd, and ends the session: a call in flight then
  fails with ``ConnectionLost``, even where a process it left holds the pipe open.

Requests from the server are declined, except ``roots/list``, which answers the
workspace: the client's only root. Sampling and elicitation are not offered, and the
SDK declines them. ``notifications/tools/list_changed`` marks the connection
(``tools_changed``) for the next call to list the tools again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import anyio.abc
import httpx2
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.client.session import ClientRequestContext, ClientSession, IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

#: The longest line of a stdio server's stdout: one JSON-RPC message (an image or two).
LINE_LIMIT = 64 * 1024 * 1024
#: Seconds a server has to start and answer ``initialize``.
START_TIMEOUT = 30.0
#: Longest stderr line copied to the worker's log (the rest of the line is cut).
STDERR_LINE = 4096
#: What agentd calls itself in ``initialize``.
CLIENT_INFO = types.Implementation(name="agentd", version="0.1.0")
#: Where the idempotency key of a call travels, in the request's ``_meta``.
IDEMPOTENCY_META = "agentd/idempotency_key"


class ConnectionLost(Exception):
    """The server's process ended, or its connection closed, before it answered."""


class CallTimedOut(Exception):
    """A call ran past its timeout (``notifications/cancelled`` was sent)."""


@dataclass(frozen=True)
class Endpoint:
    """How to reach one server: ``argv`` (stdio, sandbox included) or ``url``."""

    name: str
    argv: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    url: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    root: Path | None = None  # the workspace, answered to roots/list
    grace: float = 10.0  # restart.stop_grace: between stdin closed, TERM and KILL
    echo: bool = True  # copy the server's stderr to this process's (False: keep the last line)


class Connection:
    """One started server. ``open`` starts it and initializes the session; the session
    lives in a task of its own (``_serve``) until ``close``, ``kill`` or the server's end."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.session: ClientSession | None = None
        self.pid: int | None = None
        self.error: BaseException | None = None
        self.garbage = 0  # stdout lines that were no JSON-RPC message
        self.tools_changed = False  # the server said its tools changed
        self.exited: int | None = None  # the process's wait status, once it ended
        self.last_words = ""  # the last line the server wrote on its stderr
        self._ready = anyio.Event()
        self._done = anyio.Event()  # ask _serve to end
        self._closed = anyio.Event()  # _serve ended

    @property
    def alive(self) -> bool:
        return self.session is not None and not self._done.is_set()

    async def open(self, group: anyio.abc.TaskGroup) -> None:
        """Start the server in ``group`` and wait until its session is initialized; raises
        why it could not be (the process did not start, died, or did not answer)."""
        group.start_soon(self._serve)
        with anyio.move_on_after(START_TIMEOUT + 1):
            await self._ready.wait()
        if self.session is None:
            self.kill()
            with anyio.move_on_after(self.endpoint.grace + 3):
                await self._closed.wait()
            if self.error is None and self.exited is None:
                raise ConnectionLost(f"no answer to initialize within {START_TIMEOUT:g} s")
            raise ConnectionLost(self._why_gone()) from None

    async def list_tools(self) -> list[dict[str, Any]]:
        """Every tool the server lists (all pages), each as its JSON."""
        session = self._session()
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            try:
                page = await session.list_tools(params=params)
            except MCPError as exc:
                raise await self._lost(exc) from None
            tools += [
                t.model_dump(by_alias=True, mode="json", exclude_none=True) for t in page.tools
            ]
            cursor = page.next_cursor
            if not cursor or len(tools) > 10_000:
                self.tools_changed = False
                return tools

    async def call(
        self, tool: str, arguments: dict[str, Any], key: str, timeout: float
    ) -> types.CallToolResult:
        """``tools/call`` with the idempotency key in ``_meta``; ``CallTimedOut`` past
        ``timeout`` (the SDK sends ``notifications/cancelled``), ``ConnectionLost`` when the
        server ends first, ``MCPError`` for a protocol error."""
        session = self._session()
        try:
            meta = cast(types.RequestParamsMeta, {IDEMPOTENCY_META: key})
            return await session.call_tool(tool, arguments, read_timeout_seconds=timeout, meta=meta)
        except MCPError as exc:
            if exc.error.code == types.REQUEST_TIMEOUT:
                raise CallTimedOut(f"no answer within {timeout:g} s") from None
            raise await self._lost(exc) from None

    def _session(self) -> ClientSession:
        if self.session is None or self._done.is_set():
            raise ConnectionLost(self._why_gone())
        return self.session

    async def _lost(self, exc: MCPError) -> Exception:
        """``exc`` as what it means: the connection's end (once the process's exit, which
        says more, is known: a moment later than its pipe's end), or the server's error."""
        if exc.error.code != types.CONNECTION_CLOSED and not self._done.is_set():
            return exc
        with anyio.move_on_after(1):
            await self._done.wait()
        return ConnectionLost(self._why_gone())

    def _why_gone(self) -> str:
        if self.exited is not None:
            why = f"the server's process ended ({wait_status(self.exited)})"
        elif self.error is not None:
            why = describe(self.error)
        else:
            why = "the connection to the server closed"
        return f"{why}; its last words: {self.last_words}" if self.last_words else why

    def kill(self) -> None:
        """End the server at once: SIGKILL to its process group, and the session ends."""
        if self.pid is not None and self.exited is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self._done.set()

    async def close(self) -> None:
        """Stop the server as the MCP stdio transport says (stdin closed, TERM, KILL, each
        ``grace`` apart) and wait until it is gone."""
        self._done.set()
        await self._closed.wait()

    # -- the session's task ---------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            async with (
                self._streams() as (read, write),
                ClientSession(
                    read,
                    write,
                    list_roots_callback=self._roots,
                    message_handler=self._on_message,
                    client_info=CLIENT_INFO,
                ) as session,
            ):
                with anyio.fail_after(START_TIMEOUT):
                    await session.initialize()
                self.session = session
                self._ready.set()
                await self._done.wait()
        except Exception as exc:
            self.error = exc
        finally:
            self._done.set()
            self._ready.set()
            self._closed.set()

    async def _roots(
        self, context: ClientRequestContext
    ) -> types.ListRootsResult | types.ErrorData:
        root = self.endpoint.root
        if root is None:
            return types.ErrorData(code=types.INVALID_REQUEST, message="no roots")
        return types.ListRootsResult(roots=[types.Root(uri=root.as_uri(), name="workspace")])  # type: ignore[arg-type]

    async def _on_message(self, message: IncomingMessage) -> None:
        if isinstance(message, Exception):
            self.garbage += 1
            say(self.endpoint.name, f"not a JSON-RPC message on stdout ({describe(message)[:200]})")
        elif isinstance(message, types.ToolListChangedNotification):
            self.tools_changed = True

    @contextlib.asynccontextmanager
    async def _streams(
        self,
    ) -> AsyncIterator[
        tuple[
            MemoryObjectReceiveStream[SessionMessage | Exception],
            MemoryObjectSendStream[SessionMessage],
        ]
    ]:
        if self.endpoint.url:
            async with self._http() as streams:
                yield streams
        else:
            async with self._stdio() as streams:
                yield streams

    @contextlib.asynccontextmanager
    async def _http(self) -> AsyncIterator[Any]:
        timeout = httpx2.Timeout(30.0, read=300.0)
        async with (
            httpx2.AsyncClient(headers=dict(self.endpoint.headers), timeout=timeout) as client,
            streamable_http_client(self.endpoint.url, http_client=client) as streams,
        ):
            yield streams

    @contextlib.asynccontextmanager
    async def _stdio(
        self,
    ) -> AsyncIterator[
        tuple[
            MemoryObjectReceiveStream[SessionMessage | Exception],
            MemoryObjectSendStream[SessionMessage],
        ]
    ]:
        endpoint = self.endpoint
        process = await anyio.open_process(
            list(endpoint.argv),
            cwd=endpoint.cwd,
            env=dict(endpoint.env),
            start_new_session=True,
        )
        self.pid = process.pid
        incoming, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write, outgoing = anyio.create_memory_object_stream[SessionMessage](0)
        async with anyio.create_task_group() as group:
            group.start_soon(self._read_stdout, process, incoming)
            group.start_soon(self._write_stdin, process, outgoing, incoming)
            group.start_soon(self._copy_stderr, process)
            group.start_soon(self._watch_exit, process)
            try:
                yield read, write
            finally:
                with anyio.CancelScope(shield=True):
                    await self._stop(process)
                group.cancel_scope.cancel()
                for stream in (read, write, incoming, outgoing):
                    stream.close()

    async def _read_stdout(
        self,
        process: anyio.abc.Process,
        incoming: MemoryObjectSendStream[SessionMessage | Exception],
    ) -> None:
        stdout = _pipe(process.stdout)
        buffer = bytearray()
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            async with incoming:
                async for chunk in stdout:
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[: end + 1]
                        if line.strip():
                            await incoming.send(parse_line(line))
                    if len(buffer) > LINE_LIMIT:
                        await incoming.send(ValueError(f"a line longer than {LINE_LIMIT} bytes"))
                        buffer.clear()

    async def _write_stdin(
        self,
        process: anyio.abc.Process,
        outgoing: MemoryObjectReceiveStream[SessionMessage],
        incoming: MemoryObjectSendStream[SessionMessage | Exception],
    ) -> None:
        stdin = _pipe(process.stdin)
        try:
            async with outgoing:
                async for message in outgoing:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stdin.send(data.encode() + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            incoming.close()  # the session sees the end instead of waiting for ever

    async def _copy_stderr(self, process: anyio.abc.Process) -> None:
        stderr = _pipe(process.stderr)
        buffer = bytearray()
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            async for chunk in stderr:
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0 or len(buffer) > STDERR_LINE:
                    cut = end if end >= 0 else STDERR_LINE
                    self._stderr_line(buffer[:cut][:STDERR_LINE].decode(errors="replace"))
                    del buffer[: cut + (1 if end >= 0 else 0)]
        if buffer:
            self._stderr_line(buffer[:STDERR_LINE].decode(errors="replace"))

    def _stderr_line(self, line: str) -> None:
        if line.strip():
            self.last_words = line.strip()[:300]
        if self.endpoint.echo:
            say(self.endpoint.name, line)

    async def _watch_exit(self, process: anyio.abc.Process) -> None:
        """Set ``exited`` and end the session the moment the process ends (a pidfd: not
        the pipes' end, which a process it left behind may hold off)."""
        fd = os.pidfd_open(process.pid)
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)
        with anyio.move_on_after(1):
            await process.wait()
        self.exited = _status_of(process.returncode)
        self._done.set()

    async def _stop(self, process: anyio.abc.Process) -> None:
        """stdin closed; after ``grace`` TERM to its group; after ``grace`` again KILL."""
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await _pipe(process.stdin).aclose()
        for sent in (signal.SIGTERM, signal.SIGKILL):
            with anyio.move_on_after(self.endpoint.grace):
                while process.returncode is None:
                    await anyio.sleep(0.01)
            if process.returncode is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sent)
        with anyio.move_on_after(2), contextlib.suppress(Exception):
            await process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()
        # asyncio's subprocess transport holds the pipes until it is closed itself (and
        # warns when it is collected open); anyio's Process has no public way to it
        transport = getattr(getattr(process, "_process", None), "_transport", None)
        close = getattr(transport, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()


P = TypeVar("P")


def _pipe(stream: P | None) -> P:
    """A pipe of a process started with all three (``open_process``'s default)."""
    if stream is None:
        raise RuntimeError("the server's process was started without its pipes")
    return stream


def parse_line(line: bytes) -> SessionMessage | Exception:
    """One line of a stdio server's stdout: a message, or why it is not one."""
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


def say(server: str, line: str) -> None:
    """A line of a server's output, or about it, in the worker's log."""
    with contextlib.suppress(OSError, ValueError):
        print(f"mcp {server}: {line.rstrip()}", file=sys.stderr, flush=True)


def describe(exc: BaseException) -> str:
    """An exception as one line (an exception group: its first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    if text and isinstance(exc, ConnectionLost | CallTimedOut):
        return text[0]  # (our own: a whole sentence)
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _status_of(returncode: int | None) -> int:
    """A returncode as a wait-status-like number: negative for a signal."""
    return returncode if returncode is not None else -1


def wait_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
