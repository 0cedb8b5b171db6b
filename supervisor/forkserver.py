"""The supervisor's side of the fork server (see worker/forkserver.py).

``ForkServer`` starts ``python -m worker.forkserver`` in the background and, once it has
said it is ready, asks it for workers. Until then, and whenever it has died or stopped
answering, ``spawn`` returns None and the caller starts the worker the slow way (a fresh
interpreter), so a broken fork server costs speed, never a task.

Workers forked by the server are re-parented to the supervisor, which must therefore be
a child subreaper (``worker.descendants.become_subreaper``) and reap them itself.

The server is executed with the workers' environment, which holds no secret; the daemon's
secrets reach it through a handover pipe (``worker.credentials.start_process``).

Given ``standby_config``, the queue has the server keep a standby worker, forked ahead of
need with the workers' config read ahead: told when the server is ready, and again at
each reload (``renew_standby``), so a standby never starts a task on a config it read
before the reload. The daemon never sees a standby until it is handed a task: it is no
child of the daemon until then, and counts as no worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Generic, TypeVar

from worker.credentials import Credentials, start_process
from worker.events import Event
from worker.forkserver import PRELOAD_MCP, STANDBY
from worker.store.base import Cursor


class ForkServer:
    def __init__(
        self,
        log: Path,
        env: Mapping[str, str],
        credentials: Credentials | None = None,
        *,
        preload_mcp: bool = False,
    ) -> None:
        self.log = log
        self.preload_mcp = preload_mcp  # the MCP SDK too: [mcp.servers] is configured
        self.env = dict(env)
        self.credentials = credentials or Credentials()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False
        self._buffer = b""
        self.restarts = 0
        self._next_start = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Start the server (non-blocking: it becomes ready in a second or two)."""
        if self.proc is not None or time.monotonic() < self._next_start:
            return
        try:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:  # a full or read-only spool: the server's complaints go unheard
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            self.proc = start_process(
                [sys.executable, "-m", "worker.forkserver", str(self.log)]
                + ([PRELOAD_MCP] if self.preload_mcp else []),
                self.credentials,
                self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                start_new_session=True,  # no terminal signals: it ends when stdin closes
            )
        finally:
            os.close(fd)
        self.ready = False
        self._buffer = b""

    def fileno(self) -> int | None:
        """The descriptor to watch for the server's first line (its readiness)."""
        if self.proc is None or self.proc.stdout is None:
            return None
        return self.proc.stdout.fileno()

    def poll_ready(self) -> bool:
        """Read what the server said so far; True once it has said it is ready."""
        if self.ready or self.proc is None:
            return self.ready
        try:
            line = self._read_line(0.0)
            if line is not None:
                self.ready = json.loads(line).get("ready") is True
        except (OSError, ValueError, EOFError):
            self.stop()
        return self.ready

    def _read_line(self, timeout: float) -> bytes | None:
        stdout: IO[bytes] | None = self.proc.stdout if self.proc else None
        if stdout is None:
            return None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([stdout], [], [], left)
            if not readable:
                return None
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                raise EOFError("the fork server closed its output")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def request(
        self, task_path: Path, config: Path | None, env: Mapping[str, str], output: Path
    ) -> bool:
        """Ask for a worker without waiting for the answer, which ``replies`` reads once
        ``fileno`` is readable (answers come in the order of the requests). False when
        the server cannot take the request now (the caller starts the worker fresh)."""
        request = {
            "task": str(task_path),
            "config": str(config) if config else None,
            "env": dict(env),
            "output": str(output),
        }
        return self._send(request)

    def standby(self, config: Path | None) -> bool:
        """Have the server (re)place its standby, a worker forked ahead of need that reads
        ``config`` ahead (``worker.forkserver``); no answer comes. False when the server
        cannot take the line now."""
        return self._send({STANDBY: {"config": str(config) if config else None}})

    def _send(self, line: Mapping[str, object]) -> bool:
        """Write one line to the server; False when it cannot take it now (a write that
        fails stops it)."""
        if not self.ready or self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write((json.dumps(line) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            self.stop()
            return False
        return True

    def replies(self) -> list[int | None] | None:
        """The answers that have arrived, without waiting: a worker's pid, or None for a
        request the server could not serve. None when the server is gone or garbled (it
        is stopped then: every request without an answer is lost)."""
        found: list[int | None] = []
        try:
            while (line := self._read_line(0.0)) is not None:
                pid = json.loads(line).get("pid")
                found.append(pid if isinstance(pid, int) else None)
        except (OSError, ValueError, EOFError, AttributeError):
            self.stop()
            return None
        return found

    def stop(self, *, restart_later: bool = True) -> None:
        """Close the server (it exits when its input closes); restart later, not now
        (``restart_later`` False: at the next start)."""
        proc, self.proc, self.ready = self.proc, None, False
        self._next_start = time.monotonic() + 5.0 if restart_later else 0.0
        if proc is None:
            return
        self.restarts += 1
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(OSError):
            proc.kill()
        # Reaped here, as the daemon's other own children are: a child of the daemon it
        # no longer names is a stray (``Supervisor.own_children``). SIGKILL takes ms.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)


#: Seconds the fork server may take to answer a request.
PATIENCE = 5.0
#: Seconds a start may wait for a fork server that is still warming up (importing what a
#: worker needs, right after the daemon started it) before it starts a fresh interpreter.
#: A fresh start imports the same things, competing with the server for the CPU: a
#: restart in the first seconds after `agentd start` comes back sooner by waiting. The
#: SDK's import takes about a second on an idle machine and several on a loaded one.
WARMUP_WAIT = 8.0

T = TypeVar("T")


@dataclass
class Asked(Generic[T]):
    """A worker asked of the fork server for ``item`` (the daemon's task slot)."""

    item: T
    journal_at: Cursor  # the task's journal's end before the worker could write to it
    asked: float  # monotonic
    request: tuple[Path, Path | None, dict[str, str], Path] | None = None  # while warming


class ForkQueue(Generic[T]):
    """The workers asked of the fork server whose pid has not arrived: the daemon's loop
    goes on meanwhile and hands each answer, in the order of the requests, to
    ``answered`` (a pid, or None for one the server could not serve). What the server
    cannot serve any more (it died, stopped answering, or did not warm up in time) goes
    to ``settle``, to be started fresh: a broken fork server costs speed, never a task.
    ``settle`` is called after every change of the queue (with no request, often): the
    caller's moment to act on what waited for the queue to settle (a sweep of strays).

    Asked while the server warms up, a start the caller says may wait waits for it
    (``WARMUP_WAIT`` at most): its request is sent the moment the server says it is
    ready. Only in the server's first ``WARMUP_WAIT`` seconds: one that is not ready by
    then is slow or stuck, and the starts after that do not wait for it. The server's
    output is watched on the loop only while something waits on it, so an idle daemon
    never reads it; ``tend`` (each tick) does the rest: readiness, deadlines, restarts."""

    def __init__(
        self,
        server: ForkServer,
        *,
        answered: Callable[[Asked[T], int | None], None],
        settle: Callable[[list[Asked[T]]], None],
        emit: Callable[..., None],
        clock: Callable[[], float] = time.monotonic,
        standby_config: Callable[[], Path | None] | None = None,
    ) -> None:
        self.server = server
        self._standby_config = standby_config  # None: the server keeps no standby
        self._answered = answered
        self._settle = settle
        self.emit = emit
        self._clock = clock
        self._answering: deque[Asked[T]] = deque()  # sent, in the order the server answers
        self._warming: list[Asked[T]] = []  # to be sent once the server is ready
        self._started = clock()  # when the server was (last) started, about
        self._fd: int | None = None  # watched while something waits on the server

    @property
    def answering(self) -> bool:
        """Whether requests were sent whose answer has not arrived: a worker the server
        forked and has not named yet cannot be told from a stray."""
        return bool(self._answering)

    def ask(
        self,
        item: T,
        journal_at: Cursor,
        task_path: Path,
        config: Path | None,
        env: Mapping[str, str],
        output: Path,
        *,
        wait: bool,
    ) -> bool:
        """Ask for a worker for ``item``; False when the server cannot take it now (off,
        broken, or not ready and not to be waited for: ``wait`` False, or the server is not
        warming up): the caller starts one fresh."""
        asked = Asked(item, journal_at, self._clock())
        server = self.server
        if server.ready:
            if not server.request(task_path, config, env, output):
                return False
            self._answering.append(asked)
        elif (
            wait
            and self._clock() - self._started < WARMUP_WAIT
            and server.proc is not None
            and server.proc.poll() is None
        ):
            asked.request = (task_path, config, dict(env), output)
            self._warming.append(asked)
        else:
            return False
        self._watch()
        return True

    def tend(self) -> None:
        """Each tick: give up on a server that does not answer or has exited, restart one
        that is gone, notice readiness, and start fresh what waited too long for it."""
        server = self.server
        if self._answering and self._clock() - self._answering[0].asked > PATIENCE:
            self.fail("the fork server did not answer")
        if server.proc is not None and server.proc.poll() is not None:
            self.emit(Event.FORKSERVER_EXITED, level="warning", code=server.proc.returncode)
            self.fail("the fork server exited")
        if server.proc is None:
            server.start()
            if server.proc is not None:
                self._started = self._clock()
        elif not server.ready and server.poll_ready():
            self._ready()
        if self._warming and not server.ready:
            deadline = self._clock() - WARMUP_WAIT
            late = [a for a in self._warming if a.asked <= deadline]
            if late:
                self._warming = [a for a in self._warming if a.asked > deadline]
                self._settle_lost(late)

    def fail(self, why: str) -> None:
        """The server died or stopped answering: stop it (``tend`` restarts it later) and
        hand every request it was given to ``settle`` (one it did fork meanwhile holds its
        task's lock, and the fresh worker then waits for it: never two at once)."""
        self._unwatch()
        self.server.stop()
        pending = [*self._answering, *self._warming]
        self._answering, self._warming = deque(), []
        if pending:
            self.emit(Event.FORKSERVER_FAILED, level="warning", why=why, pending=len(pending))
        self._settle_lost(pending)

    def renew(self, credentials: Credentials) -> None:
        """The daemon's secrets changed (SIGHUP read a key file again): the server, whose
        forks inherit what it holds, is started again with ``credentials``; what it was
        asked meanwhile is settled (started fresh, with the new ones)."""
        self.server.credentials = credentials
        if self.server.proc is None:
            return
        self._unwatch()
        self.server.stop(restart_later=False)
        pending = [*self._answering, *self._warming]
        self._answering, self._warming = deque(), []
        self._settle_lost(pending)

    def renew_standby(self) -> None:
        """The config changed (a reload): the server's standby, which read the old one
        ahead, is replaced by one that reads the new one (a server not ready yet is told
        when it is)."""
        if self._standby_config is not None and self.server.ready:
            self.server.standby(self._standby_config())

    def abandon_warming(self) -> list[Asked[T]]:
        """At a stop: what waits for the server to warm up is not started; returned."""
        warming, self._warming = self._warming, []
        if not self._answering:
            self._unwatch()
        return warming

    def close(self) -> None:
        """Once the workers are gone at a stop: stop the server."""
        self._unwatch()
        self._warming = []
        self.server.stop()

    def _ready(self) -> None:
        """The server said it is ready: send what waited for it, in the order asked."""
        self.emit(Event.FORKSERVER_READY, pid=self.server.pid)
        warming, self._warming = self._warming, []
        failed = []
        for asked in warming:
            request, asked.request = asked.request, None
            if request is not None and self.server.request(*request):
                asked.asked = self._clock()  # its patience runs from now, not from the wait
                self._answering.append(asked)
            else:
                failed.append(asked)
        self.renew_standby()  # after what waited: the first of them gets no standby
        self._settle_lost(failed)

    def _readable(self) -> None:
        server = self.server
        if not server.ready:
            if server.poll_ready():
                self._ready()
            elif server.proc is None:  # it closed its output before it was ready
                self.fail("the fork server exited before it was ready")
                return
        answers = server.replies() if server.ready else []
        if answers is None:  # the server is gone: what it was asked is started fresh
            self.fail("the fork server closed its output")
            return
        for pid in answers:
            if not self._answering:
                break
            self._answered(self._answering.popleft(), pid)
        if not self._answering and not self._warming:
            self._unwatch()
        self._settle([])

    def _settle_lost(self, lost: list[Asked[T]]) -> None:
        if not self._answering and not self._warming:
            self._unwatch()
        self._settle(lost)

    def _watch(self) -> None:
        fd = self.server.fileno()
        if fd is not None and self._fd is None:
            asyncio.get_running_loop().add_reader(fd, self._readable)
            self._fd = fd

    def _unwatch(self) -> None:
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
