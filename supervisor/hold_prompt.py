"""A held task put to the person at ``agentd run``'s prompt (docs/design.md section 16).

A held call is asked about through ``ask`` (re-run, skip, record a result), and the answer
recorded as ``agentd approve-dangling`` records it (``decisions.decide``, with ``by`` the
user and ``via`` ``run``); a task held on its budget is asked for a new one through
``ask_budget`` (``agentd budget``'s checks). Without them (no terminal), or with no answer,
the task stays held and the line says what to run next.

An interruption at the prompt (Ctrl-C, the end of input, or a signal the run counts
while ``asking``) ends the run at once (``Interrupted``), the task held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from supervisor.budgets import KEEP, Unchanged, change_budget, task_budget
from supervisor.decisions import decide
from supervisor.operator import Operator, Via
from worker.budget import Budget
from worker.config import Config
from worker.errors import ConfigError, StateConflictError, UsageError
from worker.protocol import DecisionAction
from worker.spool import TaskDir


@dataclass(frozen=True)
class Answer:
    """What a person decided about one held call at the prompt: ``action`` is one of
    ``approve-dangling``'s (``rerun``, ``skip``, ``result``)."""

    action: DecisionAction
    reason: str | None = None
    result: str | None = None


#: Asks about one held call (a row of ``status.held_calls``); None: no answer (the task
#: stays held). KeyboardInterrupt out of it is an interruption.
Ask = Callable[[dict[str, Any]], Answer | None]


@dataclass(frozen=True)
class BudgetAnswer:
    """A new budget typed at the prompt for a task held on its budget: each limit a
    number, None (no limit) or ``KEEP`` (``supervisor.budgets.change_budget``'s)."""

    usd: float | Unchanged | None = KEEP
    tokens: int | Unchanged | None = KEEP


#: Asks for a new budget, given the hold's reason and the budget now; None: no answer.
#: Asked again, with the refusal's line, while the answer is below the spend.
AskBudget = Callable[[str, Budget, str | None], BudgetAnswer | None]


class Interrupted(Exception):
    """Ctrl-C (or SIGHUP, SIGTERM) while no worker runs: the run ends at once."""


class HoldPrompt:
    """Puts ``task``'s hold to the person (``ask``, ``ask_budget``; None: no terminal),
    saying its own lines through ``say``; ``resume_line`` is the command that carries the
    task on. Each of ``calls`` and ``budget`` is True once the person decided (the task
    goes on), False when it stays held (and the line said how to go on)."""

    def __init__(
        self,
        task: TaskDir,
        config: Config,
        say: Callable[[str], None],
        *,
        ask: Ask | None,
        ask_budget: AskBudget | None,
        resume_line: str,
    ) -> None:
        self.task = task
        self.config = config
        self.say = say
        self.ask = ask
        self.ask_budget = ask_budget
        self.resume_line = resume_line
        self.asking = False  # at the prompt: an interruption ends the run at once

    def calls(self, reason: str | None, rows: list[dict[str, Any]]) -> bool:
        """Ask about each held call of ``rows`` (``status.held_calls``), recording each
        answer as a decision."""
        task_id = self.task.id
        if self.ask is None or not rows:
            self.say(
                f"task {task_id} is held: {reason or 'a call waits for a decision'}; "
                f"decide with `agentd approve-dangling {task_id} CALL_ID "
                f"(--rerun | --skip --reason TEXT | --result TEXT)` (`agentd dangling {task_id}` "
                f"lists them), then `{self.resume_line}`."
            )
            return False
        for row in rows:
            with self.at_the_prompt():
                answer = self.ask(row)
            if answer is None:
                self.say(f"task {task_id} stays held; `{self.resume_line}` asks again.")
                return False
            decide(
                self.task,
                row["call_id"],
                action=answer.action,
                reason=answer.reason,
                result=answer.result,
                operator=Operator.here(Via.RUN),
                attempt=row["attempt"],  # the attempt the person was shown
            )
        return True

    def budget(self, reason: str) -> bool:
        """Held on its budget: ask for a new one (``agentd budget``'s checks, recorded with
        ``via: run``), again while it is refused."""
        task_id = self.task.id
        if self.ask_budget is None:
            self.say(
                f"task {task_id} is held: {reason}; raise the budget with `agentd budget "
                f"{task_id} --usd X` (or --tokens N, or none), then `{self.resume_line}`."
            )
            return False
        refusal = None
        while True:
            with self.at_the_prompt():
                answer = self.ask_budget(reason, task_budget(self.task), refusal)
            if answer is None:
                self.say(f"task {task_id} stays held; `{self.resume_line}` asks again.")
                return False
            try:
                change_budget(
                    self.task.spool,
                    self.config,
                    task_id,
                    usd=answer.usd,
                    tokens=answer.tokens,
                    operator=Operator.here(Via.RUN),
                )
            except (StateConflictError, ConfigError, UsageError) as exc:
                refusal = str(exc)
                continue
            return True

    @contextlib.contextmanager
    def at_the_prompt(self) -> Iterator[None]:
        """While the person is asked: an interruption (Ctrl-C, the end of input) ends the
        run at once, the task held."""
        self.asking = True
        try:
            yield
        except (KeyboardInterrupt, EOFError):
            raise Interrupted from None
        finally:
            self.asking = False
