"""The daemon's handle on the console's process (``python -m supervisor.console``).

``ConsoleProcess.start`` binds ``[console] listen`` in the daemon itself, so that an
address that cannot be bound stops ``agentd start`` in one line, as ``[metrics] listen``
does (``listen_error``), then starts the process with the socket, and waits (at most
``READY_PATIENCE`` seconds, once, at the start) for it to say it serves: one that cannot
(TLS files that do not load) stops the start with its one line too (exit 78).

From then on the process is watched from the daemon's loop through its pidfd, as hooks
are; what it says on its standard output (one JSON object a line: ``console_login``,
``console_login_failed``...) is logged in the daemon's own stream. One that ends is
started again on the same socket after a backoff (``RESTART_BACKOFF``, doubling, reset
once it has served a minute). The daemon's stop ends it (TERM, then KILL); the daemon's
death ends it too (it asks the kernel for it: ``worker.descendants.dies_with``). Its
environment has no secret: the store's URL, on a cluster, goes through the credentials
pipe, and it is given no API key at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from supervisor.console import READY, console_url
from supervisor.metrics import listen_error
from worker import credentials
from worker.config import ConsoleConfig
from worker.errors import AgentdError, ConfigError
from worker.events import Event
from worker.spool import Spool

#: Seconds the daemon's start waits for the console to say it serves.
READY_PATIENCE = 20.0
#: Seconds before the first restart of a console that ended, doubling up to the last.
RESTART_BACKOFF = (1.0, 60.0)
#: Seconds a console must have served for its next end to restart it at once again.
STEADY = 60.0
#: The most bytes of one line the console says; a longer one is dropped.
LINE_LIMIT = 64 * 1024
#: Seconds a stop waits for the console to end after TERM.
STOP_PATIENCE = 3.0

Emit = Callable[..., None]


class ConsoleProcess:
    def __init__(
        self,
        spool: Spool,
        console: ConsoleConfig,
        config_path: Path,
        *,
        node: str | None,
        store_url: str | None,
        environ: Mapping[str, str],
        emit: Emit,
    ) -> None:
        self.spool = spool
        self.console = console
        self.config_path = config_path
        self.node = node
        self.store_url = store_url
        self.environ = dict(environ)
        self.emit = emit
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._pidfd = -1
        self._buffer = b""
        self._started = 0.0
        self._backoff = RESTART_BACKOFF[0]
        self._restart: asyncio.TimerHandle | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    # -- the start ------------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> None:
        """Bind, start the process and (``wait``: the daemon's start) wait for it to
        serve; raises the one line of a start that cannot serve (``listen_error``, or the
        process's own). Without ``wait`` (a reload), what it says is logged as it comes."""
        address = self.console.address
        assert address is not None  # noqa: S101  (the daemon makes one for a listen address)
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise listen_error("[console] listen", self.console.listen, exc) from None
        self.sock = sock
        self.url = console_url(self.console, sock.getsockname()[1])
        self._spawn()
        said = self._first_words() if wait else None
        if said is not None and said.get("event") == Event.CONSOLE_FAILED:
            code = self._code  # (it ends by itself once it said so)
            self.stop()
            error = str(said.get("error") or "the console could not start")
            raise ConfigError(error) if code == ConfigError.exit_code else AgentdError(error)
        self._watch()

    def _spawn(self) -> None:
        assert self.sock is not None  # noqa: S101  (bound by ``start``)
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "supervisor.console", "--spool", str(self.spool.root)]
        cmd += ["--config", str(self.config_path), "--fd", str(fd), "--parent", str(os.getpid())]
        if self.node:
            cmd += ["--node", self.node]
        held = credentials.Credentials()
        if self.store_url:
            held = held.with_value(credentials.STORE, self.store_url)
        with credentials.handing_over(held, credentials.without_credentials(self.environ)) as (
            env,
            fds,
        ):
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                pass_fds=(fd, *fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                start_new_session=True,  # (a signal to the daemon's group is not its)
            )
        self._started = time.monotonic()
        self._buffer = b""
        assert self.proc.stdout is not None  # noqa: S101  (PIPE)
        os.set_blocking(self.proc.stdout.fileno(), False)

    @property
    def _code(self) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=STOP_PATIENCE)
        return None

    def _first_words(self) -> dict[str, Any] | None:
        """(Blocking, once, at the start.) The first thing the process says (ready, or
        why it cannot serve), or None when it says nothing within ``READY_PATIENCE``."""
        assert self.proc is not None and self.proc.stdout is not None  # noqa: S101
        out = self.proc.stdout.fileno()
        deadline = time.monotonic() + READY_PATIENCE
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([out], [], [], left)
            if not ready:
                break
            for line in self._lines(out):
                if line.get("event") == Event.CONSOLE_FAILED:
                    return line  # (the daemon says it, as its start's one line)
                self._said(line)
                if line.get("event") == READY:
                    return line
            if self.proc.poll() is not None:
                return {"event": Event.CONSOLE_FAILED, "error": "the console ended at its start"}
        return None

    # -- watched from the loop ------------------------------------------------------------

    def _watch(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None  # noqa: S101
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except OSError:  # ended and reaped already
            self._ended()
            return
        loop.add_reader(self._pidfd, self._ended)
        loop.add_reader(self.proc.stdout.fileno(), self._read)

    def _read(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            for line in self._lines(self.proc.stdout.fileno()):
                self._said(line)

    def _lines(self, fd: int) -> list[dict[str, Any]]:
        """What the process said since the last read, one JSON object a line."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._buffer += chunk
            if len(self._buffer) > LINE_LIMIT and b"\n" not in self._buffer:
                self._buffer = b""  # a line past the limit: dropped
        *lines, self._buffer = self._buffer.split(b"\n")
        said = []
        for line in lines:
            with contextlib.suppress(ValueError):
                data = json.loads(line)
                if isinstance(data, dict) and isinstance(data.get("event"), str):
                    said.append(data)
        return said

    def _said(self, said: dict[str, Any]) -> None:
        """Log a line of the console's in the daemon's stream."""
        line = dict(said)
        event = str(line.pop("event"))
        level = line.pop("level", "info")
        level = level if level in ("info", "warning", "error") else "info"
        if event == READY:
            self.emit(Event.CONSOLE_SERVING, listen=self.console.listen, url=self.url)
            return
        self.emit(event, level=level, **{k: v for k, v in line.items() if k != "task"})

    def _ended(self) -> None:
        loop = asyncio.get_running_loop()
        proc = self.proc
        if proc is None:
            return
        if self._pidfd >= 0:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if proc.stdout is not None:
            with contextlib.suppress(ValueError, OSError):
                out = proc.stdout.fileno()
                for line in self._lines(out):
                    self._said(line)
                loop.remove_reader(out)
            proc.stdout.close()
        code = proc.wait()
        if self._stopping:
            return
        if time.monotonic() - self._started >= STEADY:
            self._backoff = RESTART_BACKOFF[0]
        delay, self._backoff = self._backoff, min(self._backoff * 2, RESTART_BACKOFF[1])
        shown = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        self.emit(Event.CONSOLE_EXITED, level="warning", exit=shown, restart_in=delay)
        self._restart = loop.call_later(delay, self._again)

    def _again(self) -> None:
        self._restart = None
        if self._stopping:
            return
        try:
            self._spawn()
        except OSError as exc:
            self.emit(Event.CONSOLE_FAILED, level="error", error=str(exc))
            self._restart = asyncio.get_running_loop().call_later(self._backoff, self._again)
            return
        self._watch()

    # -- reload and stop ------------------------------------------------------------------

    def reload(self) -> None:
        """The daemon accepted a new config whose console listens where this one does:
        the process reads it again (hostnames, session timeout, the rest)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGHUP)

    def stop(self) -> None:
        """End the process (TERM, then KILL after ``STOP_PATIENCE``) and close the socket."""
        self._stopping = True
        if self._restart is not None:
            self._restart.cancel()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_PATIENCE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if proc is not None and proc.stdout is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(proc.stdout.fileno())
            proc.stdout.close()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def differs(old: ConsoleConfig, new: ConsoleConfig) -> bool:
    """Whether a reload's console needs a new socket and process (else ``reload``: the
    process reads the config again, its certificate files too)."""
    return any(getattr(old, k) != getattr(new, k) for k in ("listen", "tls_cert", "tls_key"))
