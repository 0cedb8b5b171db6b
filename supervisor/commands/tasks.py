"""A task's life as the operator sees it: ``agentd submit`` (and the options ``run``
shares), ``agentd status`` (``--watch``), ``agentd logs``, ``agentd show``,
``agentd history``."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from supervisor.commands.context import out, text_or_file
from supervisor.commands.parsing import Command, Commands, json_flag, task_arg
from supervisor.coordination import ring, running_pid, supervisor_info
from supervisor.operator import Operator
from supervisor.overview import status_document
from supervisor.status import load_state
from supervisor.stores import store_for
from supervisor.submit import PROMPT_FILE_LIMIT, existing_task, submit
from worker.config import Config
from worker.errors import UsageError
from worker.spool import Spool, TaskDir


def add_parser(commands: Commands) -> None:
    p = commands.add("submit", cmd_submit, "submit a task; prints its id", reads_spool=False)
    task_options(p)
    p = commands.add("status", cmd_status, "show the supervisor and every task")
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
    p = commands.add("logs", cmd_logs, "a task's lifecycle events and a line per turn")
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
    p = commands.add("show", cmd_show, "what the model said and what each tool returned")
    task_arg(p)
    p.add_argument("--turn", type=int, metavar="N", help="only turn N (0: the prompt)")
    json_flag(p, "one line a message part: text, tool_use, tool_result, compaction, hold, decision")
    p = commands.add("history", cmd_history, "a task's checkpoints, one row per turn")
    task_arg(p)
    json_flag(p, "the rows")


def task_options(p: Command, *, resume: bool = False) -> None:
    """``submit``'s options, which ``run`` takes too (``resume``: and ``--resume``, which
    refuses the others, so their defaults are applied later)."""
    p.add_argument("--prompt", metavar="TEXT", help="the task's first user message")
    p.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    if resume:
        p.add_argument("--resume", metavar="TASK", help="carry an interrupted task on")
    p.add_argument("--name", metavar="ID", help="the task id (default: generated)")
    p.add_argument("--model", metavar="NAME", help="model name, or 'scripted' (default: config)")
    p.add_argument(
        "--script", metavar="FILE", help="run on the scripted model with FILE's responses"
    )
    p.add_argument("--tools", metavar="LIST", help="comma-separated tool names (default: all)")
    p.add_argument(
        "--ask",
        metavar="LIST",
        help="comma-separated tools (names, globs) whose calls wait for approval before they run",
    )
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
        ask=args.ask.split(",") if args.ask is not None else (),
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
    "ask",
)


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
    spec = store_for(spool).load_spec(task.id)
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
