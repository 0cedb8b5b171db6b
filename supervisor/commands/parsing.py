"""How a group of commands declares its commands (``Commands.add``) and how they become
subcommands of the one argparse parser (``Commands.attach``), in the order ``agentd --help``
lists them whatever the order the groups declare them in."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.config import Config
from worker.errors import UsageError
from worker.spool import Spool

Handler = Callable[[argparse.Namespace, Config, Spool], int]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message}; see `{self.prog} --help`.")


@dataclass
class Command:
    """A subcommand as declared: what runs it, its help line and its arguments (each given
    to argparse's ``add_argument`` as written). ``reads_spool``: a spool the operator names
    must exist. ``reads_config``: the config is loaded (and must be valid) before it runs.
    ``uses_store``: it works on the shared store when one is given (``--store``)."""

    name: str
    handler: Handler
    help: str
    reads_spool: bool = True
    reads_config: bool = True
    uses_store: bool = True
    arguments: list[tuple[tuple[str, ...], dict[str, Any]]] = field(default_factory=list)

    def add_argument(self, *flags: str, **options: Any) -> None:
        self.arguments.append((flags, options))


class Commands:
    """The commands the groups declared, by name."""

    def __init__(self) -> None:
        self.declared: dict[str, Command] = {}

    def add(
        self,
        name: str,
        handler: Handler,
        help_text: str,
        *,
        reads_spool: bool = True,
        reads_config: bool = True,
        uses_store: bool = True,
    ) -> Command:
        command = Command(name, handler, help_text, reads_spool, reads_config, uses_store)
        self.declared[name] = command
        return command

    def attach(self, parser: Parser, listed: Sequence[str]) -> None:
        """Every declared command as a subcommand of ``parser``, in the order ``listed``
        (which names each exactly once)."""
        if sorted(listed) != sorted(self.declared):
            raise ValueError(
                f"the commands listed {sorted(listed)} are not those declared "
                f"{sorted(self.declared)}"
            )
        sub = parser.add_subparsers(
            dest="command", required=True, parser_class=Parser, metavar="command"
        )
        for name in listed:
            command = self.declared[name]
            p: Parser = sub.add_parser(name, help=command.help, description=command.help)
            p.set_defaults(
                handler=command.handler,
                reads_spool=command.reads_spool,
                reads_config=command.reads_config,
                uses_store=command.uses_store and command.reads_config,
            )
            for flags, options in command.arguments:
                p.add_argument(*flags, **options)


def task_arg(command: Command, *, optional: bool = False) -> None:
    if optional:
        command.add_argument("task", nargs="?", metavar="TASK", help="one task (default: all)")
    else:
        command.add_argument("task", metavar="TASK", help="the task id")


def json_flag(command: Command, what: str) -> None:
    command.add_argument("--json", action="store_true", help=f"print {what} as JSON")
