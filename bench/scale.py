"""Scale benchmark: how many concurrent workers this machine holds with the daemon still
responsive, against supervisord.

Idle workers are added level by level (scripted tasks whose model call sleeps for an hour:
alive, heartbeating, watched by the daemon). At each level, once every new worker is in
its model call: the latency of ``agentd status --json`` (a fresh CLI process, start to
exit, median of a few calls), the memory in use (PSS of the daemon, its fork server and
every worker, summed: shared pages are counted once), and the daemon's CPU. The largest
level at which status answers in under ``TARGET_MS`` is the figure. A level is not tried
when the memory it would take (at the per-worker PSS of the level before) would leave less
than ``RESERVE_GB`` of the machine available.

Peer (full mode): supervisord with the same idle workers as programs (``python -m worker
TASK_DIR``, a fresh interpreter each), ``supervisorctl status`` timed the same way.
Floor: a bare ``python -c pass`` (the least any CLI command costs).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.report import Row
from bench.supervision import (
    PEER,
    Daemon,
    Host,
    PeerColumn,
    Supervisord,
    Timing,
    bench_run,
    child_env,
    config_text,
    grow_idle,
    sample_cpu,
    say,
    supervisord_bin,
    timed_call,
    timed_run,
)

NAME = "scale"
TARGET_MS = 200.0
TARGET_WORKERS = 500
RESERVE_GB = 3.0
FIRST_GUESS_MB = 40.0  # per-worker PSS assumed before the first level is measured


@dataclass(frozen=True)
class Plan:
    levels: tuple[int, ...]
    peer_levels: tuple[int, ...]  # supervisord's fresh interpreters take minutes to start
    calls: int  # status calls per level
    cpu_window: float
    install: bool


FULL = Plan(
    levels=(100, 250, 500, 700), peer_levels=(100, 250, 500), calls=5, cpu_window=10.0, install=True
)
QUICK = Plan(levels=(20,), peer_levels=(), calls=3, cpu_window=3.0, install=False)


@dataclass
class Level:
    workers: int
    status_ms: float  # median, wall
    status_cpu_ms: float  # median, user + system time of the status process
    pss_gb: float  # the supervisor's processes, summed
    used_gb: float  # the machine: total - available
    cpu: float  # the supervisor process, percent of one core
    ramp: float  # seconds until every new worker was idle


def tree_pss_gb(pid: int) -> float:
    """PSS of ``pid`` and all its descendants, in GB."""
    total = 0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().pss
    return total / 1e9


def used_gb() -> float:
    mem = psutil.virtual_memory()
    return (mem.total - mem.available) / 1e9


def room_for(more: int, per_worker_gb: float) -> bool:
    available = psutil.virtual_memory().available / 1e9
    return available - more * per_worker_gb >= RESERVE_GB


def ramp(
    label: str, plan: Plan, levels: tuple[int, ...], host: Host, status: Callable[[], Timing]
) -> list[Level]:
    """Grow ``host`` level by level to ``levels`` idle workers; at each, time ``status()``
    (one status call), sum the memory, sample the supervisor's CPU."""
    out: list[Level] = []
    per_worker = FIRST_GUESS_MB / 1e3
    for level in levels:
        if not room_for(level - len(host.idle), per_worker):
            say(NAME, f"{label}: {level} workers would leave < {RESERVE_GB:g} GB available: stop")
            break
        try:
            took = grow_idle(host, level, host.spool.root.parent)
        except (TimeoutError, subprocess.TimeoutExpired) as exc:  # supervisorctl may time out
            say(NAME, f"{label}: {exc}: stop")
            break
        time.sleep(2.0)
        calls = [status() for _ in range(plan.calls)]
        pss = tree_pss_gb(host.pid)
        per_worker = max(per_worker, pss / level)
        level_row = Level(
            level,
            1000 * statistics.median(c.wall for c in calls),
            1000 * statistics.median(c.cpu for c in calls),
            pss,
            used_gb(),
            sample_cpu(host.pid, plan.cpu_window),
            took,
        )
        out.append(level_row)
        say(
            NAME,
            f"{label}, {level} idle workers: status p50 {level_row.status_ms:.0f} ms "
            f"(calls {', '.join(f'{1000 * c.wall:.0f}' for c in calls)}; CPU p50 "
            f"{level_row.status_cpu_ms:.0f} ms), PSS {pss:.2f} GB, "
            f"machine {level_row.used_gb:.1f} GB used, CPU {level_row.cpu:.2f}%, "
            f"ramp {took:.1f} s",
        )
    return out


def agentd_scale(workdir: Path, plan: Plan) -> list[Level]:
    with Daemon(workdir, config_text(max_workers=max(plan.levels) + 8)) as daemon:
        daemon.start()
        spool = str(daemon.spool.root)
        status_cmd = [sys.executable, "-m", "supervisor", "--spool", spool, "status", "--json"]
        return ramp(
            "agentd", plan, plan.levels, daemon, lambda: timed_call(status_cmd, daemon.env, workdir)
        )


def peer_scale(workdir: Path, plan: Plan, bin_dir: Path) -> list[Level]:
    with Supervisord(workdir, bin_dir) as peer:
        peer.start()

        ctl = [str(bin_dir / "supervisorctl"), "-c", str(peer.conf), "status"]

        def status() -> Timing:
            # exits non-zero when a program is not RUNNING: timed anyway
            return timed_call(ctl, peer.env, workdir, check=False)

        return ramp(PEER, plan, plan.peer_levels, peer, status)


def holds(levels: list[Level]) -> int:
    """The largest level reached with status under the target at it and every level below."""
    best = 0
    for level in levels:
        if level.status_ms >= TARGET_MS:
            break
        best = level.workers
    return best


def run(quick: bool) -> list[Row]:
    return bench_run(NAME, quick, lambda workdir: measure(QUICK if quick else FULL, workdir, quick))


def measure(plan: Plan, workdir: Path, quick: bool) -> list[Row]:
    floor = 1000 * statistics.median(
        timed_run([sys.executable, "-c", "pass"], child_env(), workdir) for _ in range(5)
    )
    say(NAME, f"floor: python -c pass {floor:.0f} ms")
    levels = agentd_scale(workdir / "agentd", plan)
    bin_dir = None if quick else supervisord_bin(plan.install)
    peers = peer_scale(workdir / "supervisord", plan, bin_dir) if bin_dir else []

    column = PeerColumn(quick, ran=bin_dir is not None)
    by_level = {p.workers: p for p in peers}
    rows: list[Row] = []
    for i, level in enumerate(levels):
        peer = by_level.get(level.workers)
        rows.append(
            Row(
                NAME,
                f"status --json latency @ {level.workers} idle workers, median",
                "ms",
                level.status_ms,
                floor=floor,
                peer=peer.status_ms if peer else None,
                peer_name=column.name,
                target=f"< {TARGET_MS:g} ms",
                met=level.status_ms < TARGET_MS,
                note=(
                    f"`agentd status --json` as a fresh CLI process, start to exit, median of "
                    f"{plan.calls}. Floor: `python -c pass`. "
                    + column.note("`supervisorctl status`, the same workers.")
                )
                if i == 0
                else "",
            )
        )
    for i, level in enumerate(levels):
        peer = by_level.get(level.workers)
        rows.append(
            Row(
                NAME,
                f"status --json CPU time @ {level.workers} idle workers, median",
                "ms",
                level.status_cpu_ms,
                peer=peer.status_cpu_ms if peer else None,
                peer_name=column.name,
                note="User + system time of the status process (getrusage of the child): "
                "what the call takes on an idle core. On a busy machine the latency above "
                "is this stretched by the wait for a core."
                if i == 0
                else "",
            )
        )
    for i, level in enumerate(levels):
        peer = by_level.get(level.workers)
        rows.append(
            Row(
                NAME,
                f"memory in use @ {level.workers} idle workers (PSS, all processes)",
                "GB",
                level.pss_gb,
                peer=peer.pss_gb if peer else None,
                peer_name=column.name,
                note="PSS of the supervisor and every process under it, summed (each shared "
                "page counted once overall). Machine used (total - available) at each "
                "level: "
                + ", ".join(f"{lv.workers}: {lv.used_gb:.1f} GB" for lv in levels)
                + (
                    f"; {PEER}: " + ", ".join(f"{p.workers}: {p.used_gb:.1f} GB" for p in peers)
                    if peers
                    else ""
                )
                + "."
                if i == 0
                else "",
            )
        )
    for level in levels:
        peer = by_level.get(level.workers)
        rows.append(
            Row(
                NAME,
                f"supervisor CPU @ {level.workers} idle workers",
                "%",
                level.cpu,
                peer=peer.cpu if peer else None,
                peer_name=column.name,
            )
        )
    best = holds(levels)
    tried = max((lv.workers for lv in levels), default=0)
    rows.append(
        Row(
            NAME,
            "most concurrent idle workers with status < 200 ms",
            "",
            float(best),
            peer=float(holds(peers)) if peers else None,
            peer_name=column.name,
            target=f">= {TARGET_WORKERS}",
            met=None if quick else best >= TARGET_WORKERS,
            note=f"Levels tried: {', '.join(str(lv) for lv in plan.levels)}"
            + (f" ({PEER}: {', '.join(str(lv) for lv in plan.peer_levels)})" if peers else "")
            + f"; the largest level reached was {tried}"
            + (f" ({PEER}: {max(p.workers for p in peers)})" if peers else "")
            + ". A figure equal to the largest level tried means the machine held every "
            "level tried.",
        )
    )
    return rows
