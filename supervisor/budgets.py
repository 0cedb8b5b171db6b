"""A task's budget from the operator's side: what it is, what was spent, and ``agentd
budget`` (docs/design.md section 13).

The budget a task starts with is its spec's (``submit --budget-usd/--budget-tokens``, else
``[budget]``); each change is a numbered record in the task's store (``worker.budget``:
``BUDGET_KEY`` 1, 2, ...), written once with who made it (``by``, the Unix user, and
``via``: docs/design.md section 15), and the latest one is the budget. The worker reads
the next change before every model call, so a change reaches a running task at its next
call, and a task held on its budget (a ``held`` task with no held call) is released to the
queue once its new budget is above its spend.

``change_budget`` is the one implementation of the command: the CLI calls it, and so can
any other front (a web console): the same checks, the same refusals, the same record.
Every check is made before anything is written, under the task's operator lock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from supervisor.control import RELEASE_REQUEST, change_record
from supervisor.coordination import operator_lock, ring
from supervisor.decisions import refuse_if_cancelled
from supervisor.operator import Operator, fields_of
from supervisor.record import TaskRecord
from supervisor.status import held_calls, load_state
from supervisor.stores import store_of
from supervisor.submit import existing_task
from worker.budget import (
    BUDGET_KEY,
    Budget,
    Price,
    budget_hold,
    cost,
    current_budget,
    price_of,
    total_tokens,
)
from worker.budget import usd as shown_usd
from worker.config import Config
from worker.errors import ConfigError, StateConflictError, UsageError
from worker.events import Event, record_event, utc_now
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir
from worker.state import TaskState


class Unchanged(Enum):
    """A limit ``agentd budget`` was not asked to change (``None`` removes one)."""

    KEEP = "keep"


KEEP = Unchanged.KEEP


def parse_usd(text: str, option: str = "--usd") -> float | None:
    """``--usd``: US dollars, 0 or more, or ``none`` (no USD limit); UsageError else."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{option} {text!r}: give US dollars (such as 2.50), or none.")
    return value


def parse_tokens(text: str, option: str = "--tokens") -> int | None:
    """``--tokens``: a whole number of tokens, 0 or more, or ``none``; UsageError else."""
    if text.strip().lower() == "none":
        return None
    if not text.strip().isdigit():
        raise UsageError(f"{option} {text!r}: give a whole number of tokens, or none.")
    return int(text)


def task_budget(task: TaskDir) -> Budget:
    """``task``'s budget now: the latest change, else its spec's."""
    store = store_of(task)
    return current_budget(store, task.id, store.load_spec(task.id).budget)[0]


def budget_json(task: TaskDir) -> dict[str, Any]:
    """``budget`` as status shows it (``{"usd": 5.0, "tokens": null}``); one whose changes
    cannot be read shows its spec's."""
    store = store_of(task)
    initial = store.load_spec(task.id).budget
    try:
        return current_budget(store, task.id, initial)[0].to_json()
    except ValueError:
        return initial.to_json()


@dataclass(frozen=True)
class BudgetChange:
    """What ``change_budget`` did: the budget before and after, the spend it was checked
    against, and whether the task was released from a hold on its budget."""

    task: str
    before: Budget
    after: Budget
    cost_usd: float | None
    tokens: int
    number: int  # the change's number (``worker.budget.BUDGET_KEY``)
    resumed: bool
    record: Mapping[str, Any]


def change_budget(
    spool: Spool,
    config: Config,
    task_id: str,
    *,
    usd: float | Unchanged | None = KEEP,
    tokens: int | Unchanged | None = KEEP,
    operator: Operator | None = None,
) -> BudgetChange:
    """Set or remove (``None``) ``task_id``'s USD and token limits, keeping the ones not
    given; refused, with nothing written, for a cancelled task (StateConflictError, exit
    3), a budget below the spend so far (exit 3), and a USD budget whose model has no
    price (ConfigError, exit 78). A task held on its budget whose new budget is above
    its spend goes back to the queue (``resumed``), as its hold's decision."""
    if usd is KEEP and tokens is KEEP:
        raise UsageError("give --usd X (or none) and/or --tokens N (or none).")
    task = existing_task(spool, task_id)
    store = store_of(task)
    prices = config.price_table
    with operator_lock(task):
        refuse_if_cancelled(task, "budget")
        spec = store.load_spec(task.id)
        before, count = current_budget(store, task.id, spec.budget)
        after = Budget(
            before.usd if usd is KEEP else usd, before.tokens if tokens is KEEP else tokens
        )
        state = load_state(task, full=False, spec=spec)
        _check(task, config, spec.model or config.model.name, after, state, prices)
        number = count + 1
        record: dict[str, Any] = {"budget": after.to_json(), "at": utc_now()}
        record |= fields_of(operator)  # who (docs/design.md section 15)
        if not store.record_decision(task.id, BUDGET_KEY, number, record):
            raise StateConflictError(
                f"the budget of task {task.id} was changed by someone else meanwhile; "
                f"`agentd status {task.id}` shows it now, then try again."
            )
        spent = cost(state.spend_total, prices)
        record_event(
            store,
            task.id,
            Event.BUDGET_CHANGED,
            task=task.id,
            budget=after.to_json(),
            before=before.to_json(),
            cost_usd=shown_usd(spent),
            **fields_of(operator),
        )
        resumed = _release(spool, task) if _budget_held(task) else False
    ring(spool, task.id)
    return BudgetChange(
        task.id,
        before,
        after,
        shown_usd(spent),
        total_tokens(state.spend_total),
        number,
        resumed,
        record,
    )


def _check(
    task: TaskDir,
    config: Config,
    model: str,
    budget: Budget,
    state: TaskState,
    prices: Mapping[str, Price],
) -> None:
    if budget.usd is not None and price_of(model, prices) is None:
        where = config.source or "the config"
        raise ConfigError(
            f"task {task.id} runs on {model!r}, which has no price, so a USD budget cannot be "
            f'kept; add [prices."{model}"] (USD per million tokens) to {where}, or give '
            "--tokens instead."
        )
    below = budget.below(state.spend_total, prices)
    if below is not None:
        raise StateConflictError(
            f"task {task.id}: {below}; give a budget of at least what it spent "
            "(`agentd status` shows cost_usd), or none."
        )


def _budget_held(task: TaskDir) -> bool:
    """Whether ``task`` is held on its budget: held, no call waits, a budget's reason."""
    record = TaskRecord.load(task)
    return record.state == TaskStatus.HELD and budget_hold(record.reason) and not held_calls(task)


def _release(spool: Spool, task: TaskDir) -> bool:
    """Queue a task held on its budget: now if no daemon runs, else through the daemon
    (``RELEASE_REQUEST``). A foreground task (``agentd run``) is left held for its next
    ``run --resume`` while a daemon runs, as a decided call is. True once queued or asked."""
    return change_record(spool, task, RELEASE_REQUEST, TaskRecord.release_hold) or (
        not TaskRecord.load(task).foreground
    )


def refuse_decision_on_budget(task: TaskDir) -> None:
    """``approve-dangling`` on a task held on its budget: no call waits, the budget does
    (StateConflictError, exit 3, naming ``agentd budget``)."""
    if _budget_held(task):
        raise StateConflictError(
            f"task {task.id} is held on its budget ({TaskRecord.load(task).reason}), not on a "
            "call; raise "
            f"it with `agentd budget {task.id} --usd X` (or --tokens N, or none)."
        )
