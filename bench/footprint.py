"""Footprint benchmark: what a worker costs in memory, and what the daemon costs in CPU
and memory while it watches idle workers, against supervisord.

* **Memory per worker** (anthropic backend loaded): ``WORKERS`` real anthropic-backend
  tasks against the local Messages API, whose every reply hangs, so each worker has built
  its SDK client and waits in its first model call. USS (pages only this process has)
  and PSS (its share of everything it maps) from ``psutil.memory_full_info()`` of each
  worker, median. Floor: a plain ``python -c "import anthropic"`` process. Peer (full
  mode): supervisord running the same tasks as ``python -m worker TASK_DIR`` programs
  (a fresh interpreter each, as every supervisor without a fork server starts them).
* **Daemon CPU and RSS with N idle workers**: scripted tasks whose model call sleeps for
  an hour (the worker is alive and heartbeats every ``heartbeat.interval``; its hang is its
  dead-man's to end, and the daemon reads its beat when a deadline could pass). CPU is the
  daemon's and its fork server's own user + system time over one window (not the
  workers'), as percent of one core; RSS is the daemon's alone. Peer (full mode):
  supervisord with 100 idle programs running the same idle workers; the target is the
  peer's CPU at 100 workers, in the same run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import Row
from bench.supervision import (
    PEER,
    Daemon,
    Host,
    Memory,
    ModelServer,
    PeerColumn,
    Supervisord,
    bench_run,
    child_env,
    config_text,
    grow_idle,
    kill_tree,
    launch_api,
    median_memory,
    memory_of,
    sample_cpu,
    say,
    supervisord_bin,
    worker_memory,
)

NAME = "footprint"
TARGET_USS_MB = 25.0
TARGET_LEVEL = 100  # idle workers, where the daemon's CPU and RSS meet supervisord's


@dataclass(frozen=True)
class Plan:
    workers: int  # anthropic-backend workers measured for memory
    levels: tuple[int, ...]  # idle workers for the daemon's CPU and RSS
    window: float  # seconds of CPU sampling per level
    peer_levels: tuple[int, ...]
    install: bool


FULL = Plan(workers=10, levels=(10, 100, 200), window=30.0, peer_levels=(100,), install=True)
QUICK = Plan(workers=3, levels=(10,), window=3.0, peer_levels=(), install=False)


def hang_reply(turn: int) -> Any:
    from worker.testing.messages_api import Fault

    return Fault.hang(seconds=900.0)


# -- memory per worker ----------------------------------------------------------------


def agentd_worker_memory(workdir: Path, n: int) -> tuple[Memory | None, Memory | None]:
    """(median of the workers, the fork server) with ``n`` anthropic workers waiting."""
    with (
        ModelServer(hang_reply) as server,
        Daemon(workdir, config_text(max_workers=max(8, n)), env=server.env) as daemon,
    ):
        daemon.start()
        found = worker_memory(launch_api(daemon, server, n))
        fs = daemon.forkserver_pid()
        return median_memory(found), memory_of(fs) if fs else None


def peer_worker_memory(workdir: Path, n: int, bin_dir: Path) -> Memory | None:
    with (
        ModelServer(hang_reply) as server,
        Supervisord(workdir, bin_dir, env=child_env(server.env)) as peer,
    ):
        peer.start()
        return median_memory(worker_memory(launch_api(peer, server, n)))


def plain_sdk_memory(workdir: Path) -> Memory | None:
    """A plain ``python -c "import anthropic"`` process, kept alive to be measured."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import anthropic, sys; print(1, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        cwd=workdir,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        time.sleep(0.2)
        return memory_of(proc.pid)
    finally:
        kill_tree(None, [proc.pid])
        proc.wait(timeout=10)


# -- the supervisor with idle workers -------------------------------------------------


@dataclass
class Level:
    workers: int
    cpu: float  # percent of one core
    rss: float  # MB
    uss: float
    ramp: float  # seconds until every new worker was idle


def idle_levels(
    label: str, host: Host, levels: tuple[int, ...], window: float, *more: int
) -> list[Level]:
    """The supervisor process's CPU (with the processes ``more``) and memory at each
    number of idle workers."""
    out: list[Level] = []
    scratch = host.spool.root.parent
    for level in levels:
        ramp = grow_idle(host, level, scratch)
        time.sleep(2.0)  # let the ramp's work settle
        cpu = sample_cpu(host.pid, window, *more)
        mem = memory_of(host.pid)
        assert mem is not None
        out.append(Level(level, cpu, mem.rss, mem.uss, ramp))
        say(
            NAME,
            f"{label}, {level} idle workers: CPU {cpu:.3f}% of a core, RSS "
            f"{mem.rss:.1f} MB, USS {mem.uss:.1f} MB (ramp {ramp:.1f} s)",
        )
    return out


def agentd_levels(workdir: Path, plan: Plan) -> list[Level]:
    with Daemon(workdir, config_text(max_workers=max(plan.levels) + 8)) as daemon:
        daemon.start()
        fork_server = daemon.forkserver_pid()
        label = "agentd daemon" + (" and fork server" if fork_server else "")
        more = (fork_server,) if fork_server else ()
        return idle_levels(label, daemon, plan.levels, plan.window, *more)


def peer_levels(workdir: Path, plan: Plan, bin_dir: Path) -> list[Level]:
    with Supervisord(workdir, bin_dir) as peer:
        peer.start()
        return idle_levels(PEER, peer, plan.peer_levels, plan.window)


# -- the run --------------------------------------------------------------------------


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir, quick))


def measure(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    bin_dir = None if quick else supervisord_bin(plan.install)
    if not quick and bin_dir is None:
        say(NAME, "supervisord is not installed: peer left out")

    worker, forkserver = agentd_worker_memory(workdir / "memory-agentd", plan.workers)
    plain = plain_sdk_memory(workdir)
    peer_worker = None
    if bin_dir:
        peer_worker = peer_worker_memory(workdir / "memory-peer", plan.workers, bin_dir)
    levels = agentd_levels(workdir / "levels", plan)
    peers = peer_levels(workdir / "levels-peer", plan, bin_dir) if bin_dir else []

    column = PeerColumn(quick, ran=bin_dir is not None)
    rows: list[Row] = []

    def mem_row(label: str, key: str, **kw: Any) -> None:
        value = getattr(worker, key) if worker else None
        rows.append(
            Row(
                NAME,
                f"memory per worker, {label} (anthropic backend loaded)",
                "MB",
                value,
                floor=getattr(plain, key) if plain else None,
                peer=getattr(peer_worker, key) if peer_worker else None,
                peer_name=column.name,
                **kw,
            )
        )

    mem_row(
        "USS",
        "uss",
        target=f"< {TARGET_USS_MB:g} MB",
        met=None if worker is None else worker.uss < TARGET_USS_MB,
        note=f"Median of {plan.workers} workers, each waiting in its first model call with "
        "its SDK client built. Floor: a plain `python -c 'import anthropic'` process. "
        + column.note("`python -m worker TASK` programs (fresh interpreters)."),
    )
    mem_row("PSS", "pss")
    mem_row("RSS", "rss")
    if forkserver:
        rows.append(
            Row(
                NAME,
                "fork server (one per daemon), RSS / USS",
                "MB",
                forkserver.rss,
                compare=False,
                note=f"The warm process workers fork from: RSS {forkserver.rss:.1f} MB, "
                f"USS {forkserver.uss:.1f} MB, PSS {forkserver.pss:.1f} MB, paid once.",
            )
        )
    by_level = {p.workers: p for p in peers}
    for i, level in enumerate(levels):
        peer = by_level.get(level.workers)
        at_target = level.workers == TARGET_LEVEL
        rows.append(
            Row(
                NAME,
                f"daemon CPU, {level.workers} idle workers",
                "%",
                level.cpu,
                peer=peer.cpu if peer else None,
                peer_name=column.name,
                target=f"<= {PEER.split()[0]}'s" if at_target else "",
                met=level.cpu <= peer.cpu if at_target and peer is not None else None,
                note=(
                    f"Percent of one core, the daemon's and its fork server's own user + "
                    f"system time over {plan.window:g} s; heartbeat interval 1 s, timeout 5 s "
                    "(each worker's dead-man), deadlines 60 s and up. Idle workers: scripted "
                    "tasks whose model call sleeps. " + column.note("the same workers as programs.")
                )
                if i == 0
                else "",
            )
        )
    for level in levels:
        peer = by_level.get(level.workers)
        at_target = level.workers == TARGET_LEVEL
        met = None
        if at_target and peer is not None:
            met = level.rss <= peer.rss
        rows.append(
            Row(
                NAME,
                f"daemon RSS, {level.workers} idle workers",
                "MB",
                level.rss,
                peer=peer.rss if peer else None,
                peer_name=column.name,
                target=f"<= {PEER.split()[0]}'s" if at_target else "",
                met=met,
            )
        )
    return rows
