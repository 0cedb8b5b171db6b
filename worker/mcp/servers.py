"""A worker's MCP servers: started on demand, supervised, called synchronously.

The servers of one worker live on one thread of their own, which runs an event loop for
the ``mcp`` SDK (``worker.mcp.session``) from the first use until ``close``. Starting the
servers from that thread is not only a convenience: ``--die-with-parent`` (bwrap's
``PR_SET_PDEATHSIG``) fires when the *thread* that started the process ends, so they are
started from a thread that lives as long as the worker uses them, and ``close`` stops
each of them before that thread ends. The SDK is imported on that thread's first use, so a
worker that calls no server never pays for it.

The loop calls ``listing`` and ``call`` from its own thread; everything they report (an
event for the operator, a result, an error) comes back to that thread, which records it.

Supervision, per server (docs/design.md section 11):

* started at the first ``listing`` or ``call`` that needs it (a resumed task starts a
  server at the first call of one of its tools);
* a server found dead at a call (it died between calls) is started again at once; a start
  that fails, or a death in a call, counts a failure, and each failure in a row makes the
  next start wait longer (``[restart]`` backoff: ``backoff_initial`` doubling up to
  ``backoff_max``). Meanwhile its calls get error results (``ServerFailed``, which
  names the tool called, then the failure waited on; reported once per failure as
  ``mcp_server_failed``); a call that succeeds clears the count;
* a call past its ``timeout`` is cancelled (``notifications/cancelled``), its server
  killed, and its outcome is unknown (``OutcomeUnknown``), as is a call in flight when its
  server dies: the loop settles it by the dangling-call rules;
* after every start the server's tools are listed again, and so after it says its list
  changed; a difference from the list the task recorded is ``mcp_tools_changed`` (once per
  distinct difference), and a call of a tool it no longer lists gets an error result.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from worker.credentials import credential
from worker.errors import ConfigError
from worker.events import Event
from worker.mcp.settings import CRED_REF, McpServer
from worker.tools.installation import hidden_why
from worker.tools.sandbox import Sandbox, SandboxRefused
from worker.tools.tool import OutcomeUnknown, ToolError

if TYPE_CHECKING:
    import asyncio

    import anyio.abc
    import mcp_types

    from worker.mcp.session import Connection, Endpoint

T = TypeVar("T")

#: What ``on_event(event, level, fields)`` is: the loop's event log.
OnEvent = Callable[[Event, str, dict[str, Any]], None]
#: Seconds a server has, once a call it ran past its timeout was cancelled
#: (``notifications/cancelled``), to read that before it is killed.
CANCEL_GRACE = 1.0
#: Seconds a ``tools/list`` may take when its server has no ``timeout`` (a test's own).
START_LIMIT = 60.0
#: Seconds past a call's own timeout before the worker stops waiting for the event loop
#: itself (a wedged SDK): the server is killed, and the outcome is unknown.
WEDGE_MARGIN = 5.0
#: Seconds a kill of a server waits for the servers' thread to carry it out.
KILL_WAIT = 5.0


class ServerFailed(ToolError):
    """A server could not be started, or waits to be started again: the call did not
    reach it (an error result saying so, which names the ``tool`` called, if any: the
    failure it waits on may have been another tool's call)."""

    def __init__(self, server: str, why: str, tool: str | None = None) -> None:
        called = f"{tool}: not called: " if tool else ""
        super().__init__(f"mcp: {server}: {called}{why}")
        self.server = server
        self.why = why
        self.tool = tool


@dataclass(frozen=True)
class Placement:
    """Where a worker's stdio servers run: the task's workspace (cwd and only root), the
    scrubbed tool environment, the task's sandbox, and ``restart.stop_grace``."""

    workspace: Path
    env: Mapping[str, str]
    sandbox: Sandbox
    grace: float = 10.0
    echo: bool = True  # servers' stderr to this process's (the worker's bounded log)


@dataclass(frozen=True)
class Backoff:
    """``[restart]``'s backoff: the wait before the n-th start in a row after failures."""

    initial: float = 1.0
    maximum: float = 60.0

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.maximum, self.initial * 2.0 ** min(failures - 1, 32))


@dataclass
class _Server:
    name: str
    settings: McpServer
    connection: Connection | None = None
    failures: int = 0
    next_start: float = 0.0  # monotonic: no start before this
    last_failure: str = ""
    reported: bool = False  # the current failure was reported as mcp_server_failed
    listed: list[dict[str, Any]] | None = None  # its last listing
    expected: set[str] | None = None  # the tools the task recorded of it
    changes_reported: set[tuple[frozenset[str], frozenset[str]]] = field(default_factory=set)


class ToolServers:
    """The MCP servers one worker may use (``[mcp.servers]``), on a thread of their own."""

    def __init__(
        self,
        servers: Mapping[str, McpServer],
        placement: Placement,
        *,
        backoff: Backoff = Backoff(),
        on_event: OnEvent | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._servers = {name: _Server(name, s) for name, s in servers.items()}
        self.placement = placement
        self.backoff = backoff
        self._event = on_event  # (called from the loop's thread only)
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._stopped: Any = None  # an anyio.Event, once the loop runs
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self._servers)

    @property
    def started(self) -> bool:
        """Whether any server was ever started (the thread, and the SDK's import, with it)."""
        return self._thread is not None

    def settings(self, name: str) -> McpServer:
        return self._servers[name].settings

    def expect(self, name: str, tools: set[str]) -> None:
        """The tools the task recorded of server ``name``: what a later listing is
        compared with (``mcp_tools_changed``)."""
        self._servers[name].expected = tools

    def running(self) -> list[str]:
        """The servers whose process (or session) is up."""
        return [s.name for s in self._servers.values() if s.connection and s.connection.alive]

    def pids(self) -> dict[str, int]:
        return {
            s.name: s.connection.pid
            for s in self._servers.values()
            if s.connection is not None and s.connection.pid is not None and s.connection.alive
        }

    # -- what the loop asks ------------------------------------------------------------

    def listing(self, name: str) -> list[dict[str, Any]]:
        """The tools server ``name`` lists (each as its JSON), starting it if it is not
        running; ``ServerFailed`` when it cannot be started or does not list them."""
        server = self._servers[name]
        connection = self._ready(server)
        try:
            listed = self._list(server, connection)
        except Exception as exc:
            self._kill(connection)
            server.connection = None
            raise self._failed(server, f"cannot list its tools: {_why(exc)}") from None
        server.listed = listed
        return listed

    def _list(self, server: _Server, connection: Connection) -> list[dict[str, Any]]:
        """``tools/list``, within the server's ``timeout`` (a server that never answers
        must not hold a worker whose phase has no deadline: a first start's)."""
        limit = server.settings.timeout or START_LIMIT
        try:
            return self._run(connection.list_tools(), limit)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer to tools/list within {limit:g} s") from None

    def call(
        self,
        name: str,
        tool: str,
        arguments: dict[str, Any],
        key: str,
        timeout: float,
        budget: float | None = None,
    ) -> mcp_types.CallToolResult:
        """Server ``name``'s tool ``tool``, with the idempotency key ``key``, within
        ``timeout`` seconds. ``ServerFailed`` (the call was not made), ``ToolError`` (the
        tool is gone, or the server refused the request), ``OutcomeUnknown`` (it may have
        taken effect: a timeout, or the server's death during it). ``budget``: the seconds
        the whole call may take (``deadlines.tool_call``, past which the daemon stops the
        worker), a server's start included: the call's own timeout is cut to what is left."""
        started = time.monotonic()
        server = self._servers[name]
        try:
            connection = self._ready(server)
        except ServerFailed as exc:  # (its why may be another tool's call: this one is named)
            raise ServerFailed(name, exc.why, tool) from None
        if budget is not None:
            timeout = max(0.1, min(timeout, budget - (time.monotonic() - started) - CANCEL_GRACE))
        if connection.tools_changed:
            self._relist(server, connection)
        if server.listed is not None and tool not in {t.get("name") for t in server.listed}:
            raise ToolError(
                f"mcp: {name}: the server no longer offers the tool {tool!r} (it lists "
                "other tools now than when the task started); the call was not made"
            )
        from worker.mcp.session import CallTimedOut, ConnectionLost  # noqa: PLC0415  (the SDK: a worker that calls a server only)

        try:
            result = self._run(
                connection.call(tool, arguments, key, timeout), timeout + WEDGE_MARGIN
            )
        except (CallTimedOut, concurrent.futures.TimeoutError) as exc:
            time.sleep(CANCEL_GRACE)  # (the cancel is sent: a moment to read it)
            self._kill(connection)
            self._count_failure(server, f"a call of {tool} ran past its timeout")
            why = str(exc) or f"no answer within {timeout:g} s"
            raise OutcomeUnknown(
                f"mcp: {name}: {tool}: {why}; the call was cancelled and the server stopped"
            ) from None
        except ConnectionLost as exc:
            self._count_failure(server, str(exc))
            raise OutcomeUnknown(f"mcp: {name}: {tool}: {exc} during the call") from None
        except Exception as exc:  # a JSON-RPC error answer: the tool did not run
            raise ToolError(
                f"mcp: {name}: {tool}: the server refused the call: {_why(exc)}"
            ) from None
        server.failures = 0
        server.reported = False
        return result

    def _kill(self, connection: Connection) -> None:
        """Kill a server now, on the servers' thread (its events are that loop's), and
        return once it is done: the next call finds the connection dead, and is refused
        or starts the server again, never sent to the server being killed."""
        if self._loop is not None:
            with contextlib.suppress(Exception):  # (a wedged loop: the close deals with it)
                self._run(_kill(connection), KILL_WAIT)

    def close(self) -> None:
        """Stop every server (stdin, TERM, KILL, each ``grace`` apart, all at once), then
        the thread. The worker calls it before it exits; nothing is left running."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._run(self._close_all(), 2 * self.placement.grace + 10)
        loop.call_soon_threadsafe(self._stopped.set)
        thread.join(timeout=10)
        self._loop = self._thread = None

    # -- supervision -------------------------------------------------------------------

    def _ready(self, server: _Server) -> Connection:
        """The server's live connection, started now if it is not running."""
        connection = server.connection
        if connection is not None and connection.alive:
            return connection
        if connection is not None and server.failures == 0:
            # it died between calls: a failure, and started again at once
            self._count_failure(server, connection_end(connection))
            server.next_start = 0.0
        now = self.clock()
        if now < server.next_start:
            raise self._failed(
                server,
                f"{server.last_failure}; starting it again in "
                f"{server.next_start - now:.1f} s (failure {server.failures} in a row)",
            )
        try:
            endpoint = self._endpoint(server)
            connection = self._start(endpoint)
        except (ConfigError, SandboxRefused, OSError) as exc:
            raise self._start_failed(server, self._with_sandbox(server, str(exc))) from None
        except Exception as exc:
            raise self._start_failed(server, self._with_sandbox(server, _why(exc))) from None
        server.connection = connection
        if server.listed is not None or server.expected is not None:
            self._relist(server, connection)  # a restarted server: does it list the same?
        return connection

    def _start(self, endpoint: Endpoint) -> Connection:
        from worker.mcp.session import Connection  # noqa: PLC0415  (the SDK: see the module docstring)

        connection = Connection(endpoint)
        self._run(self._open(connection), None)
        return connection

    def _with_sandbox(self, server: _Server, why: str) -> str:
        """``why`` a server did not start, and why what it needs may not be there
        (``installation.hidden_why``): under /tmp, not found, or shown in part."""
        command = server.settings.command
        path = {**self.placement.env, **server.settings.env}.get("PATH")
        sandboxed = self.placement.sandbox.verdict() == "bwrap"
        hidden = hidden_why(command, path, sandboxed=sandboxed)
        return f"{why}; {hidden}" if hidden else why

    def _start_failed(self, server: _Server, why: str) -> ServerFailed:
        self._count_failure(server, f"cannot start: {why}")
        server.next_start = self.clock() + self.backoff.delay(server.failures)
        return self._failed(server, server.last_failure)

    def _count_failure(self, server: _Server, why: str) -> None:
        server.failures += 1
        server.last_failure = why
        server.reported = False
        server.next_start = self.clock() + self.backoff.delay(server.failures - 1)

    def _failed(self, server: _Server, why: str) -> ServerFailed:
        if not server.reported and self._event is not None:
            self._event(
                Event.MCP_SERVER_FAILED,
                "warning",
                {"server": server.name, "error": why, "failures": server.failures},
            )
            server.reported = True
        return ServerFailed(server.name, why)

    def _relist(self, server: _Server, connection: Connection) -> None:
        try:
            listed = self._list(server, connection)
        except Exception:
            return  # the next call finds out what became of it
        server.listed = listed
        if server.expected is None:
            return
        now = {str(t.get("name")) for t in listed}
        added, removed = frozenset(now - server.expected), frozenset(server.expected - now)
        if (added or removed) and (added, removed) not in server.changes_reported:
            server.changes_reported.add((added, removed))
            if self._event is not None:
                self._event(
                    Event.MCP_TOOLS_CHANGED,
                    "info",
                    {"server": server.name, "added": sorted(added), "removed": sorted(removed)},
                )

    def _endpoint(self, server: _Server) -> Endpoint:
        from worker.mcp.session import Endpoint  # noqa: PLC0415  (the SDK)

        settings = server.settings
        place = self.placement
        if settings.url:
            headers = {k: resolve(v) for k, v in settings.headers.items()}
            return Endpoint(
                name=server.name, url=settings.url, headers=headers, root=place.workspace
            )
        env = {**place.env, **{k: resolve(v) for k, v in settings.env.items()}}
        sandbox = replace(place.sandbox, network=settings.network)
        argv = sandbox.wrap(settings.command, place.workspace, env)
        return Endpoint(
            name=server.name,
            argv=argv,
            env=env,
            cwd=place.workspace,
            root=place.workspace,
            grace=place.grace,
            echo=place.echo,
        )

    # -- the thread ----------------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coroutine`` on the servers' thread and wait for it (``timeout`` seconds at
        most: ``concurrent.futures.TimeoutError``)."""
        loop = self._ensure_thread()
        import asyncio  # noqa: PLC0415  (a worker with servers only)

        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _ensure_thread(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None:
                return self._loop
            import asyncio  # noqa: PLC0415

            loop = asyncio.new_event_loop()
            started = threading.Event()
            self._thread = threading.Thread(
                target=self._thread_main, args=(loop, started), name="mcp", daemon=True
            )
            self._thread.start()
            started.wait()
            self._loop = loop
            return loop

    def _thread_main(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        import asyncio  # noqa: PLC0415

        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(started))
        finally:
            loop.close()

    async def _main(self, started: threading.Event) -> None:
        import anyio  # noqa: PLC0415  (the SDK's runtime)

        self._stopped = anyio.Event()
        async with anyio.create_task_group() as group:
            self._group = group
            started.set()
            await self._stopped.wait()
            group.cancel_scope.cancel()

    async def _open(self, connection: Connection) -> None:
        if self._group is None:
            raise RuntimeError("the servers' event loop is not running")
        await connection.open(self._group)

    async def _close_all(self) -> None:
        import anyio  # noqa: PLC0415

        async with anyio.create_task_group() as group:
            for server in self._servers.values():
                if server.connection is not None:
                    group.start_soon(server.connection.close)


async def _kill(connection: Connection) -> None:
    connection.kill()


def connection_end(connection: Connection) -> str:
    """Why a connection that was up is not any more."""
    from worker.mcp.session import wait_status  # noqa: PLC0415

    if connection.exited is not None:
        return f"the server ended between calls ({wait_status(connection.exited)})"
    return "the connection to the server closed between calls"


def resolve(value: str) -> str:
    """A value of ``env`` or ``headers`` with each ``${cred:NAME}`` read
    (``worker.credentials.credential``, which also adds it to the secrets redacted)."""
    return CRED_REF.sub(lambda m: credential(m.group(1)), value)


def _why(exc: BaseException) -> str:
    from worker.mcp.session import describe  # noqa: PLC0415

    return describe(exc)
