"""What the daemon shows outside its log: ``/metrics`` (``[metrics] listen``,
``supervisor.metrics``), the console's process (``[console] listen``, docs/design.md
section 12), traces over OTLP (``[telemetry]``, section 14) and the status document on
``SPOOL/status.sock`` (``supervisor.status_socket``). A role of the daemon
(``supervisor.daemon.Supervisor``): each is started before the node joins or a worker
runs, so an address that cannot be bound stops the start in one line (but the status
socket: without it `status` reads the files, as with no daemon); a reload moves the
console; the stop closes all four.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from supervisor.metrics import MetricsServer, Sample, listen_error
from supervisor.reload import Settings
from supervisor.status_socket import StatusSocket
from supervisor.traces import TraceAssembler, TraceExporter, exporter_for
from worker import credentials
from worker.config import Config
from worker.errors import AgentdError
from worker.events import Event
from worker.spool import Spool

if TYPE_CHECKING:
    from supervisor.console.process import ConsoleProcess
    from supervisor.relay import EventRelay

#: The daemon's ``emit`` (an event of its own, in its log).
Emit = Callable[..., None]


class Surfaces:
    """The daemon's metrics server, console and trace exporter (module docstring)."""

    def __init__(
        self,
        spool: Spool,
        settings: Settings,
        emit: Emit,
        *,
        node: str | None,
        environ: Mapping[str, str],
    ) -> None:
        self.spool = spool
        self.settings = settings
        self.emit = emit
        self.node = node  # a cluster's node name (the console says it), or None
        self.environ = environ  # the console's environment: the workers' (no secret)
        self.metrics: MetricsServer | None = None
        self.console: ConsoleProcess | None = None
        self.console_error: str | None = None  # why ``[console] listen`` is not served
        self.traces: TraceExporter | None = None
        self.status: StatusSocket | None = None

    @property
    def config(self) -> Config:
        return self.settings.config

    @property
    def console_url(self) -> str | None:
        return self.console.url if self.console is not None else None

    def console_info(self) -> dict[str, str | None]:
        """What ``supervisor.json`` says of the console: its URL, the address the daemon's
        config gives it, and why it is not served there (what ``agentd console`` tells)."""
        return {
            "console": self.console_url,
            "console_listen": self.config.console.listen,
            "console_error": self.console_error,
        }

    def pids(self) -> set[int]:
        """The processes of its own (the console's): no stray to sweep."""
        return {self.console.pid} if self.console is not None and self.console.pid else set()

    def start(self, sample: Callable[[], Sample], relay: EventRelay) -> None:
        """Serve ``/metrics`` (``sample`` answers each scrape, on the loop), the console, and
        traces of what ``relay`` reads."""
        self._serve_metrics(sample)
        self._serve_console()
        self._export_traces(relay)
        self._serve_status()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.console is not None:
            self.console.stop()
        if self.traces is not None:
            self.traces.close()

    def _serve_metrics(self, sample: Callable[[], Sample]) -> None:
        """Serve ``/metrics`` when ``[metrics] listen`` asks for it. An address that cannot
        be bound stops the start (``metrics_failed``, then the one line ``listen_error``
        raises: exit 1 when it is in use, 78 when it is not this machine's)."""
        address = self.config.metrics.address
        if address is None:
            return
        server = MetricsServer(address, asyncio.get_running_loop(), sample)
        listen = self.config.metrics.listen
        try:
            server.start()
        except OSError as exc:
            self.emit(Event.METRICS_FAILED, level="error", listen=listen, error=str(exc))
            raise listen_error("[metrics] listen", listen, exc) from None
        self.metrics = server
        self.emit(Event.METRICS_SERVING, listen=listen)

    def _serve_status(self) -> None:
        """Answer `status --json` on ``SPOOL/status.sock``; a socket that cannot be bound
        is said (``status_socket_failed``) and the daemon serves on without it."""
        settings = self.settings
        status = StatusSocket(self.spool, lambda: settings.config, lambda: settings.accepted)
        try:
            status.start()
        except OSError as exc:
            self.emit(Event.STATUS_SOCKET_FAILED, level="warning", error=str(exc))
            return
        self.status = status

    def _serve_console(self, *, wait: bool = True) -> None:
        """Serve the console from a process of its own (``supervisor.console.process``).
        At the start (``wait``), an address that cannot be bound, or a console that cannot
        serve, stops the start in one line (``console_failed``, as ``metrics_failed``)."""
        config_file = self.settings.worker_config or self.settings.file
        if self.config.console.address is None or config_file is None:
            return
        from supervisor.console.process import ConsoleProcess  # noqa: PLC0415  (only with a console)

        console = ConsoleProcess(
            self.spool,
            self.config.console,
            config_file,
            node=self.node,
            store_url=self.settings.credentials.get(credentials.STORE),
            environ=self.environ,
            emit=self.emit,
        )
        try:
            console.start(wait=wait)
        except AgentdError as exc:
            self.console_error = str(exc)
            self.emit(
                Event.CONSOLE_FAILED,
                level="error",
                listen=self.config.console.listen,
                error=str(exc),
            )
            raise
        self.console, self.console_error = console, None

    def reload(self, before: Config) -> bool:
        """A reload's ``[console]``: read again by the running console, or a console
        started, stopped or moved to its new address (one that cannot bind it is said in
        ``console_failed``, and the daemon serves on without). True when its address
        changed (``supervisor.json`` says it)."""
        from supervisor.console.process import differs  # noqa: PLC0415  (the same)

        console = self.config.console
        if self.console is not None and not differs(before.console, console):
            self.console.reload()
            return False
        if self.console is None and console.address is None:
            changed = self.console_error is not None
            self.console_error = None
            return changed
        if self.console is not None:
            self.console.stop()
            self.console = None
        with contextlib.suppress(AgentdError):  # (said: ``console_failed``)
            self._serve_console(wait=False)
        return True

    def _export_traces(self, relay: EventRelay) -> None:
        """Traces on: every line the relay reads also goes to the assembler, whose
        finished spans the exporter sends (``supervisor.traces``); the SDK missing stops
        the start (ConfigError: exit 78)."""
        self.traces = exporter_for(self.config.telemetry)
        if self.traces is not None:
            relay.spans = TraceAssembler(self.traces.export)
            settings = self.traces.settings
            self.emit(
                Event.TRACES_EXPORTING, endpoint=settings.endpoint, protocol=settings.protocol
            )
