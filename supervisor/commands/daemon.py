"""The daemon's lifecycle: ``agentd start`` (in the foreground, or ``--detach``ed once it is
ready), ``agentd stop`` (what it cut off said), ``agentd demo``, ``agentd unit``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from supervisor.commands.context import named_spool, store_url
from supervisor.commands.parsing import Commands
from supervisor.coordination import already_running, running_pid, supervisor_info
from supervisor.status import load_state, status_row
from supervisor.stores import postgres_store, record_store
from supervisor.submit import existing_task, listed_tasks
from worker import credentials
from worker.config import Config
from worker.errors import AgentdError, UsageError
from worker.protocol import TaskStatus
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add("start", cmd_start, "run the supervisor in the foreground", reads_spool=False)
    p.add_argument("--detach", action="store_true", help="run in the background once ready")
    p.add_argument(
        "--log-file",
        help="append the daemon's log to this file, reopened on SIGHUP (--detach: "
        "SPOOL/supervisor.log)",
    )
    commands.add("stop", cmd_stop, "stop the running supervisor gracefully", uses_store=False)
    p = commands.add(
        "demo",
        cmd_demo,
        "self-contained demonstration on the scripted model",
        reads_spool=False,
        uses_store=False,
    )
    p.add_argument("--keep", action="store_true", help="leave the demo spool for inspection")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="two nodes on a throwaway PostgreSQL: one is killed, the other takes over",
    )
    p = commands.add(
        "unit",
        cmd_unit,
        "print a systemd unit for this installation",
        reads_spool=False,
        uses_store=False,
    )
    p.add_argument("--user", action="store_true", help="a unit for ~/.config/systemd/user/")
    p.add_argument(
        "--allow-jit",
        action="store_true",
        help="MemoryDenyWriteExecute=no, for tools that run node or java",
    )


def cmd_start(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from worker.tools.registry import find_tool_modules  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    find_tool_modules(config.tools.modules, source=config.source)
    if args.detach:
        return _detach(args, spool)
    # (the daemon holds its secrets already: ``main`` took them over first of all)
    # the store's URL, for the workers, through their pipe (as read, when it was)
    url = store_url(args, config, spool) if spool.shared is not None else None
    if url is not None and credentials.held().get(credentials.STORE) != url:
        credentials.hold(credentials.held().with_value(credentials.STORE, url))
    if url is not None and running_pid(spool) is None:  # (else this start is refused)
        record_store(spool.ensure().root, url)
    # The daemon's imports (asyncio among them) are paid by the daemon alone: every other
    # command, `status` first of all, starts in half the time without them. The daemon
    # speaks no TLS (its sockets are local), so `ssl`, which asyncio and structlog load
    # when they can, is kept out: 4.5 MB of the RSS of the one process that never stops
    # (workers and the fork server are processes of their own, with `ssl`).
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
    import asyncio  # noqa: PLC0415  (after `ssl` is kept out, above; only the daemon needs it)

    from supervisor import logging as agentd_logging  # noqa: PLC0415  (the same)
    from supervisor.daemon import Supervisor  # noqa: PLC0415  (the same)
    from worker import proctitle  # noqa: PLC0415  (the same)

    if args.log_file:
        try:
            agentd_logging.log_to_file(Path(args.log_file))
        except OSError as exc:
            raise AgentdError(f"cannot open --log-file {args.log_file}: {exc}") from None
    agentd_logging.configure(args.log_format)
    # The file this process read, found or named, is the one its workers read.
    supervisor = Supervisor(spool, config, config.source)
    proctitle.daemon(spool.root)
    return asyncio.run(supervisor.run())


def _detach(args: argparse.Namespace, spool: Spool) -> int:
    pid = running_pid(spool)
    if pid is not None:
        raise already_running(spool, pid)
    spool.ensure()
    cmd = [sys.executable, "-m", "supervisor", "--spool", str(spool.root)]
    if args.config:
        cmd += ["--config", str(args.config)]
    if args.node:
        cmd += ["--node", args.node]
    log_file = Path(args.log_file).absolute() if args.log_file else spool.root / "supervisor.log"
    cmd += ["--log-format", args.log_format or "json", "start", "--log-file", str(log_file)]
    import subprocess  # noqa: PLC0415  (only --detach starts a process)

    # The daemon opens the file again itself (to reopen it on SIGHUP); this one catches
    # whatever it says before it can. The log shares a disk with the spool, by default: a
    # full or read-only one must not stop the daemon. Its writes cannot raise (``LogSink``
    # keeps refused lines until the disk takes them), and a log that cannot even be opened
    # leaves the daemon without one rather than without a start.
    secrets = credentials.gather(os.environ)  # for the daemon through a pipe, not its environ
    if args.store:  # (never in its command line, where any process can read it)
        secrets = secrets.with_value(credentials.STORE, args.store)
    try:
        log = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        logged = os.fstat(log).st_size  # what the daemon says from here on is this start's
    except OSError as exc:
        print(f"agentd: cannot open {log_file} ({exc.strerror}); the daemon logs nowhere.")
        log = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        logged = 0
    try:
        proc = credentials.start_process(
            cmd,
            secrets,
            os.environ,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    finally:
        os.close(log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = _error_line(log_file, logged)  # the daemon's one line, as in the foreground
            if said is None:
                raise AgentdError(
                    f"agentd exited at start (code {proc.returncode}); see {log_file}."
                )
            print(said, file=sys.stderr)
            return proc.returncode
        info = supervisor_info(spool) or {}
        if info.get("pid") == proc.pid and running_pid(spool) == proc.pid:
            print(f"agentd started (pid {proc.pid}) on {spool.root}")
            return 0
        time.sleep(0.05)
    raise AgentdError(f"agentd did not become ready in 15 s; see {log_file}.")


def _error_line(log_file: Path, offset: int) -> str | None:
    """The last ``agentd: ...`` line a detached daemon wrote to its log past ``offset``:
    the one line it exited with."""
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return None
    said = [line for line in text.splitlines() if line.startswith("agentd: ")]
    return said[-1] if said else None


def cmd_stop(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    pid = running_pid(spool)
    if pid is None:
        print(f"agentd is not running on {spool.root}")
        return 0
    in_tools = tools_in_flight(spool)
    os.kill(pid, signal.SIGTERM)
    grace = config.restart.stop_grace
    if in_tools:
        calls = ", ".join(f"{task} ({phase.removeprefix('tool:')})" for task, phase in in_tools)
        print(
            f"agentd (pid {pid}) is stopping: waiting up to {grace:g} s for "
            f"{len(in_tools)} tool call(s) to finish, then cutting them off: {calls}",
            flush=True,
        )
    deadline = time.monotonic() + grace + 10
    while time.monotonic() < deadline:
        if running_pid(spool) is None:
            for line in cut_off_calls(spool, [task for task, _ in in_tools]):
                print(line)
            print(f"agentd stopped (pid {pid})")
            return 0
        time.sleep(0.05)
    raise AgentdError(f"agentd (pid {pid}) did not stop in time; check `agentd status`.")


def tools_in_flight(spool: Spool) -> list[tuple[str, str]]:
    """(task, phase) of every task whose worker is in a tool call: what a stop waits for."""
    found = []
    for task in listed_tasks(spool):
        with contextlib.suppress(AgentdError, OSError, ValueError):
            row = status_row(task)
            if row["state"] == TaskStatus.RUNNING and str(row.get("phase") or "").startswith(
                "tool:"
            ):
                found.append((task.id, str(row["phase"])))
    return found


def cut_off_calls(spool: Spool, task_ids: Sequence[str]) -> list[str]:
    """One line for each call a stop left without a result, saying what the next start
    does with it (docs/design.md section 5: an unsafe one waits for a decision)."""
    lines = []
    for task_id in task_ids:
        with contextlib.suppress(AgentdError, OSError, ValueError):
            for call in load_state(existing_task(spool, task_id)).dangling():
                then = (
                    f"held for a decision at the next start (`agentd dangling {task_id}`)"
                    if call.effect == "unsafe"
                    else "run again at the next start"
                )
                lines.append(f"cut off: {task_id} call {call.call_id} ({call.tool}): {then}")
    return lines


def cmd_demo(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.demo import run_cluster_demo, run_demo  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.cluster:
        if args.keep:
            raise UsageError("agentd demo --cluster keeps nothing: its database goes with it.")
        postgres_store()  # its nodes need psycopg: said here, before a server is started
        return run_cluster_demo()
    return run_demo(keep=args.keep)


def cmd_unit(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import unit  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from worker.paths import CONFIG_ENV, SYSTEM_CONFIG  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    # The user unit serves what this user's CLI resolves; the system unit the machine's
    # config and its StateDirectory, unless the operator names others.
    named_config = args.config or os.environ.get(CONFIG_ENV)
    if args.user:
        source = Path(named_config) if named_config else config.source
        install = unit.Installation(
            unit.agentd_command(),
            config=source.absolute() if source else None,
            spool=spool.root,
            home=Path.home(),
        )
    else:
        named = named_spool(args)
        install = unit.Installation(
            unit.agentd_command(),
            config=Path(named_config).absolute() if named_config else SYSTEM_CONFIG,
            spool=named[0] if named else None,
            folders=unit.agentd_folders(),
        )
        for warning in unit.home_warnings(install):
            print(f"agentd: warning: {warning}", file=sys.stderr)
    print(unit.render(install, user=args.user, allow_jit=args.allow_jit), end="")
    return 0
