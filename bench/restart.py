"""Restart benchmark: how long a task on the anthropic backend is out of the loop after its
worker is killed (``kill -9``) or hangs (``SIGSTOP``), against supervisord restarting the
same worker.

The task runs on the real ``anthropic`` SDK against the local Messages API
(``worker/testing/messages_api.py``, in this process). Every model reply is a ``list_dir`` tool
call sent after ``REPLY_DELAY`` seconds, so the worker keeps going turn after turn. A
trial waits until the worker has made progress since it started (a turn recorded, and
the next model request has arrived) and then kills it while it waits on the model; the
time runs from the ``kill`` to the arrival of the replacement's first model request,
the moment the task is back in the loop. Killing only after progress is the case the
restart policy restarts at once; a worker that crashes again before any progress is
backed off on purpose (``supervisor/policy.py``).

* **agentd**: ``agentd start`` (fork server on), and the same ``Supervisor`` with
  ``preload=False`` (every restart a fresh interpreter that imports the SDK).
* **supervisord** (full mode): a program ``python -m worker TASK_DIR`` with
  ``autorestart=true`` (default ``startsecs=1``), killed the same way.
* **first restart**: the same kill, of the first worker of a daemon started a moment
  before with the task already submitted, so the kill lands in the first seconds after
  ``agentd start``; a fresh daemon (and model server) per kill. A first start of a task
  on the SDK waits for the warming fork server (a fresh interpreter would import the same
  SDK), so the first worker is forked, and the kill finds the server ready.
* **the parts** of a kill's restart, each a median: kill -> the supervisor logs the exit,
  -> it logs the replacement spawned, -> the replacement's first model request (for agentd
  and, in full mode, supervisord, from their own logs).
* **hang**: ``SIGSTOP`` of the worker, to the replacement's first model request; the
  daemon must see the silent heartbeat and restart within ``heartbeat.timeout`` + 1 s.
  supervisord has no heartbeat: a stopped worker stays stopped (not measured).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.report import Row, percentile
from bench.supervision import (
    PEER,
    Daemon,
    ModelServer,
    PeerColumn,
    Supervisord,
    bench_run,
    child_env,
    config_text,
    live_worker,
    load_average,
    median,
    say,
    submit_api,
    supervisord_bin,
    timed_run,
)
from worker.spool import TaskDir

NAME = "restart"
REPLY_DELAY = 0.5  # seconds the model takes: the window a kill lands in
TARGET_P50_MS = 100.0
HANG_SLACK = 1.0  # seconds past heartbeat.timeout


@dataclass(frozen=True)
class Plan:
    kills: int  # agentd, fork server on
    fresh_kills: int  # agentd, fork server off
    peer_kills: int  # supervisord
    hangs: int
    first: int  # agentd, a kill in the first seconds after start (a daemon each)
    interval: float
    timeout: float
    install: bool  # install supervisord if missing


FULL = Plan(
    kills=50,
    fresh_kills=50,
    peer_kills=50,
    hangs=5,
    first=10,
    interval=1.0,
    timeout=5.0,
    install=True,
)
QUICK = Plan(
    kills=5,
    fresh_kills=1,
    peer_kills=0,
    hangs=1,
    first=3,
    interval=1.0,
    timeout=3.0,
    install=False,
)


@dataclass
class Trial:
    took: float  # seconds from the signal to the replacement's first model request
    signalled_wall: float  # time.time() at the signal
    pid: int = 0  # the process signalled


@dataclass(frozen=True)
class Parts:
    """One restart in three parts, in seconds: from the kill to the supervisor seeing the
    exit, from there to the replacement spawned (the supervisor's own log says when, for
    both), and from there to the replacement's first model request (the worker's
    start-up)."""

    seen: float
    spawned: float
    resumed: float


PART_NAMES = ("kill -> exit seen", "exit seen -> spawned", "spawned -> first request")


def part_medians(found: list[Parts]) -> tuple[float, float, float] | None:
    """The median of each part, in ms (the medians need not add up to the total's)."""
    if not found:
        return None
    return (
        1000 * statistics.median(p.seen for p in found),
        1000 * statistics.median(p.spawned for p in found),
        1000 * statistics.median(p.resumed for p in found),
    )


def say_parts(label: str, found: list[Parts]) -> None:
    medians = part_medians(found)
    if medians is None:
        say(NAME, f"{label}: no breakdown (the supervisor's log named no exit or spawn)")
        return
    parts = ", ".join(f"{name} {ms:.1f} ms" for name, ms in zip(PART_NAMES, medians, strict=True))
    say(NAME, f"{label}: {parts} (medians of {len(found)})")


def reply_for_turn(turn: int) -> Any:
    from worker.testing.messages_api import Reply

    if turn >= 900:
        return Reply.text("That is enough listing.")
    return Reply.tool_use("list_dir", {"path": "."}, delay=REPLY_DELAY)


def any_arrival(at: float, turn: int) -> bool:
    return True


def turn_above(base: int) -> Callable[[float, int], bool]:
    return lambda at, turn: turn > base


def arrived_after(t0: float) -> Callable[[float, int], bool]:
    return lambda at, turn: at > t0


def trials(
    server: ModelServer,
    task: TaskDir,
    count: int,
    sig: int,
    *,
    patience: float,
    progress: Callable[[int, Trial], None] | None = None,
) -> list[Trial]:
    """``count`` times: wait for the task's worker to make progress and send its next model
    request, signal it, and time until the next model request arrives (the replacement's)."""
    # Start from the latest request: the next one of a higher turn comes after progress.
    index, _, base = server.wait_arrival(any_arrival, max(0, server.count() - 1), patience)
    out: list[Trial] = []
    for n in range(count):
        index, _, turn = server.wait_arrival(turn_above(base), index + 1, patience)
        pid = live_worker(task)
        if pid is None:  # between a lock holder's exit and the next: take the next request
            base = turn - 1
            continue
        wall, t0 = time.time(), time.monotonic()
        os.kill(pid, sig)
        index, at, base = server.wait_arrival(arrived_after(t0), index + 1, patience)
        trial = Trial(at - t0, wall, pid)
        out.append(trial)
        if progress is not None:
            progress(n, trial)
    return out


def breakdown(exited: list[float], spawned: list[float], found: list[Trial]) -> list[Parts]:
    """Per trial, its parts: the first exit the supervisor logged after the signal, the
    first spawn it logged after that (wall clock times, sorted)."""
    out = []
    for trial in found:
        seen = next((t for t in exited if t >= trial.signalled_wall), None)
        if seen is None:
            continue
        spawn = next((t for t in spawned if t >= seen), None)
        resumed = trial.signalled_wall + trial.took
        if spawn is None or spawn > resumed:
            continue
        out.append(Parts(seen - trial.signalled_wall, spawn - seen, resumed - spawn))
    return out


def daemon_parts(daemon: Daemon, found: list[Trial]) -> list[Parts]:
    """The parts of each trial, from the daemon's ``worker_exited`` of the pid killed and
    its next ``worker_spawned``."""
    killed = {t.pid for t in found}
    exited = sorted(
        _wall(e["timestamp"]) for e in daemon.events("worker_exited") if e.get("pid") in killed
    )
    spawned = sorted(_wall(e["timestamp"]) for e in daemon.events("worker_spawned"))
    return breakdown(exited, spawned, found)


def supervisord_parts(log: Path, found: list[Trial]) -> list[Parts]:
    """The parts of each trial, from supervisord's log (``exited:`` lines, at WARN for an
    unexpected exit, and ``spawned:`` lines, stamped in local time to the millisecond)."""
    exited: list[float] = []
    spawned: list[float] = []
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            day, clock, _level, rest = [*line.split(" ", 3), "", "", ""][:4]  # INFO, WARN
            try:
                at = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            if rest.startswith("exited: "):
                exited.append(at)
            elif rest.startswith("spawned: "):
                spawned.append(at)
    return breakdown(sorted(exited), sorted(spawned), found)


def _wall(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run_agentd(
    workdir: Path, plan: Plan, *, preload: bool, server: ModelServer
) -> tuple[list[Trial], list[Trial], list[Parts]]:
    """(kill trials, hang trials, the kills' parts) on one agentd daemon."""
    kills = plan.kills if preload else plan.fresh_kills
    hangs = plan.hangs if preload else 0
    label = "fork server on" if preload else "fork server off"
    config = config_text(max_workers=8, interval=plan.interval, timeout=plan.timeout)
    with Daemon(workdir, config, preload=preload, env=server.env) as daemon:
        served = daemon.start()
        say(NAME, f"agentd ({label}): serving after {served:.2f} s")
        task = submit_api(daemon.spool, daemon.config, "restart")
        daemon.launch([task])
        patience = 60.0 if preload else 120.0
        killed = trials(server, task, kills, signal.SIGKILL, patience=patience)
        say(NAME, f"agentd ({label}): {len(killed)} kills, p50 {_ms(killed)}")
        parts = daemon_parts(daemon, killed)
        hung = trials(
            server,
            task,
            hangs,
            signal.SIGSTOP,
            patience=plan.timeout + 60,
            progress=lambda n, t: say(NAME, f"agentd: hang {n + 1}: {t.took:.2f} s"),
        )
        if hung:
            events = daemon.events("worker_hung")
            say(NAME, f"agentd: {len(events)} worker_hung events for {len(hung)} SIGSTOPs")
        rejected = len(server.srv.rejected)
        if rejected:
            say(NAME, f"agentd ({label}): the API server rejected {rejected} requests")
    return killed, hung, parts


def run_first_restarts(workdir: Path, plan: Plan) -> tuple[list[Trial], int]:
    """(kill trials, how many of the kills came before the fork server was ready): each on
    a new daemon whose first scan starts the task; its first worker is killed as soon as
    the daemon names it, the crash of a worker in the first seconds after start. (Before
    any progress, so restart.backoff_initial is short here: the figure is the restart's
    own time, not the backoff.)"""
    found: list[Trial] = []
    early = 0
    config = config_text(
        max_workers=8, interval=plan.interval, timeout=plan.timeout, backoff_initial=0.01
    )
    for n in range(plan.first):
        with (
            ModelServer(reply_for_turn) as server,
            Daemon(workdir / f"first{n}", config, preload=True, env=server.env) as daemon,
        ):
            submit_api(daemon.spool, daemon.config, "first")
            daemon.start(warm=False)
            deadline = time.monotonic() + 60.0
            while not (spawned := daemon.events("worker_spawned")):
                if time.monotonic() > deadline:
                    raise TimeoutError("no worker was started")
                time.sleep(0.005)
            wall, t0 = time.time(), time.monotonic()
            os.kill(spawned[0]["pid"], signal.SIGKILL)
            _, at, _ = server.wait_arrival(arrived_after(t0), 0, 60.0)
            found.append(Trial(at - t0, wall, spawned[0]["pid"]))
            ready = [_wall(e["timestamp"]) for e in daemon.events("forkserver_ready")]
            early += not ready or ready[0] > wall
    say(NAME, f"agentd first restarts: {len(found)} kills ({early} before the fork server was "
        f"ready), p50 {_ms(found)}")  # fmt: skip
    return found, early


def run_supervisord(
    workdir: Path, plan: Plan, server: ModelServer
) -> tuple[list[Trial], list[Parts]] | None:
    """(kill trials, their parts) under supervisord; None when it is not installed."""
    bin_dir = supervisord_bin(plan.install)
    if bin_dir is None:
        say(NAME, "supervisord is not installed: peer left out")
        return None
    with Supervisord(workdir, bin_dir, env=child_env(server.env)) as peer:
        task = submit_api(peer.spool, peer.config, "restart")
        peer.launch([task])
        peer.start()
        killed = trials(server, task, plan.peer_kills, signal.SIGKILL, patience=120.0)
        parts = supervisord_parts(peer.root / "supervisord.log", killed)
    say(NAME, f"{PEER}: {len(killed)} kills, p50 {_ms(killed)}")
    return killed, parts


def _ms(found: list[Trial]) -> str:
    values = [t.took for t in found]
    return f"{1000 * statistics.median(values):.0f} ms" if values else "-"


def sdk_import_seconds(workdir: Path, repeats: int) -> float:
    env = child_env()
    cmd = [sys.executable, "-c", "import anthropic"]
    return statistics.median(timed_run(cmd, env, workdir) for _ in range(repeats))


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir, quick))


def measure(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    loads: list[str] = []  # the load average after each part: the parts are minutes apart
    with ModelServer(reply_for_turn) as server:
        killed, hung, parts = run_agentd(workdir / "agentd", plan, preload=True, server=server)
    loads.append(f"fork server on {load_average():.1f}")
    with ModelServer(reply_for_turn) as server:
        fresh, _, fresh_parts = run_agentd(
            workdir / "agentd-fresh", plan, preload=False, server=server
        )
    loads.append(f"fork server off {load_average():.1f}")
    first, early = run_first_restarts(workdir / "agentd-first", plan)
    loads.append(f"first restart {load_average():.1f}")
    peer: list[Trial] | None = None
    peer_parts: list[Parts] = []
    if not quick:
        with ModelServer(reply_for_turn) as server:
            ran = run_supervisord(workdir / "supervisord", plan, server)
        if ran is not None:
            peer, peer_parts = ran
        loads.append(f"{PEER} {load_average():.1f}")
    repeats = 1 if quick else 3
    sdk = sdk_import_seconds(workdir, repeats)
    loads.append(f"SDK import {load_average():.1f}")
    say(NAME, f"python -c 'import anthropic': {sdk:.2f} s (median of {repeats})")
    say_parts("agentd (fork server on)", parts)
    say_parts("agentd (fork server off)", fresh_parts)
    if peer is not None:
        say_parts(PEER, peer_parts)

    def ms(found: list[Trial] | None, q: float) -> float | None:
        if not found:
            return None
        return 1000 * percentile([t.took for t in found], q)

    column = PeerColumn(quick, ran=bool(peer))
    rows: list[Row] = []
    p50 = ms(killed, 0.5)
    rows.append(
        Row(
            NAME,
            f"crash-to-resumed p50, kill -9, fork server ({len(killed)} kills)",
            "ms",
            p50,
            peer=ms(peer, 0.5),
            peer_name=column.name,
            target=f"< {TARGET_P50_MS:g} ms",
            met=None if p50 is None else p50 < TARGET_P50_MS,
            note=(
                "From SIGKILL of a worker waiting on the model (after progress) to the "
                "replacement's first model request arriving at the local Messages API; "
                "anthropic backend, real SDK client. "
                + column.note("program `python -m worker TASK` autorestart=true.")
                + f" Load average after each part: {', '.join(loads)}."
            ),
        )
    )
    rows.append(
        Row(
            NAME,
            "crash-to-resumed p99, kill -9, fork server",
            "ms",
            ms(killed, 0.99),
            peer=ms(peer, 0.99),
            peer_name=column.name,
        )
    )
    ours, theirs = part_medians(parts), part_medians(peer_parts)
    for i, name in enumerate(PART_NAMES):
        rows.append(
            Row(
                NAME,
                f"  {name} p50, kill -9, fork server",
                "ms",
                ours[i] if ours else None,
                peer=theirs[i] if theirs else None,
                peer_name=column.name,
                note=""
                if i
                else "The restart in parts, the median of each: to the supervisor's log of "
                "the exit (agentd: `worker_exited`; supervisord: `exited:`), to its log of "
                "the replacement spawned (`worker_spawned`; `spawned:`), and to the "
                "replacement's first model request. The medians need not add up to the "
                "total's.",
            )
        )
    rows.append(
        Row(
            NAME,
            f"crash-to-resumed p50, fork server off ({len(fresh)} kills)",
            "ms",
            ms(fresh, 0.5),
            peer=ms(peer, 0.5),
            peer_name=column.name,
            note="The same daemon with Supervisor(preload=False): each replacement is a "
            "fresh interpreter that imports the SDK before its first request.",
        )
    )
    rows.append(
        Row(
            NAME,
            "crash-to-resumed p99, fork server off",
            "ms",
            ms(fresh, 0.99),
            peer=ms(peer, 0.99),
            peer_name=column.name,
        )
    )
    rows.append(
        Row(
            NAME,
            f"first restart after start p50 ({len(first)} kills, {early} before the fork "
            "server was ready)",
            "ms",
            ms(first, 0.5),
            compare=False,
            note="SIGKILL of the first worker of a daemon started a moment before (the task "
            "submitted first) as soon as the daemon names it, to the replacement's first "
            "model request, in the first seconds after start (the first start waited for the "
            "fork server; restart.backoff_initial 0.01 s: the kill came before any progress).",
        )
    )
    sdk_figure = "python -c 'import anthropic' (the SDK import alone)"
    rows.append(Row(NAME, sdk_figure, "ms", 1000 * sdk, compare=False))
    if hung:
        limit = plan.timeout + HANG_SLACK
        worst = max(t.took for t in hung)
        rows.append(
            Row(
                NAME,
                f"hang: SIGSTOP -> resumed, median ({len(hung)} hangs)",
                "s",
                median([t.took for t in hung]),
                floor=plan.timeout,
                compare=False,
                note=f"heartbeat interval {plan.interval:g} s, timeout {plan.timeout:g} s "
                "(the floor column): each beat arms the worker's dead-man the timeout ahead, so "
                "a worker stopped just after a beat dies of it up to one interval sooner than "
                "the timeout after the stop. "
                "supervisord has no liveness check: a stopped worker stays stopped.",
            )
        )
        rows.append(
            Row(
                NAME,
                "hang: SIGSTOP -> resumed, worst",
                "s",
                worst,
                floor=plan.timeout,
                target=f"<= timeout + {HANG_SLACK:g} s",
                met=worst <= limit,
                compare=False,
            )
        )
    return rows
