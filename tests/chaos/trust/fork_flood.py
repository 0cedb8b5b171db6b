"""Fork flood: a tool takes every process the machine has while other tasks start.

A task's ``run_command`` starts ``FLOOD`` sleeps, as many as the
machine lets it, and holds them ``HOLD`` seconds (a fork bomb that ends by itself: each
sleep lasts ``HOLD``, and the shell that waits for them started its own timer first, so
a refused fork does not end the flood early). While the flood holds every process,
``NEIGHBOURS`` other tasks are submitted. Before the defence, each of them failed at once
(``cannot start a worker: [Errno 11]``), or, started, could not get a thread and
crash-looped; now each waits in ``backoff`` (``resources: ...``) until the flood is
over, and ends ``done``.

The machine stays safe: the daemon, and everything it starts, runs in a pids cgroup
(``tests.pids``) of ``LIMIT`` processes and threads, which is "the machine" of the attack
(root ignores RLIMIT_NPROC; a pids cgroup holds it). Where the daemon can delegate cgroups
v2, the flood's own task cgroup (``[tools] max_processes = TASK_LIMIT``) stops it first,
and the neighbours do not even wait.

Figures (per host): ``tasks failed by a neighbour`` (must be 0), how many neighbours met
the flood (waited for resources: informational, 0 where cgroups bound the flood), and the
control: the same attack on a daemon whose resource wait at the fork is removed
(``RESOURCE_ERRNOS`` emptied: the old handling, a refused fork fails the task), where at
least one neighbour must fail, or the attack never reached them and proves nothing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.chaos.trust import FAULT, Host
from tests.daemon import Daemon, subreaper
from tests.daemon import config_text as daemon_config
from tests.faults.report import Figure
from tests.pids import PidsCgroup, confine, pids_cgroup
from tests.support import poll_for, reply, text, tool_use

LIMIT = 160  # processes and threads of the daemon's whole tree: the attack's machine
TASK_LIMIT = 64  # [tools] max_processes: the flood's own bound where cgroups are delegated
FLOOD = 1000  # sleeps the flood tries to start
FINAL = ("done", "failed")
#: How the control's daemon is started: the daemon with its resource wait taken out.
UNDEFENDED = (
    "import sys; import supervisor.launch as d; d.RESOURCE_ERRNOS = frozenset(); "
    "from supervisor.cli import main; sys.exit(main())"
)


def say(message: str) -> None:
    print(f"fork_flood: {message}", file=sys.stderr, flush=True)


def config_text(tools: str = f"max_processes = {TASK_LIMIT}") -> str:
    """A daemon's config for a trust attack: fast heartbeats and retries, ``tools`` the
    body of its ``[tools]`` table."""
    return daemon_config(
        max_workers=32,
        timeout=10.0,
        model_call=120,
        tool_call=120,
        backoff_max=1.0,
        crash_loop_limit=None,
        sandbox=None,
        tool_modules=(),
        tools=f"{tools}\n",
    )


def flood_command(hold: float) -> str:
    """Start up to ``FLOOD`` sleeps of ``hold`` seconds; end when they do."""
    return (
        f"sleep {hold:g} & timer=$!\n"
        f"(for i in $(seq {FLOOD}); do sleep {hold:g} & done) 2>/dev/null\n"
        'wait "$timer"'  # (a builtin: no fork needed while the flood holds every process)
    )


def neighbour_script() -> list[dict[str, Any]]:
    return [
        reply(text("Writing."), tool_use("write_file", path="n.txt", content="n")),
        reply(text("Done.")),
    ]


def without_defence(daemon: Daemon) -> Daemon:
    """``daemon`` started as ``python -c UNDEFENDED`` instead of ``python -m supervisor``."""
    command = daemon.command

    def undefended(*args: str) -> list[str]:
        argv = command(*args)
        at = next(i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", "supervisor"])
        return [*argv[:at], "-c", UNDEFENDED, *argv[at + 2 :]]

    daemon.command = undefended  # type: ignore[method-assign]
    return daemon


def attack(
    root: Path, host: Host, cgroup: PidsCgroup, neighbours: int, hold: float, *, defended: bool
) -> dict[str, int]:
    """One flood and its neighbours: how many neighbours ended failed, how many met the
    flood (an event ``resource_wait``, or a start refused in their failure)."""
    daemon = confine(host.daemon(root, config_text()), cgroup)
    if not defended:
        daemon = without_defence(daemon)
    try:
        daemon.start()
        cgroup.limit(LIMIT)
        flood = [reply(tool_use("run_command", command=flood_command(hold), timeout=hold + 60))]
        bomb = daemon.submit([*flood, reply(text("Flooded."))], name="flood")
        try:  # the flood holds the machine (or its own cgroup, where delegated)
            poll_for(lambda: cgroup.current() >= LIMIT - 2, 20.0, what="the flood")
        except AssertionError:
            say(f"the flood reached {cgroup.current()} of {LIMIT} processes")
        names = [daemon.submit(neighbour_script(), name=f"n{i}") for i in range(neighbours)]
        rows = {n: daemon.wait_state(n, *FINAL, timeout=hold + 60) for n in names}
        daemon.wait_state(bomb, *FINAL, timeout=hold + 60)
        failed = [n for n, row in rows.items() if row["state"] != "done"]
        met = [
            n
            for n, row in rows.items()
            if daemon.events(n, "resource_wait") or "[Errno 11]" in str(row.get("reason"))
        ]
        for name in failed:
            say(f"{'defended' if defended else 'control'}: {name} {rows[name].get('reason')}")
        return {"failed": len(failed), "met": len(met)}
    finally:
        cgroup.limit(None)
        daemon.cleanup()
        cgroup.kill_all()


def run(quick: bool, host: Host) -> list[Figure]:
    neighbours, hold = (3, 6.0) if quick else (8, 15.0)
    started = time.monotonic()
    with (
        subreaper(),
        tempfile.TemporaryDirectory(prefix="agentd-fork-flood-") as folder,
        pids_cgroup(f"fork-flood-{host.name}") as cgroup,
    ):
        found = attack(Path(folder) / "d", host, cgroup, neighbours, hold, defended=True)
        control = attack(Path(folder) / "c", host, cgroup, neighbours, hold, defended=False)
    at = f"({host.name})"
    return [
        Figure(
            FAULT,
            f"fork flood: tasks failed by a neighbour {at}",
            found["failed"],
            found["failed"] > 0,
        ),
        Figure(
            FAULT,
            f"fork flood: neighbours that met the flood {at}",
            f"{found['met']} of {neighbours}",
        ),
        Figure(
            FAULT,
            f"fork flood: control, resource wait removed: neighbours failed {at}",
            f"{control['failed']} of {neighbours}",
            control["failed"] == 0,
        ),
        Figure(FAULT, f"fork flood: runtime s {at}", time.monotonic() - started),
    ]
