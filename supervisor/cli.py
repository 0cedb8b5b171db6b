"""The ``agentd`` command line (docs/design.md section 2).

This module is a leaf: it alone parses arguments and prints. Everything below it raises
``worker.errors.AgentdError`` subclasses, which ``main`` turns into one line on stderr
and the class's exit code (0 ok, 1 operational, 2 usage, 3 no such task or wrong state,
78 configuration). Commands that change a task work with or without a running daemon:
with one, they write the change durably and ring its inbox; without one, they take the
supervisor lock and apply the change themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from supervisor.actions import EVERY_CALL, approve, cancel, retry
from supervisor.control import (
    Fenced,
    already_running,
    ring,
    running_pid,
    supervisor_info,
)
from supervisor.operator import Operator
from supervisor.overview import dangling_rows, status_document
from supervisor.record import TaskRecord
from supervisor.status import load_state, status_row
from supervisor.stores import (
    postgres_store,
    record_store,
    recorded_store,
    shared,
    store_for,
    use_shared,
)
from supervisor.submit import (
    PROMPT_FILE_LIMIT,
    RESULT_FILE_LIMIT,
    checked_text,
    existing_task,
    listed_tasks,
    read_text_input,
    submit,
)
from worker import __version__, credentials
from worker.config import NODE_NAME, Config, load_config
from worker.config import node_name as local_node
from worker.errors import (
    AgentdError,
    ConfigError,
    SpoolError,
    StorageError,
    UsageError,
    quoted,
)
from worker.protocol import NODE_ENV, TaskStatus
from worker.redactor import without_password
from worker.spool import Spool, TaskDir, default_spool
from worker.store.pgschema import SCHEMA_VERSION
from worker.tools.sandbox import Sandbox

Handler = Callable[[argparse.Namespace, Config, Spool], int]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message}; see `{self.prog} --help`.")


# -- context ----------------------------------------------------------------------------


def named_spool(args: argparse.Namespace) -> tuple[Path, str] | None:
    """The spool the operator named (``--spool``, else ``$AGENTD_SPOOL``) and how."""
    if args.spool:
        return Path(args.spool).expanduser().absolute(), "--spool"
    if env := os.environ.get("AGENTD_SPOOL"):
        return Path(env).expanduser().absolute(), "$AGENTD_SPOOL"
    return None


def resolve_spool(args: argparse.Namespace, config: Config) -> Spool:
    if named := named_spool(args):
        return Spool(named[0])
    if os.environ.get("STATE_DIRECTORY"):
        return Spool(default_spool())
    if config.spool is not None:
        return Spool(config.spool.expanduser().absolute())
    return Spool(default_spool())


def store_url(args: argparse.Namespace, config: Config, spool: Spool) -> str | None:
    """The shared store's URL, first of: ``--store``, ``$AGENTD_STORE`` (or what a daemon
    holds of it: ``credentials``; only that secret is read, so a command never fails on
    another's source), the config's ``store``, the store a node on ``spool`` recorded
    (without its password: libpq's own sources give it); None: the spool's files."""
    held = credentials.held().get(credentials.STORE)
    return (
        args.store
        or held
        or credentials.gather(os.environ, [credentials.STORE]).get(credentials.STORE)
        or config.store
        or recorded_store(spool.root)
    )


def node_name(args: argparse.Namespace, config: Config) -> str | None:
    """This node's name: ``--node``, ``$AGENTD_NODE``, the config's ``node``; None: the
    hostname (the store's default)."""
    name = args.node or os.environ.get(NODE_ENV) or config.node
    if name is not None and not NODE_NAME.fullmatch(name):
        raise UsageError(
            f"--node {quoted(name)} is not a name of letters, digits, '.', '_' and '-' "
            "(at most 63, starting with a letter or digit)."
        )
    return name


def check_named_spool(args: argparse.Namespace) -> None:
    """A command that reads a spool the operator named refuses one that does not exist:
    a typo in ``--spool`` must not look like an empty system (docs/design.md section 2)."""
    named = named_spool(args)
    if named is not None and not named[0].exists():
        path, how = named
        raise SpoolError(
            f"no spool at {path} (named by {how}); check the path, or create the spool "
            f"with `agentd --spool {path} start` (or `submit`)."
        )


def text_or_file(text: str | None, path: str | None, option: str, limit: int) -> str | None:
    """The value of ``--OPTION TEXT`` or the contents of ``--OPTION-file F`` (at most
    ``limit`` bytes: see ``PROMPT_FILE_LIMIT``)."""
    if path is None:
        return checked_text(text, f"--{option}")
    return read_text_input(Path(path), limit, f"--{option}-file")


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# -- commands ---------------------------------------------------------------------------


def cmd_start(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from worker.tools.registry import find_tool_modules  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    find_tool_modules(config.tools.modules, source=config.source)
    if args.detach:
        return _detach(args, spool)
    # (the daemon holds its secrets already: ``main`` took them over first of all)
    # the store's URL, for the workers, through their pipe (as read, when it was)
    url = store_url(args, config, spool) if shared() is not None else None
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


def cmd_submit(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    if (args.prompt is None) == (args.prompt_file is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-file FILE.")
    task = submitted(args, config, spool)
    ring(spool, task.id)
    print(task.id)
    pid = running_pid(spool) if args.script is None else None
    info = (supervisor_info(spool) or {}) if pid is not None else {}
    if info.get("api_key") is False:  # (the hint: what works for that daemon)
        print(
            f"agentd: warning: the daemon (pid {pid}) holds no Anthropic API key, so this "
            f"task's model calls will fail; {info.get('api_key_hint')}; then "
            f"`agentd retry {task.id}`.",
            file=sys.stderr,
        )
    return 0


def submitted(
    args: argparse.Namespace, config: Config, spool: Spool, *, foreground: bool = False
) -> TaskDir:
    """The task ``submit``'s options describe, created (``agentd submit``, ``agentd run``)."""
    from supervisor.budgets import parse_tokens, parse_usd  # noqa: PLC0415  (only submit and run need it)
    from worker.budget import Budget  # noqa: PLC0415  (the same)

    prompt = text_or_file(args.prompt, args.prompt_file, "prompt", PROMPT_FILE_LIMIT) or ""
    budget = config.budget  # each option given replaces its [budget] default ("none": no limit)
    if args.budget_usd is not None:
        budget = Budget(parse_usd(args.budget_usd, "--budget-usd"), budget.tokens)
    if args.budget_tokens is not None:
        budget = Budget(budget.usd, parse_tokens(args.budget_tokens, "--budget-tokens"))
    return submit(
        spool,
        config,
        prompt=prompt,
        name=args.name,
        model=args.model,
        script=Path(args.script) if args.script else None,
        tools=args.tools.split(",") if args.tools is not None else None,
        system=args.system,
        max_turns=args.max_turns if args.max_turns is not None else 100,
        workspace=Path(args.workspace) if args.workspace else None,
        foreground=foreground,
        budget=budget,
    )


#: ``submit``'s options, which ``run --resume`` refuses (the task has them already).
SUBMIT_OPTIONS = (
    "name",
    "model",
    "script",
    "tools",
    "system",
    "max_turns",
    "workspace",
    "budget_usd",
    "budget_tokens",
)


def cmd_run(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import foreground  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    given = sum(x is not None for x in (args.prompt, args.prompt_file, args.resume))
    if given != 1:
        raise UsageError("give exactly one of --prompt TEXT, --prompt-file FILE or --resume TASK.")
    if store_url(args, config, spool) is not None:  # (refused before any connection)
        foreground.refuse_shared(shared=True)
    if args.resume is not None:
        named = [f"--{o.replace('_', '-')}" for o in SUBMIT_OPTIONS if getattr(args, o) is not None]
        if named:
            raise UsageError(
                f"{', '.join(named)} cannot go with --resume: the task keeps the options it "
                "was made with."
            )
        task = existing_task(spool, args.resume)
        record = foreground.prepare(task, spool)
        if record is None:
            print(f"{task.id}: done already ({TaskRecord.load(task).reason or 'ended'})")
            return 0
    else:
        task = submitted(args, config, spool, foreground=True)
        ring(spool, task.id)  # a daemon on the spool sees it at once, and leaves it alone
        print(f"agentd: task {task.id}", file=sys.stderr, flush=True)
    terminal = sys.stdin is not None and sys.stdin.isatty()
    ask = ask_at_terminal if terminal else None
    config_path = Path(args.config).absolute() if args.config else config.source
    run = foreground.ForegroundRun(
        task,
        config,
        config_path,
        out=sys.stdout,
        err=sys.stderr,
        json_lines=args.json,
        ask=ask,
        ask_budget=ask_budget_at_terminal if terminal else None,
        resume_line=foreground.resume_command(task.id, _agentd_prefix(args)),
        show_from_start=args.resume is None,
    )
    return int(run.run())


def _agentd_prefix(args: argparse.Namespace) -> str:
    """``agentd`` with the global options this command was given that a later one needs
    too (the spool, the config), so that the resume line can be run as printed."""
    import shlex  # noqa: PLC0415  (only `run` needs it)

    words = ["agentd"]
    if args.spool:
        words += ["--spool", str(Path(args.spool).expanduser().absolute())]
    if args.config:
        words += ["--config", str(Path(args.config).expanduser().absolute())]
    return shlex.join(words)


#: The answers ``agentd run``'s prompt takes for a held call, and what each means.
ANSWERS = {"r": "rerun", "re-run": "rerun", "rerun": "rerun", "s": "skip", "skip": "skip",
           "x": "result", "result": "result"}  # fmt: skip


def ask_at_terminal(call: dict[str, Any]) -> Any:
    """Put one held call to the person at the terminal (``agentd run``): re-run it, skip it
    with a reason, or record its result; None at the end of input (the task stays held)."""
    from supervisor.hold_prompt import Answer  # noqa: PLC0415  (only `run` needs it)

    shown = json.dumps(call.get("input"), ensure_ascii=False)
    print(
        f"‖ held: {call['tool']} ({call.get('effect')}) call {call['call_id']}: {call.get('why')}"
        f"\n    input: {shown[:2000]}\n    its outcome is unknown: it may or may not have "
        "taken effect.",
        file=sys.stderr,
    )
    while True:
        choice = _read_answer("re-run it [r], skip it [s], or record its result [x]? ")
        if choice is None:
            return None
        action = ANSWERS.get(choice.strip().lower())
        if action == "rerun":
            return Answer("rerun")
        if action == "skip":
            reason = _read_answer("why (the model is told it was not run)? ")
            if reason is None:
                return None
            return Answer("skip", reason=checked_text(reason.strip(), "the reason") or None)
        if action == "result":
            result = _read_answer("its result (what the model gets)? ")
            if result is None:
                return None
            if result.strip():
                return Answer("result", result=checked_text(result.rstrip("\n"), "the result"))
        print("answer r, s or x.", file=sys.stderr)


def ask_budget_at_terminal(reason: str, budget: Any, refusal: str | None) -> Any:
    """Ask the person at the terminal for a new budget of a task held on its budget
    (``agentd run``): each limit a number, ``none``, or nothing to keep it; None at the
    end of input (the task stays held)."""
    from supervisor.budgets import KEEP, parse_tokens, parse_usd  # noqa: PLC0415  (only `run` needs it)
    from supervisor.hold_prompt import BudgetAnswer  # noqa: PLC0415  (the same)

    if refusal is not None:
        print(f"agentd: {refusal}", file=sys.stderr)
    else:
        print(f"‖ held: {reason}", file=sys.stderr)
    now_usd = "none" if budget.usd is None else f"{budget.usd:.2f}"
    now_tokens = "none" if budget.tokens is None else str(budget.tokens)
    while True:
        usd = _read_answer(f"new budget in US dollars (now {now_usd}; a number, none, or Enter "
                           "to keep it)? ")  # fmt: skip
        if usd is None:
            return None
        tokens = _read_answer(f"new budget in tokens (now {now_tokens}; a number, none, or "
                              "Enter to keep it)? ")  # fmt: skip
        if tokens is None:
            return None
        try:
            return BudgetAnswer(
                KEEP if not usd.strip() else parse_usd(usd.strip(), "the budget"),
                KEEP if not tokens.strip() else parse_tokens(tokens.strip(), "the budget"),
            )
        except UsageError as exc:
            print(f"agentd: {exc}", file=sys.stderr)


def _read_answer(prompt: str) -> str | None:
    """One line typed at the terminal after ``prompt`` (on stderr: stdout may be the
    transcript's pipe); None at the end of input."""
    print(prompt, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def table_width() -> int | None:
    """The width the status table is cut to: ``$COLUMNS`` when set, else the terminal's when
    stdout is one; None (cut nothing) when it goes to a pipe or a file, as ``ps`` does."""
    if os.environ.get("COLUMNS", "").strip().isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


#: Clear the screen and move home: how ``status --watch`` redraws on a terminal.
REDRAW = "\033[H\033[J"


def cmd_status(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    if args.interval is not None and not args.watch:
        raise UsageError("--interval goes with --watch.")
    interval = 2.0 if args.interval is None else args.interval
    if not (interval > 0 and math.isfinite(interval)):
        raise UsageError(f"--interval must be a positive number of seconds, not {interval:g}.")
    # On a terminal each snapshot replaces the last; elsewhere (a pipe, a file) they follow
    # one another, a blank line apart, with no escape codes at all.
    redraw = args.watch and sys.stdout.isatty()
    first = True
    while True:
        doc = status_document(spool, args.task, config.price_table)
        if args.json:
            text = json.dumps(doc, indent=2, default=str)
        else:
            from supervisor.views import render_status  # noqa: PLC0415  (the table alone needs it: --json starts faster)

            text = render_status(doc, width=table_width())
        if redraw:
            text = REDRAW + text
        elif not first:
            text = "\n" + text
        print(text, flush=True)
        if not args.watch:
            return 0
        first = False
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def cmd_nodes(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """The nodes that share the store; on the spool's files, this machine alone."""
    cluster = shared()
    if cluster is not None:
        nodes = [n.to_json() for n in cluster.nodes()]
    else:
        pid = running_pid(spool)
        running = status_document(spool)["tasks"]
        nodes = [
            {
                "name": local_node(),
                "host": local_node(),
                "pid": pid,
                "epoch": None,
                "max_workers": config.max_workers,
                "tasks": sum(1 for t in running if t["state"] == TaskStatus.RUNNING),
                "heartbeat_age": None,
                "alive": pid is not None,
            }
        ]
    if args.json:
        out(nodes)
        return 0
    print(
        f"{'NAME':<16} {'HOST':<20} {'PID':>8} {'EPOCH':>5} {'TASKS':>5} {'MAX':>4} {'SEEN':>7}  "
        "STATE"
    )
    for n in nodes:
        age = n["heartbeat_age"]
        seen = f"{age:.1f}s" if isinstance(age, (int, float)) else "-"
        state = "alive" if n["alive"] else "gone"
        print(
            f"{n['name']:<16} {n['host']:<20} {n['pid'] or '-':>8} {n['epoch'] or '-':>5} "
            f"{n['tasks']:>5} "
            f"{n['max_workers']:>4} {seen:>7}  {state}"
        )
    return 0


def cmd_store(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """``agentd store init``: ``main`` created or migrated the schema already."""
    cluster = shared()
    if cluster is None:
        raise UsageError(
            "no shared store is given; name one with --store URL, $AGENTD_STORE or `store`."
        )
    print(f"agentd store {cluster!r}: schema version {SCHEMA_VERSION}, ready")
    return 0


def cmd_dangling(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    rows = dangling_rows(spool, args.task)
    if args.json:
        out(rows)
        return 0
    if not rows:
        print("no held calls")
    for r in rows:
        print(
            f"{r['task']}  {r['call_id']}  {r['tool']} ({r['effect']})  started {r['started_at']}"
            f"\n    input: {json.dumps(r['input'])[:300]}\n    key:   {r['idempotency_key']}"
            f"\n    decide: agentd approve-dangling {r['task']} {r['call_id']} "
            "[--skip --reason TEXT | --result TEXT]"
        )
    return 0


def cmd_approve(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    if (args.call_id is None) == (not args.all):
        raise UsageError("give either a CALL_ID or --all.")
    if args.result is not None and args.result_file is not None:
        raise UsageError("give --result or --result-file, not both.")
    result = text_or_file(args.result, args.result_file, "result", RESULT_FILE_LIMIT)
    if args.skip and result is not None:
        raise UsageError("--skip and --result are different decisions; give one.")
    action = "skip" if args.skip else "result" if result is not None else "rerun"
    decided = approve(
        spool,
        args.task,
        args.call_id or EVERY_CALL,
        action=action,
        reason=args.reason,
        result=result,
        operator=Operator.here(),
    )
    for call_id in decided:
        print(f"{args.task} {call_id}: {action}")
    return 0


def cmd_logs(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.views import TaskLog, log_line  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    task = existing_task(spool, args.task)
    if args.lines is not None and args.lines < 0:
        raise UsageError(f"-n must be 0 or more lines, not {args.lines}.")
    show = (lambda e: json.dumps(e, ensure_ascii=False, default=str)) if args.json else log_line
    log = TaskLog(task)
    entries = log.read(settled=args.follow)
    if args.lines is not None:
        entries = entries[len(entries) - args.lines :] if args.lines else []
    # --follow ends once the task is done, failed or cancelled (held is not an end: a
    # decision resumes it); what is still unsettled then is printed as it stands.
    while True:
        for entry in entries:
            print(show(entry))
        sys.stdout.flush()
        if not args.follow:
            return 0
        if log.ended():
            for entry in log.read():
                print(show(entry))
            return 0
        try:
            time.sleep(FOLLOW_POLL)
        except KeyboardInterrupt:
            return 0
        entries = log.read(settled=True)


#: How often ``logs --follow`` looks for new events and turns.
FOLLOW_POLL = 0.25


def cmd_cancel(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    done = cancel(spool, args.task, config.restart.stop_grace + 5, operator=Operator.here())
    if isinstance(done, Fenced):  # (its node stopped renewing the lease: frozen, cut off)
        running = f"; its running call {done.call} may still complete until then"
        print(f"agentd: {args.task} cancelled; {done.told()}{running if done.call else ''}")
        return 0
    print(f"{args.task}: cancelled" if done else f"{args.task}: cancel requested")
    return 0


def cmd_retry(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    handed = retry(spool, args.task, operator=Operator.here())
    print(f"{args.task}: handed to the daemon" if handed else f"{args.task}: queued for retry")
    return 0


def cmd_budget(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.budgets import KEEP, change_budget, parse_tokens, parse_usd  # noqa: PLC0415  (only this command needs it)

    change = change_budget(
        spool,
        config,
        args.task,
        usd=KEEP if args.usd is None else parse_usd(args.usd),
        tokens=KEEP if args.tokens is None else parse_tokens(args.tokens),
        operator=Operator.here(),
    )
    after = change.after
    limits = [
        f"${after.usd:.2f}" if after.usd is not None else "no USD limit",
        f"{after.tokens} tokens" if after.tokens is not None else "no token limit",
    ]
    spent = f"${change.cost_usd:.6f}" if change.cost_usd is not None else "an unknown cost"
    print(f"{change.task}: budget {', '.join(limits)}; spent {spent}, {change.tokens} tokens")
    if change.resumed:
        print(f"{change.task}: resumed")
    return 0


def cmd_show(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import transcript  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    shown = transcript.task_lines(spool, args.task, turn=args.turn, prices=config.price_table)
    if args.json:
        for line in shown:
            print(json.dumps(line, ensure_ascii=False))
        return 0
    renderer = transcript.Renderer(sys.stdout, colour=transcript.use_colour(sys.stdout))
    for line in shown:
        renderer.line(line)
    return 0


def cmd_history(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.history import history_rows  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from supervisor.views import shown_outcome  # noqa: PLC0415  (the same)
    from worker.budget import cost_usd  # noqa: PLC0415  (the same)

    task = existing_task(spool, args.task)
    prices = config.price_table
    rows = history_rows(task, prices)
    if args.json:
        out(rows)
        return 0
    spec = store_for(spool.root).load_spec(task.id)
    if spec.forked_from:
        print(f"{task.id} was forked from {spec.forked_from['task']} at turn "
              f"{spec.forked_from['turn']}")  # fmt: skip
    print(f"{'TURN':>4}  {'TIME':24}  {'TOKENS':>11}  {'COST':>9}  {'BRANCH':7}  TOOL CALLS")
    for row in rows:
        branch = (
            "fork" if row["inherited"] else f"{row['branch']}" + (" x" if row["rewound"] else "")
        )
        tokens = f"{row['input_tokens']}/{row['output_tokens']}"
        spent = "-" if row["cost_usd"] is None else f"${row['cost_usd']:.4f}"
        head = f"{row['turn']:>4}  {row['at'] or '':24}"
        if row["kind"] == "compaction":
            tokens = f"{row['tokens_before']}>{row['tokens_after']}"
            summary = f"compacted turns {row['first']}-{row['last']}: {row['summary']}"
            print(f"{head}  {tokens:>11}  {spent:>9}  {branch:7}  {summary}")
            continue
        calls = (
            ", ".join(
                f"{c['tool']}({c['effect'] or '-'}: {shown_outcome(c)}{_decided(c)})"
                for c in row["tool_calls"]
            )
            or row["stop_reason"]
            or ""
        )
        git = f"  git {row['vcs']['snapshot'][:10]}" if row["vcs"] else ""
        print(f"{head}  {tokens:>11}  {spent:>9}  {branch:7}  {calls}{git}")
    rewinds = {
        (r["rewind"].get("at"), str(Operator.of(r["rewind"]) or "")): r["rewind"]["to"]
        for r in rows
        if r.get("rewind")
    }
    if any(r["rewound"] for r in rows):
        done = "; ".join(f"to turn {to} at {at}" + (f" {who}" if who else "")
                         for (at, who), to in rewinds.items())  # fmt: skip
        print("x: rewound, kept for audit" + (f" (rewound {done})" if done else ""))
    state = load_state(task)
    total, live = state.usage_total, state.usage
    print(f"tokens on the live branch {live.input_tokens}/{live.output_tokens}; "
          f"ever spent {total.input_tokens}/{total.output_tokens} (input/output)")  # fmt: skip
    spent_usd = cost_usd(state.spend_total, prices)
    shown = "unknown (a model has no price)" if spent_usd is None else f"${spent_usd:.6f}"
    print(f"cost_usd {shown} over the task's whole life (every branch, summary calls)")
    return 0


def _decided(call: dict[str, Any]) -> str:
    """What ``history`` adds to a call an operator decided: the decision and who made it."""
    decision = call.get("decision")
    if not decision:
        return ""
    who = Operator.of(decision)
    return f"; {decision.get('action')}" + (f" {who}" if who else "")


def cmd_rewind(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.history import rewind  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    report = rewind(
        spool,
        config,
        args.task,
        args.to,
        restore_workspace=args.restore_workspace,
        yes=args.yes,
        operator=Operator.here(),
    )
    for call in report.irreversible:
        print(
            f"not undone: turn {call['turn']} {call['tool']} ({call['effect']}) {call['call_id']}"
        )
    for call in report.cut_off:
        cut = f"cut off: turn {call['turn']} {call['tool']} ({call['effect']}) {call['call_id']}"
        if report.fenced is not None:  # (its node stopped renewing the lease: frozen, cut off)
            print(
                f"{cut}: {report.fenced.told()}; it may still complete until then, and its "
                "outcome is unknown"
            )
            continue
        print(
            f"{cut} was still running after restart.stop_grace ({config.restart.stop_grace:g} "
            "s) and was killed; its outcome is unknown"
        )
    print(f"{report.task}: rewound to turn {report.to}; later turns kept in the history")
    print(f"workspace: {report.workspace}")
    return 0


def cmd_fork(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.history import fork  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    prompt = checked_text(args.prompt, "--prompt")
    report = fork(
        spool, config, args.task, args.at, name=args.name, prompt=prompt, operator=Operator.here()
    )
    print(report.task)
    print(f"forked from {report.parent} at turn {report.at}; workspace: {report.workspace}",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_console(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """``agentd console``: the console's URL with a one-time login; or API tokens."""
    from supervisor.console import tokens  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if sum([args.token, args.list_tokens, args.revoke is not None]) > 1:
        raise UsageError("give one of --token, --list-tokens and --revoke ID, or none.")
    store = tokens.token_store(spool)
    if args.token:
        token, secret = tokens.mint(store, Operator.here().by)
        print(secret)
        print(
            f"agentd: API token {token.id} for {token.by}, shown this once: send it as "
            f"`Authorization: Bearer TOKEN`; `agentd console --revoke {token.id}` ends it",
            file=sys.stderr,
        )
        return 0
    if args.list_tokens:
        kept = tokens.listed(store)
        if not kept:
            print("no API tokens; `agentd console --token` mints one")
        for token in kept:
            print(f"{token.id}  {token.by:<16}  minted {token.created_at}")
        return 0
    if args.revoke is not None:
        tokens.revoke(store, args.revoke)
        print(f"{args.revoke}: revoked")
        return 0
    pid = running_pid(spool)
    url = (supervisor_info(spool) or {}).get("console") if pid is not None else None
    if not isinstance(url, str) or not url:
        where = "" if pid is not None else f" (agentd is not running on {spool.root})"
        raise AgentdError(f"the console is off: set [console] listen and reload{where}")
    secret = tokens.LoginTickets(spool).issue(Operator.here().by)
    print(f"{url}?token={secret}")
    minutes = round(tokens.LOGIN_TTL / 60)
    print(f"agentd: a one-time login link: open it within {minutes} minutes", file=sys.stderr)
    return 0


def cmd_init(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from worker import config as config_module  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.path is not None and args.system:
        raise UsageError("give a PATH or --system, not both.")
    if args.path is not None:
        path = Path(args.path)
    elif args.system:
        path = config_module.SYSTEM_CONFIG
    else:
        path = config_module.user_config_path()
    if path.exists() and not args.force:
        raise AgentdError(f"{path} exists; edit it, or give --force to overwrite it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_module.default_config_text(system=args.system))
    print(f"wrote {path}")
    return 0


def cmd_config_check(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import hooks  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from worker import config as config_module  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from worker.tools.registry import ToolRegistry  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.file is not None:
        config = load_config(Path(args.file))
        spool = resolve_spool(args, config)
    ToolRegistry.standard(config.tools.modules, source=config.source)  # imports each module
    source = config.source or "built-in defaults"
    hooks.check_commands(config.hooks, source)
    sandbox = Sandbox(config.tools.sandbox, config.tools.network).verdict()
    if sandbox.startswith("refused"):
        raise ConfigError(
            f'{source}: tools.sandbox is "required" but on this machine {sandbox[9:]}; '
            'install bubblewrap, or set tools.sandbox = "auto" to run commands bare.'
        )
    facts = [
        f"spool {spool.root}",
        f"max_workers {config.max_workers}",
        f"run_command sandbox: {sandbox}",
    ]
    if config.tools.modules:
        facts.append(f"tool modules {', '.join(config.tools.modules)}")
    if config.console.listen:
        facts.append(f"console on {config.console.listen}{_console_tls(config)}")
    if config.mcp.servers:  # each started once and listed: one that cannot be fails here
        from supervisor.toollist import list_servers  # noqa: PLC0415  (only with servers)

        listed = list_servers(config, spool)
        facts.append(
            "mcp servers "
            + ", ".join(f"{name} ({len(tools)} tools)" for name, tools in listed.items())
        )
    if set_hooks := [name for name, command in vars(config.hooks).items() if command]:
        facts.append(f"hooks {', '.join(set_hooks)}")
    if config.source is None:
        looked = f"{config_module.user_config_path()} or {config_module.SYSTEM_CONFIG}"
        facts.insert(0, f"no file at {looked}")
    print(f"{source}: ok ({'; '.join(facts)})")
    return 0


def _console_tls(config: Config) -> str:
    """`` over TLS`` when the console's certificate and key load (as its process loads
    them); a ConfigError in one line when they do not."""
    if not config.console.tls:
        return ""
    from supervisor.console.server import tls_context  # noqa: PLC0415  (ssl: only this check needs it)

    try:
        tls_context(config.console)
    except ConfigError as exc:
        raise ConfigError(f"{config.source}: {exc}.") from None
    return " over TLS"


def cmd_tools(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import toollist  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.task is not None:
        rows = toollist.task_tools(existing_task(spool, args.task), config)
    else:
        rows = toollist.every_tool(config, spool)
    if args.json:
        out(rows)
    else:
        print(toollist.table(rows))
    return 0


def cmd_unit(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import unit  # noqa: PLC0415  (only this command needs it: the CLI starts fast)
    from worker.config import CONFIG_ENV, SYSTEM_CONFIG  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

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
        )
        for warning in unit.home_warnings(install):
            print(f"agentd: warning: {warning}", file=sys.stderr)
    print(unit.render(install, user=args.user, allow_jit=args.allow_jit), end="")
    return 0


def cmd_completion(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import clidoc  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    print(clidoc.completion(build_parser(), args.shell), end="")
    return 0


def cmd_demo(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.demo import run_cluster_demo, run_demo  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    if args.cluster:
        if args.keep:
            raise UsageError("agentd demo --cluster keeps nothing: its database goes with it.")
        postgres_store()  # its nodes need psycopg: said here, before a server is started
        return run_cluster_demo()
    return run_demo(keep=args.keep)


# -- parser -----------------------------------------------------------------------------


def build_parser() -> Parser:
    """The whole command line; ``supervisor.clidoc`` renders completion and the man page
    from it, so every option and positional carries a help line (a test checks)."""
    parser = Parser(prog="agentd", description="Keeps long-running LLM agent workers alive.")
    parser.add_argument("--version", action="version", version=f"agentd {__version__}")
    parser.add_argument("--spool", metavar="DIR", help="spool folder (env AGENTD_SPOOL)")
    parser.add_argument("--config", metavar="FILE", help="config file (env AGENTD_CONFIG)")
    parser.add_argument(
        "--store",
        metavar="URL",
        help="a postgresql:// URL shared by several nodes (env AGENTD_STORE; default: the spool)",
    )
    parser.add_argument(
        "--node", metavar="NAME", help="this node's name on a shared store (env AGENTD_NODE)"
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=None,
        metavar="FORMAT",
        help="daemon log lines (default: console on a terminal, else json)",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="command"
    )

    def command(
        name: str,
        handler: Handler,
        help_text: str,
        *,
        reads_spool: bool = True,
        reads_config: bool = True,
        uses_store: bool = True,
    ) -> Parser:
        """A subcommand. ``reads_spool``: a spool the operator names must exist.
        ``reads_config``: the config is loaded (and must be valid) before it runs.
        ``uses_store``: it works on the shared store when one is given (``--store``)."""
        p: Parser = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(
            handler=handler,
            reads_spool=reads_spool,
            reads_config=reads_config,
            uses_store=uses_store and reads_config,
        )
        return p

    def task_arg(p: Parser, *, optional: bool = False) -> None:
        if optional:
            p.add_argument("task", nargs="?", metavar="TASK", help="one task (default: all)")
        else:
            p.add_argument("task", metavar="TASK", help="the task id")

    def json_flag(p: Parser, what: str) -> None:
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON")

    p = command("start", cmd_start, "run the supervisor in the foreground", reads_spool=False)
    p.add_argument("--detach", action="store_true", help="run in the background once ready")
    p.add_argument(
        "--log-file",
        help="append the daemon's log to this file, reopened on SIGHUP (--detach: "
        "SPOOL/supervisor.log)",
    )
    command("stop", cmd_stop, "stop the running supervisor gracefully", uses_store=False)

    def task_options(p: Parser, *, resume: bool = False) -> None:
        """``submit``'s options, which ``run`` takes too (``resume``: and ``--resume``, which
        refuses the others, so their defaults are applied later)."""
        p.add_argument("--prompt", metavar="TEXT", help="the task's first user message")
        p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
        if resume:
            p.add_argument("--resume", metavar="TASK", help="carry an interrupted task on")
        p.add_argument("--name", metavar="ID", help="the task id (default: generated)")
        p.add_argument(
            "--model", metavar="NAME", help="model name, or 'scripted' (default: config)"
        )
        p.add_argument(
            "--script", metavar="FILE", help="run on the scripted model with FILE's responses"
        )
        p.add_argument("--tools", metavar="LIST", help="comma-separated tool names (default: all)")
        p.add_argument("--system", metavar="TEXT", help="the system prompt")
        p.add_argument(
            "--max-turns",
            type=int,
            default=None if resume else 100,
            metavar="N",
            help="stop after N turns (default 100)",
        )
        p.add_argument(
            "--workspace", metavar="DIR", help="the task's working folder (default: in the spool)"
        )
        p.add_argument(
            "--budget-usd",
            metavar="X",
            help="hold the task once it has spent X US dollars (none: no limit; default [budget])",
        )
        p.add_argument(
            "--budget-tokens",
            metavar="N",
            help="hold the task once it has spent N tokens (none: no limit; default [budget])",
        )

    p = command("submit", cmd_submit, "submit a task; prints its id", reads_spool=False)
    task_options(p)
    p = command(
        "run",
        cmd_run,
        "run one task in the foreground, no daemon needed",
        reads_spool=False,
        uses_store=False,  # (refused on a shared store: `cmd_run`)
    )
    task_options(p, resume=True)
    json_flag(p, "the transcript, one object a line")
    p = command("status", cmd_status, "show the supervisor and every task")
    task_arg(p, optional=True)
    json_flag(p, "the supervisor and the tasks")
    p.add_argument(
        "--watch",
        action="store_true",
        help="redraw until Ctrl-C (not on a terminal: one snapshot after another)",
    )
    p.add_argument(
        "--interval", type=float, metavar="S", help="with --watch: seconds between (default 2)"
    )
    p = command("dangling", cmd_dangling, "list held dangling calls")
    task_arg(p, optional=True)
    json_flag(p, "the held calls")
    p = command("approve-dangling", cmd_approve, "decide a held call (default: re-run it)")
    task_arg(p)
    p.add_argument("call_id", nargs="?", metavar="CALL_ID", help="the held call (or --all)")
    p.add_argument("--all", action="store_true", help="decide every held call of the task")
    p.add_argument("--skip", action="store_true", help="do not run it; the model gets an error")
    p.add_argument("--reason", metavar="TEXT", help="with --skip: why, for the model")
    p.add_argument("--result", metavar="TEXT", help="do not run it; record this verified outcome")
    p.add_argument("--result-file", metavar="FILE", help="as --result, read from FILE")
    p = command("logs", cmd_logs, "a task's lifecycle events and a line per turn")
    task_arg(p)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the task ends")
    p.add_argument(
        "-n",
        "--lines",
        type=int,
        metavar="N",
        help="only the last N lines (with --follow: to begin)",
    )
    json_flag(p, "each line (an event as stored, or a turn)")
    p = command("cancel", cmd_cancel, "stop a task for good")
    task_arg(p)
    p = command("retry", cmd_retry, "give a failed task a fresh restart budget")
    task_arg(p)
    p = command("budget", cmd_budget, "set or remove a task's budget; a task held on it resumes")
    task_arg(p)
    p.add_argument("--usd", metavar="X", help="the most it may spend, in US dollars (or none)")
    p.add_argument("--tokens", metavar="N", help="the most tokens it may spend (or none)")
    p = command("show", cmd_show, "what the model said and what each tool returned")
    task_arg(p)
    p.add_argument("--turn", type=int, metavar="N", help="only turn N (0: the prompt)")
    json_flag(p, "one line a message part: text, tool_use, tool_result, compaction, hold, decision")
    p = command(
        "tools",
        cmd_tools,
        "every tool a task can get, with its effect class and where that came from",
        reads_spool=False,
    )
    p.add_argument(
        "task",
        nargs="?",
        metavar="TASK",
        help="the list recorded for this task (default: every tool; each MCP server started once)",
    )
    json_flag(p, "the tools")
    p = command("history", cmd_history, "a task's checkpoints, one row per turn")
    task_arg(p)
    json_flag(p, "the rows")
    p = command("rewind", cmd_rewind, "put a task back to the scene after a turn")
    task_arg(p)
    p.add_argument("--to", type=int, required=True, metavar="TURN", help="the turn to go back to")
    p.add_argument("--restore-workspace", action="store_true", help="also restore files (git)")
    p.add_argument("--yes", action="store_true", help="rewind past calls it cannot undo")
    p = command("fork", cmd_fork, "a new task starting from the scene after a turn")
    task_arg(p)
    p.add_argument("--at", type=int, required=True, metavar="TURN", help="the turn to start from")
    p.add_argument("--name", metavar="ID", help="the new task's id (default: generated)")
    p.add_argument("--prompt", metavar="TEXT", help="an extra user message for the fork")
    p = command("console", cmd_console, "the console's URL with a one-time login; API tokens")
    p.add_argument("--token", action="store_true", help="mint a long-lived API token")
    p.add_argument("--list-tokens", action="store_true", help="list the API tokens kept")
    p.add_argument("--revoke", metavar="ID", help="revoke the API token ID")
    p = command("nodes", cmd_nodes, "the nodes that share the store")
    json_flag(p, "the nodes")
    p = command("store", cmd_store, "the shared store's schema", reads_spool=False)
    p.add_argument("action", choices=("init",), metavar="init", help="create or migrate the schema")
    p = command(
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
    p = command(
        "init", cmd_init, "write a commented default config", reads_spool=False, reads_config=False
    )
    p.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="where (default: $XDG_CONFIG_HOME/agentd/agentd.toml)",
    )
    p.add_argument("--system", action="store_true", help="write /etc/agentd/agentd.toml")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p = command(
        "config",
        cmd_config_check,
        "validate the configuration",
        reads_spool=False,
        uses_store=False,
    )
    p.add_argument(
        "action", choices=("check",), metavar="check", help="validate and report the file read"
    )
    p.add_argument(
        "file", nargs="?", metavar="FILE", help="the file to check (default: the one found)"
    )
    p = command(
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
    p = command(
        "completion",
        cmd_completion,
        "print a shell completion script",
        reads_spool=False,
        reads_config=False,
    )
    p.add_argument(
        "shell", choices=("bash", "zsh", "fish"), metavar="SHELL", help="bash, zsh or fish"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        config = (
            load_config(Path(args.config) if args.config else None)
            if args.reads_config
            else Config()
        )
        spool = resolve_spool(args, config)
        if args.reads_spool:
            check_named_spool(args)
        if (args.command == "start" and not args.detach) or args.command == "run":
            # First of all: a secret in this process's environment (the API key, the
            # store's URL) is moved out of it (the process executes itself again, same
            # pid, the secrets handed over through a pipe), so that no tool can read it
            # from /proc/PID/environ; then the daemon holds it in memory only.
            credentials.take_over()
        url = store_url(args, config, spool) if args.uses_store else None
        try:
            if url is not None:
                use_shared(
                    url,
                    node=node_name(args, config),
                    lease=config.cluster.lease,
                    migrate=args.command in ("start", "store"),
                )
            handler: Handler = args.handler
            return handler(args, config, spool)
        except (StorageError, ConfigError) as exc:  # (the login refused: a ConfigError)
            recorded = recorded_store(spool.root)
            if recorded is None or url != recorded or "refused the login" not in str(exc):
                raise
            raise ConfigError(
                f"this spool is a node of the store {recorded} (recorded at its start), "
                "and no password for it was found or it was refused: put it in ~/.pgpass "
                "or $PGPASSFILE, or give the whole URL with --store, $AGENTD_STORE or "
                "$AGENTD_STORE_FILE."
            ) from None
    except AgentdError as exc:
        print(f"agentd: {_one_line(without_password(str(exc)))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a spool, config or file named on the command line is unusable
        where = f"{exc.filename}: " if exc.filename else ""
        print(
            _one_line(f"agentd: {where}{exc.strerror or exc}; check the path and its permissions."),
            file=sys.stderr,
        )
        return 1


#: The longest error line: past it, the line is cut (``_one_line``).
ERROR_LINE_LIMIT = 1000


def _one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (an argument or a
    path from the user may hold them): an error is always exactly one line, and never
    longer than ``ERROR_LINE_LIMIT`` (a value in it may be as long as the user made it)."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(line) <= ERROR_LINE_LIMIT:
        return line
    return f"{line[: ERROR_LINE_LIMIT - 40]}... (cut: {len(line)} characters in all)"
