"""Hooks: the operator's commands the daemon runs when a task needs a human or ends.

``[hooks] on_held``, ``on_failed`` and ``on_done`` (docs/design.md section 8) each name a
command, an argv list. The daemon runs it as itself (not in any sandbox: a hook is the
operator's own code, which pages someone or opens a ticket) with:

* the event as one JSON object on standard input: ``event``, ``task``, ``reason``,
  ``node``, ``timestamp``, and for a hold ``kind`` (``HoldKind``: what it waits for)
  and ``dangling``, the held calls as ``agentd dangling --json`` shows them (a hold on
  a budget has none, and the event ``budget_exhausted``); when an operator's action
  led to the state, who took it (``by``, ``via``) and its event (``acted``;
  docs/design.md section 15);
* ``AGENTD_EVENT`` and ``AGENTD_TASK`` in its environment, which is the daemon's
  without any credential (``worker.credentials.without_credentials``), without libpq's
  variables (``PGPASSWORD``, ``PGPASSFILE``...: ``without_libpq``) and without the
  systemd notification variables: a hook gets neither the API key, nor the store's
  password, nor the watchdog.

A hook never blocks and never crashes the daemon. It is started at once (a fork and an
exec, as a fresh worker is) with its input in an unlinked file, so nothing waits on a
pipe, and then watched through its pidfd from the daemon's loop, like a worker. One
that exits with a code other than 0, cannot be started, or runs past ``HOOK_TIMEOUT``
seconds (its whole process group is then killed) is reported as ``hook_failed``, with
the last line of its stderr (read from its end, ``STDERR_READ`` bytes at most: a hook's
output never grows the daemon). A running hook is one of the daemon's own children
(``HookRunner.pids``, in ``Supervisor.own_children``): the sweep of strays spares it;
what it leaves behind when it ends is a stray like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from worker.config import HooksConfig
from worker.credentials import without_libpq
from worker.errors import ConfigError
from worker.events import Event
from worker.protocol import TaskStatus

#: Seconds a hook may run before its process group is killed.
HOOK_TIMEOUT = 10.0

#: The task state each hook is run on, and the event name it is run for.
HOOK_STATES = {
    TaskStatus.HELD: ("on_held", Event.DANGLING_HELD),
    TaskStatus.FAILED: ("on_failed", Event.TASK_FAILED),
    TaskStatus.DONE: ("on_done", Event.TASK_DONE),
}


class HoldKind(StrEnum):
    """What an ``on_held`` hook's hold waits for (its payload's ``kind``)."""

    CALL = "call"  # a call whose outcome is unknown: ``agentd approve-dangling``
    BUDGET = "budget"  # its budget, spent: ``agentd budget`` (event ``budget_exhausted``)


#: Characters of a failed hook's stderr kept for ``hook_failed``.
STDERR_TAIL = 300
#: Bytes of a failed hook's stderr read back, from its end: whatever a hook writes (300 MB,
#: say), the daemon holds no more than this of it, its last lines.
STDERR_READ = 64 * 1024


def check_commands(hooks: HooksConfig, source: Path | str) -> None:
    """Raise ConfigError when a hook's command cannot be found or run here: what
    ``agentd config check`` says before the first hold would have found out."""
    for f in fields(hooks):
        command = getattr(hooks, f.name)
        if not command:
            continue
        program = command[0]
        found = shutil.which(program)
        if found is None:
            where = "is not an executable file" if os.sep in program else "is not on PATH"
            raise ConfigError(
                f"{source}: hooks.{f.name}: {program} {where}; give the full path of an "
                "executable, or [] for no hook."
            )


#: Reports a hook that failed: (task id, hook key, why).
Report = Callable[[str, str, str], None]


@dataclass
class _Running:
    """A hook that has not ended yet."""

    hook: str
    task: str
    proc: subprocess.Popen[bytes]
    pidfd: int
    stderr: IO[bytes]
    timer: asyncio.TimerHandle
    timed_out: bool = False


class HookRunner:
    """Starts hooks and watches them from the running asyncio loop."""

    def __init__(
        self, environ: Mapping[str, str], report: Report, *, timeout: float = HOOK_TIMEOUT
    ) -> None:
        self._environ = without_libpq(environ)
        self._report = report
        self._timeout = timeout
        self._running: dict[int, _Running] = {}

    def pids(self) -> set[int]:
        """The hooks that run now (the daemon's own children, not strays)."""
        return set(self._running)

    def run(self, hook: str, command: Sequence[str], event: Mapping[str, Any]) -> None:
        """Start ``command`` for ``event`` (it has ``event`` and ``task``) and return at once;
        any failure to start it is reported, never raised."""
        task, name = str(event["task"]), str(event["event"])
        try:
            stdin = tempfile.TemporaryFile()  # noqa: SIM115  (closed when the hook ends)
            stderr = tempfile.TemporaryFile()  # noqa: SIM115  (the same)
        except OSError as exc:
            self._report(task, hook, f"cannot start it: {exc}")
            return
        with stdin:
            try:
                stdin.write(json.dumps(event, ensure_ascii=False, default=str).encode() + b"\n")
                stdin.seek(0)
                proc = subprocess.Popen(
                    list(command),
                    stdin=stdin,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    env={**self._environ, "AGENTD_EVENT": name, "AGENTD_TASK": task},
                    start_new_session=True,  # its group is killed at the limit
                )
            except (OSError, ValueError) as exc:
                stderr.close()
                self._report(task, hook, f"cannot start {command[0]}: {exc}")
                return
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:  # ended and reaped already (nothing else reaps it): settle it now
            proc.wait()
            self._settled(hook, task, proc.returncode, stderr, timed_out=False)
            return
        timer = loop.call_later(self._timeout, self._kill, proc.pid)
        self._running[proc.pid] = _Running(hook, task, proc, pidfd, stderr, timer)
        loop.add_reader(pidfd, self._ended, proc.pid)

    def _kill(self, pid: int) -> None:
        running = self._running.get(pid)
        if running is not None:
            running.timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _ended(self, pid: int) -> None:
        running = self._running.pop(pid)
        asyncio.get_running_loop().remove_reader(running.pidfd)
        os.close(running.pidfd)
        running.timer.cancel()
        code = running.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # what it started in its group ends with it
        self._settled(running.hook, running.task, code, running.stderr, timed_out=running.timed_out)

    def _settled(
        self, hook: str, task: str, code: int, stderr: IO[bytes], *, timed_out: bool
    ) -> None:
        with stderr:
            if code == 0 and not timed_out:
                return
            try:
                size = stderr.seek(0, os.SEEK_END)
                stderr.seek(max(0, size - STDERR_READ))
                tail = stderr.read(STDERR_READ)
                lines = tail.decode("utf-8", "replace").strip().splitlines()
            except OSError:
                lines = []
        if timed_out:
            why = f"killed after {self._timeout:g} s"
        elif code < 0:
            why = f"killed by {signal.Signals(-code).name}"
        else:
            why = f"exit {code}"
        if lines:
            why += f": {lines[-1][-STDERR_TAIL:]}"
        self._report(task, hook, why)

    async def wait(self, seconds: float) -> None:
        """Let the running hooks end, for ``seconds`` at most (at a stop); each is killed
        at its own limit meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self._running and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for pid in list(self._running):
            self._kill(pid)
