"""The ``agentd`` command line (docs/design.md section 2): the parser, assembled from the
groups of ``supervisor.commands``, and ``main``, which runs the command asked for.

The CLI is a leaf: it alone parses arguments and prints. Everything below it raises
``worker.errors.AgentdError`` subclasses, which ``main`` turns into one line on stderr
and the class's exit code (0 ok, 1 operational, 2 usage, 3 no such task or wrong state,
78 configuration). Commands that change a task work with or without a running daemon:
with one, they write the change durably and ring its inbox; without one, they take the
supervisor lock and apply the change themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence
from pathlib import Path

from supervisor.commands import (
    cluster,
    console,
    conversations,
    daemon,
    housekeeping,
    interventions,
    run,
    setup,
    tasks,
)
from supervisor.commands.context import check_named_spool, node_name, resolve_spool, store_url
from supervisor.commands.parsing import Commands, Handler, Parser
from supervisor.stores import open_shared, recorded_store
from worker import __version__, credentials
from worker.config import Config, load_config
from worker.errors import AgentdError, ConfigError, StorageError
from worker.redactor import without_password
from worker.spool import Spool

#: The groups of commands, each declaring its own (``add_parser``).
GROUPS = (
    daemon,
    tasks,
    run,
    interventions,
    conversations,
    housekeeping,
    cluster,
    console,
    setup,
)

#: The commands in the order ``agentd --help``, the man page and the completions list them.
LISTED = (
    "start",
    "stop",
    "submit",
    "run",
    "status",
    "dangling",
    "approve-dangling",
    "logs",
    "cancel",
    "retry",
    "budget",
    "show",
    "tools",
    "history",
    "rewind",
    "fork",
    "continue",
    "say",
    "prune",
    "archive",
    "restore",
    "console",
    "nodes",
    "store",
    "demo",
    "init",
    "config",
    "unit",
    "completion",
)


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
    commands = Commands()
    for group in GROUPS:
        group.add_parser(commands)
    p = commands.add(
        "completion",
        cmd_completion,
        "print a shell completion script",
        reads_spool=False,
        reads_config=False,
    )
    p.add_argument(
        "shell", choices=("bash", "zsh", "fish"), metavar="SHELL", help="bash, zsh or fish"
    )
    commands.attach(parser, LISTED)
    return parser


def cmd_completion(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor import clidoc  # noqa: PLC0415  (only this command needs it: the CLI starts fast)

    print(clidoc.completion(build_parser(), args.shell), end="")
    return 0


#: The hidden command the completion scripts ask for ids with (``complete``); never
#: listed: it is no command of a person's.
COMPLETE = "__complete"
#: The global options that take a value (what ``complete`` steps over to find a command).
GLOBAL_VALUES = ("--spool", "--config", "--store", "--node", "--log-format")


def complete(argv: Sequence[str]) -> int | None:
    """``agentd [--spool DIR] [--config FILE] __complete tasks`` prints the spool's task
    ids, ``... __complete calls TASK`` the held calls of TASK, one a line: what the shell
    completion scripts offer (``supervisor.clidoc``). Nothing, and exit 0, when there is
    nothing to read; None when ``argv``'s command is another."""
    words = list(argv)
    at = 0
    while at < len(words) and words[at].startswith("-"):
        at += 2 if words[at] in GLOBAL_VALUES else 1
    if at >= len(words) or words[at] != COMPLETE:
        return None
    from supervisor.overview import dangling_rows  # noqa: PLC0415  (only completion needs it)
    from supervisor.submit import listed_tasks  # noqa: PLC0415  (the same)

    what = words[at + 1 :]
    ids: list[str] = []
    with contextlib.suppress(AgentdError, OSError, ValueError, SystemExit):
        with contextlib.redirect_stderr(io.StringIO()):  # (a word argparse refuses)
            args = build_parser().parse_args([*words[:at], "status"])
        config = load_config(Path(args.config) if args.config else None)
        spool = resolve_spool(args, config)
        if what == ["tasks"]:
            ids = [task.id for task in listed_tasks(spool)]
        elif len(what) == 2 and what[0] == "calls":
            ids = [str(row["call_id"]) for row in dangling_rows(spool, what[1])]
    for found in ids:
        print(found)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    completed = complete(sys.argv[1:] if argv is None else argv)
    if completed is not None:
        return completed
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
                # the shared store, handed to everything the command does with the spool
                spool = spool.on(
                    open_shared(
                        url,
                        node=node_name(args, config),
                        lease=config.cluster.lease,
                        migrate=args.command in ("start", "store"),
                    )
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
        finally:
            if spool.shared is not None:
                spool.shared.close()
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
