"""The supervisor's side of the fork server (see worker/forkserver.py).

``ForkServer`` starts ``python -m worker.forkserver`` in the background and, once it has
said it is ready, asks it for workers. Until then, and whenever it has died or stopped
answering, ``spawn`` returns None and the caller starts the worker the slow way (a fresh
interpreter), so a broken fork server costs speed, never a task.

Workers forked by the server are re-parented to the supervisor, which must therefore be
a child subreaper (``worker.descendants.become_subreaper``) and reap them itself.

The server is executed with the workers' environment, which holds no secret; the daemon's
secrets reach it through a handover pipe (``worker.credentials.start_process``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from worker.credentials import Credentials, start_process


class ForkServer:
    def __init__(
        self, log: Path, env: Mapping[str, str], credentials: Credentials | None = None
    ) -> None:
        self.log = log
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
                [sys.executable, "-m", "worker.forkserver"],
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
        if not self.ready or self.proc is None or self.proc.stdin is None:
            return False
        request = {
            "task": str(task_path),
            "config": str(config) if config else None,
            "env": dict(env),
            "output": str(output),
        }
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
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

    def stop(self) -> None:
        """Close the server (it exits when its input closes); restart later, not now."""
        proc, self.proc, self.ready = self.proc, None, False
        self._next_start = time.monotonic() + 5.0
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
