"""What a task has spent, what it may spend, and the price table between the two.

docs/design.md section 13. A task's spend is the tokens of every model call it recorded, by
model (``TaskState.spend_total``: every branch, summary calls included; a fork starts from
its parent's branch at the fork point). Its cost is the sum over those models of integer
tokens times the model's price, computed exactly (``Decimal``) and only rounded when shown:
``cost_usd`` to 6 decimals, the budget's reason up to the cent. Both are functions of the
journal alone, so a restart, a lost reply or a compaction can never count a call twice:
only recorded calls count, and each is recorded once.

A budget (``Budget``: USD, tokens or both) comes from ``submit --budget-usd/--budget-tokens``
or ``[budget]``, and ``agentd budget`` replaces it: each change is a numbered decision of
the task (``BUDGET_KEY``, number 1, 2, ...), written once through the task's store, and the
latest one is the budget. The worker checks it before every model call
(``TaskBudget``, the loop's): once the spend is at or past it, the task is held, with no held call,
until an operator raises the budget (the overshoot is at most the one call that crossed it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from worker.errors import ConfigError
from worker.models.base import JSON, Usage

#: When the built-in prices were read off the published price lists (USD, standard
#: service: no batch discount, no regional multiplier).
PRICES_TAKEN = "2026-12-03"

#: The decisions that change a task's budget: ``BUDGET_KEY`` with numbers 1, 2, ... (a
#: call's idempotency key is ``agentd-`` and hex: it never takes this name).
BUDGET_KEY = "budget"

MILLION = Decimal(1_000_000)

#: Usage by model: what a task spent (``TaskState.spend``, ``spend_total``).
Spend = dict[str, Usage]


@dataclass(frozen=True)
class Price:
    """USD per million tokens of each kind of a model's usage."""

    input: Decimal
    output: Decimal
    cache_write: Decimal  # a 5-minute cache write
    cache_write_1h: Decimal
    cache_read: Decimal

    @classmethod
    def of(cls, *rates: float | str) -> Price:
        return cls(*(Decimal(str(rate)) for rate in rates))

    def cost(self, usage: Usage) -> Decimal:
        """What ``usage`` costs, exactly."""
        short_writes = usage.cache_creation_input_tokens - usage.cache_creation_1h_input_tokens
        return (
            usage.input_tokens * self.input
            + usage.output_tokens * self.output
            + short_writes * self.cache_write
            + usage.cache_creation_1h_input_tokens * self.cache_write_1h
            + usage.cache_read_input_tokens * self.cache_read
        ) / MILLION


#: USD per million tokens by model-name prefix (the longest matching prefix wins), as
#: published on ``PRICES_TAKEN``: input, output, 5-minute and 1-hour cache writes, cache
#: reads. ``[prices."PREFIX"]`` in the config adds to them and overrides them. A model
#: whose price depends on more than its tokens is left out (Claude Haiku 5.5 is priced by
#: the length of each prompt, in two bands): give it a ``[prices]`` table of your own.
BUILTIN_PRICES: Mapping[str, Price] = MappingProxyType(
    {
        "claude-fable-5-2": Price.of(8, 40, 10, 16, 0.2),
        "claude-mythos-5-2": Price.of(8, 40, 10, 16, 0.2),
        "claude-fable-5-1": Price.of(10, 50, 12.5, 20, 0.25),
        "claude-mythos-5-1": Price.of(10, 50, 12.5, 20, 0.25),
        "claude-fable-5": Price.of(10, 50, 12.5, 20, 1),
        "claude-mythos-5": Price.of(10, 50, 12.5, 20, 1),
        "claude-opus-5-5": Price.of(4, 20, 5, 8, 0.2),
        "claude-opus-5": Price.of(5, 25, 6.25, 10, 0.5),
        "claude-opus-4-8": Price.of(5, 25, 6.25, 10, 0.5),
        "claude-opus-4-7": Price.of(5, 25, 6.25, 10, 0.5),
        "claude-opus-4-6": Price.of(5, 25, 6.25, 10, 0.5),
        "claude-opus-4-5": Price.of(5, 25, 6.25, 10, 0.5),
        "claude-opus-4": Price.of(15, 75, 18.75, 30, 1.5),  # Opus 4 and 4.1
        "claude-sonnet-5-5": Price.of(2, 10, 2.5, 4, 0.1),  # cache reads cut from 0.2 in 2026-10
        "claude-sonnet-5": Price.of(2, 10, 2.5, 4, 0.2),
        "claude-sonnet-4": Price.of(3, 15, 3.75, 6, 0.3),  # Sonnet 4, 4.5 and 4.6
        "claude-haiku-4-5": Price.of(1, 5, 1.25, 2, 0.1),
    }
)

#: The keys of a ``[prices."PREFIX"]`` table, in ``Price``'s order.
PRICE_KEYS = ("input", "output", "cache_write", "cache_write_1h", "cache_read")


def price_table(overrides: Mapping[str, Price]) -> Mapping[str, Price]:
    """The built-in prices with the config's ``[prices]`` over them."""
    return MappingProxyType({**BUILTIN_PRICES, **overrides})


def price_of(model: str, prices: Mapping[str, Price]) -> Price | None:
    """The price of ``model``: the one of its longest matching prefix, or None."""
    matches = [prefix for prefix in prices if model.startswith(prefix)]
    return prices[max(matches, key=len)] if matches else None


def unpriced(models: Iterable[str], prices: Mapping[str, Price]) -> list[str]:
    """The models of ``models`` that have no price."""
    return sorted({m for m in models if price_of(m, prices) is None})


def cost(spend: Mapping[str, Usage], prices: Mapping[str, Price]) -> Decimal | None:
    """What ``spend`` (usage by model) costs, exactly; None when a model that spent
    tokens has no price."""
    total = Decimal(0)
    for model, usage in spend.items():
        price = price_of(model, prices)
        if price is None:
            if tokens(usage):
                return None
            continue
        total += price.cost(usage)
    return total


def usd(amount: Decimal | None) -> float | None:
    """``amount`` as status shows it: USD to 6 decimals (``cost_usd``)."""
    if amount is None:
        return None
    return float(amount.quantize(Decimal("0.000001"), ROUND_HALF_EVEN))


def cost_usd(spend: Mapping[str, Usage], prices: Mapping[str, Price]) -> float | None:
    """``cost`` as status shows it: USD to 6 decimals."""
    return usd(cost(spend, prices))


def tokens(usage: Usage) -> int:
    """What a tokens budget counts: input, output, cache writes and cache reads."""
    return (
        usage.input_tokens
        + usage.output_tokens
        + usage.cache_creation_input_tokens
        + usage.cache_read_input_tokens
    )


def total_tokens(spend: Mapping[str, Usage]) -> int:
    return sum(tokens(usage) for usage in spend.values())


def spend_json(spend: Mapping[str, Usage]) -> dict[str, JSON]:
    return {model: usage.to_json() for model, usage in spend.items()}


def spend_from_json(data: Any) -> dict[str, Usage]:
    """``spend_json``'s inverse; a value that is not its shape gives no spend (a heartbeat
    is spool content: whatever it holds, it is read as counts or not at all)."""
    if not isinstance(data, dict):
        return {}
    spend = {}
    for model, usage in data.items():
        if isinstance(usage, dict) and all(_count(v) for v in usage.values()):
            spend[str(model)] = Usage.from_json(usage)
    return spend


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Budget:
    """A task's budget: USD, tokens, both or neither (None: no limit of that kind)."""

    usd: float | None = None
    tokens: int | None = None

    def to_json(self) -> JSON:
        return {"usd": self.usd, "tokens": self.tokens}

    @classmethod
    def from_json(cls, data: Any) -> Budget:
        """A budget from its JSON (a spec's, a change's); ValueError if it is not one."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError("a budget is an object with usd and tokens")
        usd, count = data.get("usd"), data.get("tokens")
        if usd is not None and not valid_usd(usd):
            raise ValueError(f"budget usd must be a number of at least 0, got {usd!r}")
        if count is not None and not valid_tokens(count):
            raise ValueError(f"budget tokens must be a whole number of at least 0, got {count!r}")
        return cls(None if usd is None else float(usd), count)

    def __bool__(self) -> bool:
        return self.usd is not None or self.tokens is not None

    def reached(self, spend: Mapping[str, Usage], prices: Mapping[str, Price]) -> str | None:
        """Why ``spend`` is at or past this budget (the hold's reason), or None: ``budget:
        $1.35 of $1.00`` (the spend rounded up to the cent) or ``budget: 120431 of 100000
        tokens``. Spend of a model without a price never counts as within a USD budget."""
        if self.usd is not None:
            spent = cost(spend, prices)
            if spent is None:
                models = ", ".join(unpriced((m for m, u in spend.items() if tokens(u)), prices))
                return (
                    f"budget: no price for {models}, so its spend is not known; "
                    f'add [prices."{models.split(", ")[0]}"] to the config'
                )
            if spent >= Decimal(str(self.usd)):
                return f"budget: ${dollars(spent)} of ${usd_text(self.usd)}"
        if self.tokens is not None:
            used = total_tokens(spend)
            if used >= self.tokens:
                return f"budget: {used} of {self.tokens} tokens"
        return None

    def below(self, spend: Mapping[str, Usage], prices: Mapping[str, Price]) -> str | None:
        """What of this budget is below ``spend`` (``agentd budget`` refuses it), or None."""
        if self.usd is not None:
            spent = cost(spend, prices)
            if spent is not None and Decimal(str(self.usd)) < spent:
                return f"${usd_text(self.usd)} is below the ${dollars(spent)} spent so far"
        if self.tokens is not None and self.tokens < (used := total_tokens(spend)):
            return f"{self.tokens} tokens is below the {used} spent so far"
        return None


#: A cent: the precision amounts are shown at from here up (``budget: $1.35 of $1.00``).
CENT = Decimal("0.01")
#: The precision of a cost (``usd``): what an amount below a cent is shown at.
COST_PRECISION = Decimal("0.000001")


def dollars(amount: Decimal) -> Decimal:
    """``amount`` rounded up to the cent: what a budget's reason shows as spent; an
    amount below a cent at the precision of the cost (rounded up there), so that a
    spend of $0.0012 is not shown as the $0.01 it is not."""
    if 0 < amount < CENT:
        return amount.quantize(COST_PRECISION, ROUND_CEILING).normalize()
    return amount.quantize(CENT, ROUND_CEILING)


def usd_text(limit: float) -> str:
    """A USD budget as the messages show it: to the cent (``1.00``) from a cent up, at the
    precision of the cost below (``0.005``, not the ``0.01`` or ``0.00`` it is not)."""
    if 0 < limit < 0.01:
        return format(Decimal(str(limit)).quantize(COST_PRECISION).normalize(), "f")
    return f"{limit:.2f}"


#: What a budget hold's reason starts with (``Budget.reached``).
HOLD_PREFIX = "budget: "


def budget_hold(reason: str | None) -> bool:
    """Whether a held task's ``reason`` is a budget's (no call waits: ``agentd budget``
    resumes it)."""
    return bool(reason) and str(reason).startswith(HOLD_PREFIX)


def valid_usd(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def valid_tokens(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- changes of a task's budget -------------------------------------------------------------


class Decisions(Protocol):
    """Where a task's budget changes are read: a ``TaskStore``'s decisions."""

    def read_decision(self, task_id: str, key: str, attempt: int) -> JSON | None: ...


def budget_change(store: Decisions, task_id: str, number: int) -> JSON | None:
    """The ``number``-th change of ``task_id``'s budget as written, or None if there is
    none yet; ``Unreadable`` (a ValueError) when it cannot be read, ValueError when it is
    not a change of a budget."""
    data = store.read_decision(task_id, BUDGET_KEY, number)
    if data is not None:
        Budget.from_json(data.get("budget"))
    return data


def current_budget(
    store: Decisions, task_id: str, initial: Budget, known: tuple[Budget, int] | None = None
) -> tuple[Budget, int]:
    """The task's budget now and how many changes made it: the latest change recorded,
    else ``initial`` (its spec's). ``known``, an earlier answer, saves reading the changes
    it had seen again: the changes are numbered, and each is written once."""
    budget, count = known if known is not None else (initial, 0)
    while (change := budget_change(store, task_id, count + 1)) is not None:
        budget, count = Budget.from_json(change.get("budget")), count + 1
    return budget, count


# -- a task's budget, as its worker checks it ----------------------------------------------


class BudgetReached(Exception):
    """Raised before a model call when the task's spend is at or past its budget: the
    task is held (``reason``), nothing recorded for the call it would have made."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Invalid(Protocol):
    """Told of a budget change that cannot be read: where it is and why."""

    def __call__(self, where: str, error: str) -> None: ...


class TaskBudget:
    """A task's budget as its worker reads it: its spec's (``initial``), or the latest
    ``agentd budget`` change, read from where the last read ended (one look-up of the next
    change, per model call). A change that cannot be read is told once (``on_invalid``)
    and the last budget kept."""

    def __init__(
        self,
        store: Decisions,
        task_id: str,
        initial: Budget,
        prices: Mapping[str, Price],
        on_invalid: Invalid,
    ) -> None:
        self.store = store
        self.task_id = task_id
        self.initial = initial
        self.prices = prices
        self.on_invalid = on_invalid
        self._known: tuple[Budget, int] | None = None  # with the number of changes made it
        self._refused = 0  # the change that could not be read, told once

    def current(self) -> Budget:
        """The task's budget now."""
        try:
            self._known = current_budget(self.store, self.task_id, self.initial, self._known)
        except ValueError as exc:
            number = (self._known or (self.initial, 0))[1] + 1
            if self._refused != number:
                self._refused = number
                self.on_invalid(getattr(exc, "where", f"budget change {number}"), str(exc))
            if self._known is None:
                self._known = (self.initial, 0)
        return self._known[0]

    def check_prices(self, model: str, source: Path | None) -> None:
        """A USD budget needs the task's model to have a price (ConfigError: exit 78)."""
        budget = self.current()
        if budget.usd is not None and price_of(model, self.prices) is None:
            where = source or "the config"
            raise ConfigError(
                f"task {self.task_id} has a USD budget, but its model {model!r} has "
                f'no price; add [prices."{model}"] (input, output, cache_write, '
                f"cache_write_1h, cache_read in USD per million tokens) to {where}, or "
                f"remove the budget with `agentd budget {self.task_id} --usd none`."
            )

    def check(self, spend: Mapping[str, Usage]) -> None:
        """``BudgetReached`` when ``spend`` (the whole life, every branch) is at or past
        the budget: checked before every model call, so the call that crossed it is the
        last one (a summary call's spend counts like a turn's)."""
        reason = self.current().reached(spend, self.prices)
        if reason is not None:
            raise BudgetReached(reason)
