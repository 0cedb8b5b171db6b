"""``agentd run``: one task in the foreground, no daemon needed, its transcript on stdout;
a held call or budget put to the person at the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.commands.context import store_url
from supervisor.commands.parsing import Commands, json_flag
from supervisor.commands.tasks import SUBMIT_OPTIONS, submitted, task_options
from supervisor.coordination import ring
from supervisor.record import TaskRecord
from supervisor.submit import checked_text, existing_task
from worker.config import Config
from worker.errors import UsageError
from worker.protocol import DecisionAction
from worker.spool import Spool


def add_parser(commands: Commands) -> None:
    p = commands.add(
        "run",
        cmd_run,
        "run one task in the foreground, no daemon needed",
        reads_spool=False,
        uses_store=False,  # (refused on a shared store: `cmd_run`)
    )
    task_options(p, resume=True)
    json_flag(p, "the transcript, one object a line")


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
ANSWERS = {"r": DecisionAction.RERUN, "re-run": DecisionAction.RERUN, "s": DecisionAction.SKIP,
           "x": DecisionAction.RESULT} | {str(a): a for a in DecisionAction}  # fmt: skip


def ask_at_terminal(call: dict[str, Any]) -> Any:
    """Put one held call to the person at the terminal (``agentd run``): re-run it, skip it
    with a reason, or record its result; None at the end of input (the task stays held)."""
    from supervisor.hold_prompt import Answer  # noqa: PLC0415  (only `run` needs it)
    from supervisor.status import STAGE_BEFORE  # noqa: PLC0415  (the same)

    shown = json.dumps(call.get("input"), ensure_ascii=False)
    before = call.get("stage") == STAGE_BEFORE  # (asked before it runs: docs/guides/tools.md)
    known = (
        "it has not run: it waits for your approval."
        if before
        else "its outcome is unknown: it may or may not have taken effect."
    )
    print(
        f"‖ held: {call['tool']} ({call.get('effect')}) call {call['call_id']}: {call.get('why')}"
        f"\n    input: {shown[:2000]}\n    {known}",
        file=sys.stderr,
    )
    question = (
        "run it [r], refuse it [s], or record its result [x]? "
        if before
        else "re-run it [r], skip it [s], or record its result [x]? "
    )
    while True:
        choice = _read_answer(question)
        if choice is None:
            return None
        action = ANSWERS.get(choice.strip().lower())
        if action == DecisionAction.RERUN:
            return Answer(DecisionAction.RERUN)
        if action == DecisionAction.SKIP:
            reason = _read_answer("why (the model is told it was not run)? ")
            if reason is None:
                return None
            return Answer(
                DecisionAction.SKIP, reason=checked_text(reason.strip(), "the reason") or None
            )
        if action == DecisionAction.RESULT:
            result = _read_answer("its result (what the model gets)? ")
            if result is None:
                return None
            if result.strip():
                return Answer(
                    DecisionAction.RESULT, result=checked_text(result.rstrip("\n"), "the result")
                )
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
