"""Conversations (docs/design.md section 19): ``agentd continue``, a done task given a new
instruction."""

from __future__ import annotations

import argparse
import sys

from supervisor.commands.context import text_or_file
from supervisor.commands.parsing import Commands, task_arg
from supervisor.operator import Operator
from supervisor.submit import PROMPT_FILE_LIMIT
from worker.config import Config
from worker.errors import UsageError
from worker.messages import MESSAGE_LIMIT
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add("continue", cmd_continue, "give a done task a new instruction; it runs on")
    task_arg(p)
    p.add_argument("--prompt", metavar="TEXT", help="the new user message")
    p.add_argument("--prompt-file", metavar="FILE", help="as --prompt, read from FILE")
    p = commands.add("say", cmd_say, "add a message to a live task, before its next model call")
    task_arg(p)
    p.add_argument("text", nargs="?", metavar="TEXT", help="the message")
    p.add_argument("--file", metavar="FILE", help="the message, read from FILE")


def cmd_continue(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.conversations import continue_task  # noqa: PLC0415  (only this command)

    if (args.prompt is None) == (args.prompt_file is None):
        raise UsageError("give the new instruction: --prompt TEXT or --prompt-file FILE.")
    prompt = text_or_file(args.prompt, args.prompt_file, "prompt", PROMPT_FILE_LIMIT)
    turn, foreground = continue_task(
        spool, config, args.task, prompt or "", operator=Operator.here()
    )
    print(f"{args.task}: continued after turn {turn}; `agentd logs {args.task} --follow`")
    if foreground:  # (a daemon never starts a task of `agentd run` by itself)
        print(
            f"{args.task} was run with `agentd run`: `agentd run --resume {args.task}` runs it "
            f"on here, `agentd retry {args.task}` hands it to the daemon",
            file=sys.stderr,
        )
    return 0


def cmd_say(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    from supervisor.conversations import say  # noqa: PLC0415  (only this command)

    if (args.text is None) == (args.file is None):
        raise UsageError("give the message: TEXT or --file FILE.")
    text = text_or_file(args.text, args.file, "message", MESSAGE_LIMIT) or ""
    number = say(spool, args.task, text, operator=Operator.here())
    print(f"{args.task}: message {number} added; it joins before the task's next model call")
    return 0
