"""A real daemon under test (``python -m supervisor start``), and the tools to watch it.

Shared by the end-to-end daemon tests (``tests/supervisor/test_daemon.py``) and the
supervision chaos campaign (``tests/chaos/supervision.py``):

* ``Daemon``: one spool and one config, the daemons started on them (each in its own
  session), their tasks and status rows, the CLI in-process or as a process, and a
  clean-up that kills every process the spool ever had;
* ``WorkerCensus``: a thread that samples which processes hold a task's journal open for
  writing, to prove that no task ever had two workers at once;
* ``config_text()``: the config of a daemon under test, with fast heartbeats and restarts;
* ``subreaper()``: makes this process a child subreaper, so workers orphaned by a killed
  daemon are reparented to it and reaped here instead of piling up as zombies of PID 1.

Every wait is a deadline poll (``tests.support.poll_for``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from supervisor import cli
from supervisor.coordination import ring, running_pid, supervisor_info
from supervisor.status import status_row
from tests.support import (
    REPO,
    journal_records,
    poll_for,
    reply,
    scripted_task,
    text,
    tool_use,
    worker_env,
)
from worker.config import load_config
from worker.events import read_events, read_events_from
from worker.protocol import FINAL_STATES
from worker.spool import Spool, TaskDir

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37

#: Pids of the daemons started here: their Popen objects reap them, ``reap_orphans`` not.
OWN_CHILDREN: set[int] = set()


#: The heartbeats, stop grace and crash-loop limit of ``config_text()`` unless told.
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 2.0
STOP_GRACE = 2.0
CRASH_LOOP_LIMIT = 3


def config_text(
    *,
    max_workers: int = 8,
    interval: float = HEARTBEAT_INTERVAL,
    timeout: float = HEARTBEAT_TIMEOUT,
    model_call: float | None = 60.0,
    tool_call: float | None = 120.0,
    backoff_initial: float = 0.1,
    backoff_max: float | None = 0.4,
    crash_loop_limit: int | None = CRASH_LOOP_LIMIT,
    stop_grace: float | None = STOP_GRACE,
    model: str | None = None,
    sandbox: str | None = "auto",
    tool_modules: tuple[str, ...] = ("tests.crash_tools",),
    tools: str = "",
    extra: str = "",
) -> str:
    """The config of a daemon under test: heartbeats, deadlines and restarts fast enough
    for a test to see them. A key given None is left out (the default config's value);
    ``tools`` is more of the ``[tools]`` table (written when it has a key), ``extra`` more
    TOML after it. Each test module or campaign passes the values its faults need."""
    text = f"max_workers = {max_workers}\n[heartbeat]\ninterval = {interval}\ntimeout = {timeout}\n"
    if model_call is not None or tool_call is not None:
        text += "[deadlines]\n"
        text += f"model_call = {model_call}\n" if model_call is not None else ""
        text += f"tool_call = {tool_call}\n" if tool_call is not None else ""
    text += f"[restart]\nbackoff_initial = {backoff_initial}\n"
    text += f"backoff_max = {backoff_max}\n" if backoff_max is not None else ""
    text += f"crash_loop_limit = {crash_loop_limit}\n" if crash_loop_limit is not None else ""
    text += f"stop_grace = {stop_grace}\n" if stop_grace is not None else ""
    text += f'[model]\nname = "{model}"\n' if model is not None else ""
    table = f'sandbox = "{sandbox}"\n' if sandbox is not None else ""
    names = ", ".join(f'"{name}"' for name in tool_modules)
    table += f"modules = [{names}]\n" if tool_modules else ""
    table += tools
    text += f"[tools]\n{table}" if table else ""
    return text + extra


class Daemon:
    """One spool, one config, and the daemons started on them."""

    def __init__(self, root: Path, config: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.spool = Spool(root / "spool")
        self.config_path = root / "agentd.toml"
        self.config_path.write_text(config)
        self.config = load_config(self.config_path)
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []

    # -- processes ----------------------------------------------------------------------

    def as_user(self) -> contextlib.AbstractContextManager[None]:
        """Inside it, files this process makes belong to the daemon's user (``agentd
        submit`` as that user): the daemon's own user here, another under the emulated
        unit (``tests.unitdaemon``)."""
        return contextlib.nullcontext()

    def give(self, path: Path) -> Path:
        """``path``, a tree made by this process's children (git), given to the daemon's
        user: already its own here."""
        return path

    def here(self, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` where this daemon runs, as its user."""
        return argv

    def launch(self, *args: str) -> list[str]:
        """The argv that runs ``agentd ARGS`` where this daemon runs."""
        return self.here(self.command(*args))

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "supervisor",
            "--spool",
            str(self.spool.root),
            "--config",
            str(self.config_path),
            *args,
        ]

    def start(
        self,
        env: dict[str, str] | None = None,
        *,
        timeout: float = 60.0,
        args: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start ``agentd start ARGS`` in its own session; return once it serves."""
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                self.launch("--log-format", "json", "start", *args),
                cwd=REPO,
                env=worker_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        OWN_CHILDREN.add(proc.pid)
        self.proc = proc

        def serving() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the daemon exited with {proc.returncode}:\n{self.log()}")
            info = supervisor_info(self.spool) or {}
            return info.get("pid") == proc.pid and running_pid(self.spool) == proc.pid

        poll_for(serving, timeout, what="the daemon to serve")
        return proc

    def kill(self) -> None:
        """``kill -9`` of the daemon alone (its workers live on in their own sessions)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> tuple[int, str, str]:
        assert self.proc is not None
        result = self.cli("stop")
        self.proc.wait(timeout=10)
        return result

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except FileNotFoundError:
            return ""

    def log_events(self) -> list[dict[str, Any]]:
        return read_events(self.log_path)

    # -- tasks --------------------------------------------------------------------------

    def task(self, task_id: str) -> TaskDir:
        return self.spool.task(task_id)

    def submit(self, responses: list[dict[str, Any]], name: str, **kwargs: Any) -> str:
        """Submit a scripted task the way ``agentd submit`` does, and ring the daemon."""
        task = scripted_task(self.spool, responses, config=self.config, name=name, **kwargs)
        ring(self.spool, task.id)
        return task.id

    def row(self, task_id: str) -> dict[str, Any]:
        return status_row(self.task(task_id))

    def wait_row(
        self,
        task_id: str,
        predicate: Callable[[dict[str, Any]], object],
        timeout: float = 60.0,
        what: str = "",
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            row = self.row(task_id)
            return row if predicate(row) else None

        try:
            row = poll_for(check, timeout, interval=0.02, what=f"{task_id}: {what}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last row {self.row(task_id)}\n{self.log()}") from None
        assert row is not None
        return row

    def wait_state(self, task_id: str, *states: str, timeout: float = 60.0) -> dict[str, Any]:
        return self.wait_row(task_id, lambda r: r["state"] in states, timeout, f"state {states}")

    def wait_running(
        self, task_id: str, *, not_pids: frozenset[int] = frozenset()
    ) -> dict[str, Any]:
        """A row for a running worker that is not one of ``not_pids``."""
        return self.wait_row(
            task_id,
            lambda r: r["state"] == "running" and r["pid"] and r["pid"] not in not_pids,
            what="a new running worker",
        )

    def events(self, task_id: str, name: str | None = None) -> list[dict[str, Any]]:
        events = read_events(self.task(task_id).events)
        return [e for e in events if name is None or e.get("event") == name]

    # -- the command line ---------------------------------------------------------------

    def cli(self, *args: str) -> tuple[int, str, str]:
        """``agentd ARGS`` in this process: (exit code, stdout, stderr)."""
        out, err = io.StringIO(), io.StringIO()
        argv = ["--spool", str(self.spool.root), "--config", str(self.config_path), *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        return code, out.getvalue(), err.getvalue()

    def run_cli(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """``agentd ARGS`` as its own process (``env`` added to the tests' environment)."""
        return subprocess.run(
            self.launch(*args),
            cwd=REPO,
            env=worker_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # -- teardown -----------------------------------------------------------------------

    def cleanup(self) -> None:
        """Kill every process this spool ever had: daemons, workers, tools (by group)."""
        for proc in self.procs:
            if proc.poll() is None:  # (once reaped, its pid may belong to someone else)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        kill_spool_processes(self.spool.root)


class EventTail:
    """The daemon's log, read as it grows (from where the last read ended): what a
    campaign that sends hundreds of signals waits on without rereading the whole file.
    ``seen`` records, for each event, the monotonic time this process first read it (the
    daemon's own timestamps are wall time, which a clock campaign moves)."""

    def __init__(self, daemon: Daemon) -> None:
        self.path = daemon.log_path
        self.offset = 0
        self.events: list[dict[str, Any]] = []
        self.seen: list[float] = []

    def read(self) -> list[dict[str, Any]]:
        """The events that arrived since the last read."""
        new, self.offset = read_events_from(self.path, self.offset)
        self.events += new
        self.seen += [time.monotonic()] * len(new)
        return new

    def named(self, name: str) -> list[dict[str, Any]]:
        self.read()
        return [e for e in self.events if e.get("event") == name]

    def wait(self, name: str, count: int, timeout: float) -> list[dict[str, Any]] | None:
        """The events ``name`` once there are ``count`` of them, or None at the deadline."""
        with contextlib.suppress(AssertionError):
            return poll_for(lambda: (found := self.named(name))[count - 1 :] and found, timeout)
        return None


class Workload:
    """Scripted tasks that call ``write_file`` every turn, kept at a level of unfinished
    ones as others end: the running tasks a campaign's faults fall on."""

    def __init__(self, daemon: Daemon, rng: random.Random, turns: tuple[int, int]) -> None:
        self.daemon = daemon
        self.rng = rng
        self.range = turns
        self.turns: dict[str, int] = {}  # task -> its script's length

    def top_up(self, level: int, delay: float = 0.1) -> None:
        unfinished = [t for t in self.turns if self.daemon.row(t)["state"] != "done"]
        for _ in range(level - len(unfinished)):
            n = self.rng.randint(*self.range)
            steps = [
                reply(
                    text(f"{i}"), tool_use("write_file", path=f"{i}.txt", content="x"), delay=delay
                )
                for i in range(1, n)
            ]
            name = f"w{len(self.turns)}"
            self.turns[self.daemon.submit([*steps, reply(text("done"))], name=name)] = n

    def ended(self) -> bool:
        return all(self.daemon.row(t)["state"] in FINAL_STATES for t in self.turns)

    def completed(self) -> list[str]:
        """The tasks that ended ``done`` with every turn of their script recorded once."""
        return [
            t
            for t, n in self.turns.items()
            if self.daemon.row(t)["state"] == "done"
            and [r["turn"] for r in journal_records(self.daemon.task(t)) if r["k"] == "turn"]
            == list(range(1, n + 1))
        ]

    def restarts(self) -> int:
        return sum(int(self.daemon.row(t)["restarts"]) for t in self.turns)


# -- processes ------------------------------------------------------------------------------


def worker_pids(spool: Spool) -> set[int]:
    """Every worker pid the spool's daemons said they spawned."""
    pids: set[int] = set()
    for task in spool.tasks():
        for event in read_events(task.events):
            if event.get("event") == "worker_spawned" and isinstance(event.get("pid"), int):
                pids.add(event["pid"])
    return pids


def spool_processes(root: Path) -> list[psutil.Process]:
    """Live processes of a spool: the daemon and fresh workers (the spool is on their
    command line), forked workers (they hold a file of the spool open) and tool processes
    (their working folder is a workspace inside the spool)."""
    mark = str(root)
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if (
                mark in " ".join(proc.cmdline())
                or proc.cwd().startswith(mark)
                or any(f.path.startswith(mark) for f in proc.open_files())
            ):
                found.append(proc)
    return found


def kill_spool_processes(root: Path) -> None:
    mine = os.getpgrp()
    victims = spool_processes(root)
    for proc in victims:
        with contextlib.suppress(OSError):
            group = os.getpgid(proc.pid)
            if group != mine:
                os.killpg(group, signal.SIGKILL)
    reap_orphans()


def reap_orphans() -> None:
    """Reap zombie children that are not ours by birth: orphans of a killed daemon, which
    were reparented to this process (while it is a subreaper)."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.pid not in OWN_CHILDREN and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """This process is a child subreaper inside the block (and as it was after it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        reap_orphans()
        libc.prctl(PR_SET_CHILD_SUBREAPER, before.value, 0, 0, 0)


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group ``pgid``."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def parse_time(stamp: str) -> float:
    """An event's or record's ISO 8601 UTC stamp as a Unix time."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# -- the census ---------------------------------------------------------------------------


def journal_writers(tasks_dir: Path) -> dict[int, str]:
    """Workers by pid, in the order the sweep read them: the processes that hold a task's
    journal open for writing, which a worker does from taking the task lock to its end,
    however it was started (fresh or from the fork server). Readers (the daemon, status)
    open it read-only; a worker's child between fork and exec (a tool's shell) is not a
    second worker.

    Read straight from /proc (a link per descriptor, the flags of a journal's only): a
    census of a hundred workers costs milliseconds, not a core."""
    prefix = str(tasks_dir) + os.sep
    me = os.getpid()
    found: dict[int, tuple[str, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        writing = journal_written_by(int(entry.name), prefix)
        if writing is not None:
            found[int(entry.name)] = writing
    return {pid: task for pid, (task, parent) in found.items() if parent not in found}


def journal_written_by(pid: int, prefix: str) -> tuple[str, int] | None:
    """(the task, its parent's pid) if process ``pid`` holds the journal of a task under
    ``prefix`` open for writing, else None (none, or gone)."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except OSError:  # gone, or not ours to look at
        return None
    for fd in names:
        try:
            path = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if not (path.startswith(prefix) and path.endswith("/journal")):
            continue
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags = int(info.read().split("flags:", 1)[1].split()[0], 8)
            with open(f"/proc/{pid}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return path[len(prefix) :].split(os.sep)[0], ppid
    return None


class WorkerCensus:
    """Samples the live workers of a spool in a thread (``journal_writers``), to prove that
    no task ever had two workers at once. Keeps each worker's first and last sighting: its
    observed lifetime."""

    def __init__(self, spool: Spool, period: float = 0.01) -> None:
        self.tasks_dir = spool.tasks_dir
        self.period = period
        self.seen: dict[int, tuple[str, float, float]] = {}  # pid -> (task, first, last)
        self.overlaps: list[tuple[str, list[int]]] = []
        self.max_live = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerCensus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def live(self) -> dict[int, str]:
        return journal_writers(self.tasks_dir)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            live = self.live()
            per_task: dict[str, list[int]] = {}
            for pid, task in live.items():
                per_task.setdefault(task, []).append(pid)
            for task, pids in per_task.items():
                if len(pids) > 1:
                    pids[:] = self._at_once(task, pids)
                for pid in pids:
                    _, first, _ = self.seen.get(pid, (task, now, now))
                    self.seen[pid] = (task, first, now)
            self.overlaps += [(t, pids) for t, pids in per_task.items() if len(pids) > 1]
            self.max_live = max(self.max_live, len(live))
            self.samples += 1
            self._stop.wait(self.period)

    def _at_once(self, task: str, pids: list[int]) -> list[int]:
        """Of the writers one sweep found for ``task`` (in the order it read them), those
        proven to be alive at once. A sweep of /proc is no snapshot: a worker read early in
        it may have ended, and its successor started, before the sweep reached the
        successor. So an earlier one counts only if it still writes the journal now, after
        the last was read: then it was alive when the last was (a process does not come
        back). One that does not is left out of this sample."""
        prefix = str(self.tasks_dir) + os.sep
        last = pids[-1]
        still = [p for p in pids[:-1] if journal_written_by(p, prefix) is not None]
        return [*still, last]

    def lifetimes(self) -> dict[str, list[tuple[float, float]]]:
        by_task: dict[str, list[tuple[float, float]]] = {}
        for task, first, last in self.seen.values():
            by_task.setdefault(task, []).append((first, last))
        return {t: sorted(spans) for t, spans in by_task.items()}

    def overlapping_tasks(self) -> set[str]:
        """Tasks seen with two workers in one sample, or whose workers' observed
        lifetimes overlap (a second worker seen before the first one's last sighting)."""
        bad = {task for task, _ in self.overlaps}
        for task, spans in self.lifetimes().items():
            if any(start <= end for (_, end), (start, _) in itertools.pairwise(spans)):
                bad.add(task)
        return bad
