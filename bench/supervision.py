"""What the supervision benchmarks share: a real agentd daemon, a real supervisord, a local
Messages API, and the clean-up that leaves no process behind.

Not a benchmark itself (no ``run``); ``bench/restart.py``, ``bench/footprint.py``,
``bench/throughput.py`` and ``bench/scale.py`` use it.

* ``bench_run``: the frame of each of those benchmarks (machine load before and after,
  warm bytecode, a temp work folder); ``PeerColumn`` says why a peer column is empty.
* ``Host``: what runs the workers, ``Daemon`` or ``Supervisord``, driven the same way:
  ``launch`` tasks, ``grow_idle`` to N idle workers; the census (``idle_workers``,
  ``live_worker``, ``worker_memory``) finds their workers through the spool.

* ``Daemon``: ``python -m supervisor --spool S --config C start`` in its own session, on a
  temp spool, as an operator starts it. ``preload=False`` starts the same ``Supervisor``
  with the fork server off through a three-line launcher (there is no CLI flag).
* ``Supervisord``: supervisord 4.3.0 from its own venv under ``bench/.peers/`` (its
  package is named ``supervisor`` like agentd's, so it never goes into agentd's venv),
  running ``python -m worker TASK_DIR`` programs with agentd's interpreter.
* ``ModelServer``: ``worker.testing.messages_api.MessagesAPIServer`` in this process; it stamps
  every request's arrival (``time.monotonic``) so a worker's first model request after
  a kill is the end point of a restart, measured without a file in between.
* ``child_env``: every process started here runs with bytecode caching on (a pip-installed
  deployment has its ``.pyc`` files). This sandbox sets ``PYTHONDONTWRITEBYTECODE=1``,
  under which every fresh interpreter compiles agentd (and the SDK's uncached modules)
  from source; children instead get ``PYTHONPYCACHEPREFIX=bench/.peers/pycache``, which
  ``warm_bytecode`` fills once, so no file is written into the checkout or the venv.

Every process a benchmark starts is killed (by process group) in a ``finally`` block:
``Daemon.close`` freezes the daemon, kills its descendants' groups, then the daemon, then
anything that still holds a task of its spool.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from bench.report import Row
from supervisor.coordination import running_pid, supervisor_info
from supervisor.status import read_heartbeat
from supervisor.submit import submit
from worker.config import Config, load_config
from worker.lock import holder_pid, is_locked
from worker.protocol import HeartbeatData
from worker.spool import Spool, TaskDir
from worker.store.durable import read_json

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "bench" / ".peers"
PYCACHE = PEERS / "pycache"
SUPERVISORD_VENV = PEERS / "supervisord"
SUPERVISORD_PIN = "supervisor==4.3.0"  # never into agentd's venv: its package is `supervisor`
PEER = "supervisord 4.3.0"
QUICK_PEER = "peer not run in quick mode"
NO_PRELOAD_LAUNCHER = (
    "import asyncio, sys; from pathlib import Path; "
    "from supervisor import logging as L; from supervisor.daemon import Supervisor; "
    "from worker import credentials; from worker.config import load_config; "
    "from worker.spool import Spool; credentials.take_over(); "
    "L.configure('json'); c = Path(sys.argv[2]); "
    "sys.exit(asyncio.run(Supervisor(Spool(Path(sys.argv[1])), load_config(c), c, "
    "preload=False).run()))"
)
#: Modules every process of the benchmarks imports: compiled once into PYCACHE.
WARM_IMPORTS = (
    "anthropic, httpx2, psutil, structlog, watchfiles, tomli_w, supervisor.cli, "
    "supervisor.daemon, supervisor.logging, worker.__main__, worker.forkserver, "
    "worker.models.messages_api, worker.models.scripted, worker.tools.builtin"
)
IDLE_DELAY = 3600.0  # an idle worker's model call: the scripted model sleeps this long


def say(name: str, message: str) -> None:
    print(f"{name}: {message}", flush=True)


def bench_run(
    name: str, quick: bool, measure: Callable[[Path], list[Row]], detail: str = ""
) -> list[Row]:
    """``measure(workdir)`` in a temp folder removed afterwards, with bytecode warmed, and
    the machine's load printed before and after and added as a last row: the figures
    mean little without it (this machine may be shared)."""
    before, started = machine_load(), load_average()
    say(name, f"{'quick' if quick else 'full'} mode{detail}; before: {before}")
    warm_bytecode()
    workdir = Path(tempfile.mkdtemp(prefix=f"agentd-bench-{name}-")).resolve()
    try:
        rows = measure(workdir)
    finally:
        after = machine_load()
        say(name, f"after: {after}")
        shutil.rmtree(workdir, ignore_errors=True)
    load = Row(
        name,
        f"machine load average (1 min) at the end; {started:.1f} at the start",
        "",
        load_average(),
        compare=False,
        note=f"{name}: before: {before}; after: {after}.",
    )
    return [*rows, load]


@dataclass(frozen=True)
class PeerColumn:
    """The peer column of a benchmark's rows: supervisord's name when it ran, and a note
    that says how it ran or why it did not."""

    quick: bool
    ran: bool

    @property
    def name(self) -> str:
        return PEER if self.ran else ""

    def note(self, how: str) -> str:
        if self.quick:
            return QUICK_PEER
        if not self.ran:
            return "supervisord could not be installed"
        return f"{PEER}: {how}"


# -- environment ----------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every process the benchmarks start (see the module doc)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONDONTWRITEBYTECODE", "NOTIFY_SOCKET", "AGENTD_SPOOL", "AGENTD_CONFIG")
        and not k.startswith("ANTHROPIC_")
    }
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


_warmed: set[str] = set()


def warm_bytecode() -> None:
    """Compile what the benchmarks' processes import into PYCACHE (once per run)."""
    if _warmed:
        return
    PEERS.mkdir(parents=True, exist_ok=True)
    ignore = PEERS / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    for _ in range(2):  # the second run only checks that the cache is complete
        subprocess.run(
            [sys.executable, "-c", f"import {WARM_IMPORTS}"],
            env=child_env(),
            cwd=REPO,
            check=True,
            timeout=300,
            capture_output=True,
        )
    _warmed.add(sys.executable)


def load_average() -> float:
    """The 1-minute load average (NaN when it cannot be read)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return math.nan


def machine_load() -> str:
    mem = psutil.virtual_memory()
    text = (
        f"load average {load_average():.2f} on {os.cpu_count()} CPUs, "
        f"{mem.available / 2**30:.1f} of {mem.total / 2**30:.1f} GiB available"
    )
    with contextlib.suppress(OSError, ValueError, IndexError):
        for kind in ("cpu", "io"):
            some = Path(f"/proc/pressure/{kind}").read_text().splitlines()[0]
            text += f", {kind} pressure {float(some.split('avg10=')[1].split()[0]):.0f}%"
    return text


# -- statistics -----------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what or predicate}")
        time.sleep(interval)


# -- processes ------------------------------------------------------------------------


def kill_tree(root_pid: int | None, extra: Iterable[int] = ()) -> None:
    """SIGKILL ``root_pid``'s descendants by process group, then its own group, then
    ``extra`` pids. Frozen first (SIGSTOP) so that it starts nothing new meanwhile. Never
    signals this process's own group."""
    mine = os.getpgrp()
    victims: list[int] = []
    if root_pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(root_pid, signal.SIGSTOP)
        with contextlib.suppress(psutil.Error):
            victims = [p.pid for p in psutil.Process(root_pid).children(recursive=True)]
        victims.append(root_pid)
    victims.extend(extra)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != mine:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def end(proc: subprocess.Popen[bytes] | None) -> None:
    """Kill ``proc`` and everything under it (``kill_tree``), and reap it."""
    if proc is not None:
        kill_tree(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def spool_holders(spool: Spool) -> set[int]:
    """Live pids that hold (or last held) a task of ``spool``: lock holders and
    heartbeat writers. For clean-up after the daemon is gone."""
    found: set[int] = set()
    if not spool.tasks_dir.exists():
        return found
    for entry in os.scandir(spool.tasks_dir):
        task = spool.task(entry.name) if entry.is_dir() else None
        if task is None:
            continue
        pid = holder_pid(task.lock)
        if pid is not None and is_locked(task.lock):
            found.add(pid)
        with contextlib.suppress(OSError, ValueError):
            beat = read_json(task.heartbeat)
            if isinstance(beat, dict) and isinstance(beat.get("pid"), int):
                found.add(beat["pid"])
    return {p for p in found if p != os.getpid() and _holds(p, spool)}


def _holds(pid: int, spool: Spool) -> bool:
    """Whether ``pid`` still has a file of ``spool`` open (not a recycled pid)."""
    prefix = str(spool.root) + os.sep
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return any(f.path.startswith(prefix) for f in proc.open_files())
    return False


def cpu_seconds(proc: psutil.Process) -> float:
    """The CPU time ``proc``'s threads have run, in nanoseconds' resolution: the sum of
    each thread's ``/proc/PID/task/TID/schedstat`` (user + system time in ``/proc/PID/stat``
    counts clock ticks, 10 ms: a 30 s window could not tell 0.033% from 0.067%). A thread
    that ends within a window takes its time with it; an idle daemon starts none."""
    total = 0
    try:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        times = proc.cpu_times()
        return float(times.user + times.system)
    return total / 1e9


def sample_cpu(pid: int, seconds: float, *more: int) -> float:
    """Percent of one core ``pid`` and the processes ``more`` used (each itself, not its
    children) over ``seconds``, in one window."""
    procs = [psutil.Process(p) for p in (pid, *more)]
    c0, t0 = sum(map(cpu_seconds, procs)), time.monotonic()
    time.sleep(seconds)
    c1, t1 = sum(map(cpu_seconds, procs)), time.monotonic()
    return 100.0 * (c1 - c0) / (t1 - t0)


@dataclass
class Memory:
    rss: float  # MB
    uss: float
    pss: float


def memory_of(pid: int) -> Memory | None:
    with contextlib.suppress(psutil.Error):
        info = psutil.Process(pid).memory_full_info()
        return Memory(info.rss / 1e6, info.uss / 1e6, info.pss / 1e6)
    return None


def median_memory(found: Sequence[Memory]) -> Memory | None:
    if not found:
        return None
    return Memory(
        statistics.median(m.rss for m in found),
        statistics.median(m.uss for m in found),
        statistics.median(m.pss for m in found),
    )


def spawn(
    cmd: Sequence[str], cwd: Path, env: Mapping[str, str], out: Path
) -> subprocess.Popen[bytes]:
    """``cmd`` in a session of its own (so ``kill_tree`` reaches all it starts), its
    output appended to ``out``."""
    with open(out, "ab") as sink:
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def timed_run(cmd: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float = 60) -> float:
    """Seconds one command took, start to exit (it must succeed)."""
    return timed_call(cmd, env, cwd, timeout).wall


@dataclass(frozen=True)
class Timing:
    wall: float  # seconds, start to exit
    cpu: float  # seconds of user + system time the command's process(es) used


def timed_call(
    cmd: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float = 60, check: bool = True
) -> Timing:
    """Wall and CPU time of one command. On a busy machine the wall time is the CPU time
    stretched by the wait for a core; the CPU time is what it costs on an idle one."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    done = subprocess.run(
        list(cmd), env=dict(env), cwd=cwd, capture_output=True, timeout=timeout, check=False
    )
    took, r1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if check and done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {done.returncode}: {done.stderr[-500:]!r}")
    return Timing(took, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))


# -- tasks ----------------------------------------------------------------------------


def idle_script() -> dict[str, Any]:
    """A scripted task whose first model call lasts an hour: an idle worker."""
    return {"responses": [{"content": [{"type": "text", "text": "done"}], "delay": IDLE_DELAY}]}


def one_turn_script() -> dict[str, Any]:
    return {"responses": [{"content": [{"type": "text", "text": "done"}]}]}


def submit_scripted(
    spool: Spool, config: Config, script: dict[str, Any], name: str, scratch: Path
) -> TaskDir:
    path = scratch / "script.json"
    if not path.exists() or json.loads(path.read_text()) != script:
        path.write_text(json.dumps(script))
    return submit(spool, config, prompt="benchmark", name=name, script=path, tools=[])


def submit_api(spool: Spool, config: Config, name: str, max_turns: int = 1000) -> TaskDir:
    """A task on the anthropic backend (the worker builds a real SDK client)."""
    prompt = "List the workspace, again and again."
    return submit(spool, config, prompt=prompt, name=name, tools=["list_dir"], max_turns=max_turns)


def heartbeat(task: TaskDir) -> HeartbeatData | None:
    return read_heartbeat(task)


def idle_workers(spool: Spool, ids: Iterable[str]) -> dict[str, int]:
    """Task id -> worker pid for the tasks whose worker is in its model call."""
    found = {}
    for task_id in ids:
        beat = heartbeat(spool.task(task_id))
        if beat and beat.get("phase") == "model":
            found[task_id] = int(beat["pid"])
    return found


def all_idle(spool: Spool, ids: Iterable[str]) -> Callable[[], bool]:
    """A predicate: every one of the tasks ``ids`` has a worker in its model call."""
    wanted = list(ids)
    return lambda: len(idle_workers(spool, wanted)) == len(wanted)


def live_worker(task: TaskDir) -> int | None:
    """The pid of the process holding ``task``'s lock (its worker), or None."""
    pid = holder_pid(task.lock)
    if pid is None or not is_locked(task.lock) or holder_pid(task.lock) != pid:
        return None
    return pid


def worker_memory(found: Iterable[TaskDir]) -> list[Memory]:
    """The memory of each live worker of the tasks ``found``."""
    pids = [live_worker(task) for task in found]
    return [m for m in (memory_of(pid) for pid in pids if pid) if m]


# -- hosts: what runs the workers -----------------------------------------------------


class Host(Protocol):
    """``Daemon`` or ``Supervisord``: runs a worker for each task it is given."""

    spool: Spool
    config: Config
    idle: list[str]  # the idle tasks launched so far, in order

    @property
    def pid(self) -> int: ...

    def launch(self, found: Sequence[TaskDir]) -> None:
        """Start (or have started) a worker for each of these submitted tasks."""


def grow_idle(host: Host, upto: int, scratch: Path) -> float:
    """Submit and launch idle tasks until ``host`` has ``upto``, then wait until every
    one has its worker in its model call. Returns the seconds that took; TimeoutError
    when the workers are not all idle after two minutes plus a second per new one."""
    t0 = time.monotonic()
    script = idle_script()
    new = [
        submit_scripted(host.spool, host.config, script, f"idle{k:04d}", scratch)
        for k in range(len(host.idle), upto)
    ]
    host.launch(new)
    host.idle.extend(task.id for task in new)
    wait_until(all_idle(host.spool, host.idle), 120 + 1.0 * len(new), 0.5, f"{upto} idle workers")
    return time.monotonic() - t0


def launch_api(host: Host, server: ModelServer, n: int) -> list[TaskDir]:
    """``n`` anthropic-backend tasks launched on ``host``; returns once each has sent its
    first model request (and half a second more, for the worker to settle)."""
    found = [submit_api(host.spool, host.config, f"api{k:03d}") for k in range(n)]
    host.launch(found)
    wait_until(lambda: server.count() >= n, 120 + 5 * n, 0.1, f"{n} model requests")
    time.sleep(0.5)
    return found


# -- agentd ---------------------------------------------------------------------------


def config_text(
    *,
    max_workers: int,
    interval: float = 1.0,
    timeout: float = 5.0,
    model_call: float = 2 * IDLE_DELAY,
    backoff_initial: float = 1.0,
    stop_grace: float = 2.0,
) -> str:
    return (
        f"max_workers = {max_workers}\n"
        f"[heartbeat]\ninterval = {interval}\ntimeout = {timeout}\n"
        f"[deadlines]\nmodel_call = {model_call}\ntool_call = 60.0\n"
        f"[restart]\nbackoff_initial = {backoff_initial}\nstop_grace = {stop_grace}\n"
    )


class Daemon:
    """A real agentd daemon on a spool of its own under ``root``."""

    def __init__(
        self,
        root: Path,
        config: str,
        *,
        preload: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.spool = Spool(root / "spool").ensure()
        self.config_path = root / "agentd.toml"
        self.config_path.write_text(config)
        self.config = load_config(self.config_path)
        self.log_path = root / "daemon.log"
        self.preload = preload
        self.env = child_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.idle: list[str] = []
        self._log_offset = 0
        self._events: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0, *, warm: bool = True) -> float:
        """Start the daemon; return once it serves and (with preload and ``warm``) its fork
        server is ready. Returns the seconds from start to serving."""
        spool, conf = str(self.spool.root), str(self.config_path)
        if self.preload:
            cmd = [sys.executable, "-m", "supervisor", "--spool", spool, "--config", conf]
            cmd += ["--log-format", "json", "start"]
        else:
            cmd = [sys.executable, "-c", NO_PRELOAD_LAUNCHER, spool, conf]
        t0 = time.monotonic()
        self.proc = spawn(cmd, self.root, self.env, self.log_path)
        proc = self.proc

        def serving() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}: {self.tail()}")
            info = supervisor_info(self.spool) or {}
            return info.get("pid") == proc.pid and running_pid(self.spool) == proc.pid

        wait_until(serving, timeout, what="the daemon to serve")
        served = time.monotonic() - t0
        if self.preload and warm:
            wait_until(lambda: self.events("forkserver_ready"), timeout, 0.05, "the fork server")
        return served

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text()[-2000:]
        return ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The daemon's log events so far (read incrementally), or those named ``name``."""
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self._log_offset += end
            for line in chunk[:end].splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self._events.append(event)
        if name is None:
            return self._events
        return [e for e in self._events if e.get("event") == name]

    def launch(self, found: Sequence[TaskDir]) -> None:
        """Ring the doorbell for each submitted task, as ``agentd submit`` does (the running
        daemon looks at the tasks named, and starts them). Through the spool itself: this
        daemon serves a spool, whatever store the benchmark's own process was given."""
        for task in found:
            self.spool.ring(task.id)

    def forkserver_pid(self) -> int | None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children():
                if "worker.forkserver" in " ".join(child.cmdline()):
                    return child.pid
        return None

    def close(self) -> None:
        """Kill the daemon, its fork server and every worker; never raises."""
        try:
            end(self.proc)
            leftovers = spool_holders(self.spool)
            if leftovers:
                kill_tree(None, leftovers)
        except Exception as exc:  # clean-up must not hide the benchmark's own error
            print(f"bench: clean-up of {self.root}: {exc!r}", file=sys.stderr, flush=True)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- supervisord ----------------------------------------------------------------------


def supervisord_bin(install: bool) -> Path | None:
    """The bin folder of the supervisord venv; created (pip) when ``install``. None when it
    cannot be had (the caller reports the peer as not run)."""
    bin_dir = SUPERVISORD_VENV / "bin"
    if (bin_dir / "supervisord").exists():
        return bin_dir
    if not install:
        return None
    print(f"bench: installing {SUPERVISORD_PIN} into {SUPERVISORD_VENV} ...", flush=True)
    PEERS.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    try:
        subprocess.run(
            [base, "-m", "venv", str(SUPERVISORD_VENV)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", SUPERVISORD_PIN],
            check=True,
            capture_output=True,
            timeout=600,
            cwd=PEERS,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"bench: supervisord install failed: {exc}", flush=True)
        return None
    return bin_dir if (bin_dir / "supervisord").exists() else None


@dataclass
class Supervisord:
    """supervisord running ``python -m worker TASK_DIR`` programs, one per task, for the
    tasks of a spool of its own under ``root``."""

    root: Path
    bin_dir: Path
    env: dict[str, str] = field(default_factory=child_env)
    config: Config = field(default_factory=Config)
    proc: subprocess.Popen[bytes] | None = None
    idle: list[str] = field(default_factory=list)
    spool: Spool = field(init=False)

    def __post_init__(self) -> None:
        self.spool = Spool(self.root / "spool").ensure()

    @property
    def conf(self) -> Path:
        return self.root / "supervisord.conf"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def write_conf(self) -> None:
        (self.root / "programs").mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        sock = self.root / "s.sock"
        self.conf.write_text(
            f"[unix_http_server]\nfile={sock}\n\n"
            f"[supervisord]\nnodaemon=true\nlogfile={self.root}/supervisord.log\n"
            f"pidfile={self.root}/supervisord.pid\nchildlogdir={self.root}/logs\n"
            "minfds=8192\nminprocs=4096\nloglevel=info\n\n"
            "[rpcinterface:supervisor]\n"
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n\n"
            f"[supervisorctl]\nserverurl=unix://{sock}\n\n"
            f"[include]\nfiles={self.root}/programs/*.conf\n"
        )

    def launch(self, found: Sequence[TaskDir]) -> None:
        """A program for each task, running its worker, restarted whenever it exits; a
        running supervisord loads and starts them at once (``autostart``), else ``start``
        does."""
        if not self.conf.exists():
            self.write_conf()
        for task in found:
            (self.root / "programs" / f"{task.id}.conf").write_text(
                f"[program:{task.id}]\ncommand={sys.executable} -m worker {task.path}\n"
                f"directory={self.root}\nautostart=true\nautorestart=true\nstartsecs=1\n"
                "stopasgroup=true\nkillasgroup=true\nredirect_stderr=true\n"
                f"stdout_logfile={self.root}/logs/{task.id}.log\n"
                "stdout_logfile_maxbytes=1MB\nstdout_logfile_backups=0\n"
            )
        if found and self.proc is not None:
            self.ctl("reread")
            self.ctl("update")

    def start(self, timeout: float = 60.0) -> None:
        if not self.conf.exists():
            self.write_conf()
        cmd = [str(self.bin_dir / "supervisord"), "-c", str(self.conf)]
        self.proc = spawn(cmd, self.root, self.env, self.root / "supervisord.out")
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"supervisord exited with {proc.returncode}")
            return self.ctl("pid").returncode == 0

        wait_until(up, timeout, 0.1, "supervisord to answer")

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(self.bin_dir / "supervisorctl"), "-c", str(self.conf), *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def close(self) -> None:
        try:
            end(self.proc)
        except Exception as exc:
            print(f"bench: clean-up of supervisord: {exc!r}", file=sys.stderr, flush=True)

    def __enter__(self) -> Supervisord:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the local Messages API -----------------------------------------------------------


class ModelServer:
    """The local Messages API with a responder by turn, stamping each request's arrival."""

    def __init__(self, reply_for_turn: Callable[[int], Any]) -> None:
        from worker.testing.messages_api import MessagesAPIServer

        self.arrivals: list[tuple[float, int]] = []  # (monotonic, turn), in order
        self._cond = threading.Condition()
        self._reply_for_turn = reply_for_turn
        self.srv = MessagesAPIServer(responder=self._respond)

    def _respond(self, request: dict[str, Any]) -> Any:
        now = time.monotonic()
        messages = request.get("messages") or []
        turn = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        with self._cond:
            self.arrivals.append((now, turn))
            self._cond.notify_all()
        return self._reply_for_turn(turn)

    @property
    def env(self) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": self.srv.base_url,
            "ANTHROPIC_API_KEY": self.srv.api_key or "",
        }

    def count(self) -> int:
        with self._cond:
            return len(self.arrivals)

    def wait_arrival(
        self, accept: Callable[[float, int], bool], start: int, timeout: float
    ) -> tuple[int, float, int]:
        """The first arrival at index >= ``start`` that ``accept`` takes: (index, at, turn)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.arrivals):
                    at, turn = self.arrivals[i]
                    if accept(at, turn):
                        return i, at, turn
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no model request after {timeout:g} s")
                self._cond.wait(left)

    def __enter__(self) -> ModelServer:
        self.srv.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.srv.close()
