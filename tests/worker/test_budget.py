"""Cost and budgets in the worker (docs/design.md section 13): the price table, exact cost,
spend by model through the fold (rewinds, compactions, forks, snapshots), and the loop's
hold before the model call that would go past a budget."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from supervisor.budgets import change_budget
from supervisor.operator import Operator, Via
from tests.support import journal_records, make_loop, of_kind, reply, scripted_task
from tests.support import text as text_block
from tests.support import tool_use as tool_use_block
from worker.budget import (
    BUILTIN_PRICES,
    PRICES_TAKEN,
    Budget,
    Price,
    cost,
    cost_usd,
    price_of,
    price_table,
)
from worker.config import Config, ContextConfig, ModelConfig, load_config
from worker.errors import ConfigError, StateConflictError
from worker.events import read_events
from worker.loop import Outcome
from worker.models.base import Usage
from worker.protocol import ExitCode
from worker.spool import Spool, TaskDir
from worker.state import OutdatedSnapshot, TaskState, fold

#: $3 in, $15 out per million (the Sonnet 4 family): 100,000 in and 10,000 out is $0.45.
MODEL = "claude-sonnet-4-6"
TURN_USAGE = {"input_tokens": 100_000, "output_tokens": 10_000}
CONFIG = Config(model=ModelConfig(name=MODEL))


# -- the price table and the cost -----------------------------------------------------------


def test_the_longest_matching_prefix_wins() -> None:
    assert PRICES_TAKEN.startswith("20")
    sonnet_55 = price_of("claude-sonnet-5-5-20260928", BUILTIN_PRICES)
    sonnet_5 = price_of("claude-sonnet-5-20260630", BUILTIN_PRICES)
    assert sonnet_55 is not None and sonnet_5 is not None
    assert (sonnet_55.cache_read, sonnet_5.cache_read) == (Decimal("0.1"), Decimal("0.2"))
    assert price_of("claude-opus-4-1-20250805", BUILTIN_PRICES) == Price.of(15, 75, 18.75, 30, 1.5)
    assert price_of("claude-opus-4-5", BUILTIN_PRICES) == Price.of(5, 25, 6.25, 10, 0.5)
    assert price_of("gpt-6", BUILTIN_PRICES) is None
    mine = price_table(
        {"claude-opus-4-5": Price.of(1, 2, 3, 4, 5), "claude": Price.of(9, 9, 9, 9, 9)}
    )
    assert price_of("claude-opus-4-5-x", mine) == Price.of(1, 2, 3, 4, 5)  # the config's, over
    assert price_of("claude-haiku-5-5", mine) == Price.of(9, 9, 9, 9, 9)  # its own prefix
    assert price_of("claude-opus-4-8", mine) == BUILTIN_PRICES["claude-opus-4-8"]


def test_cost_is_exact_and_prices_each_kind_of_token_apart() -> None:
    usage = Usage(
        input_tokens=3,
        output_tokens=7,
        cache_creation_input_tokens=11,  # 5 of them to the 1-hour cache
        cache_read_input_tokens=13,
        cache_creation_1h_input_tokens=5,
    )
    price = Price.of(1, 2, 3, 4, 5)
    # 3*1 + 7*2 + 6*3 + 5*4 + 13*5 = 120 millionths, not a float near it
    assert price.cost(usage) == Decimal("0.000120")
    many = {MODEL: Usage(input_tokens=1), "claude-haiku-4-5": Usage(output_tokens=1)}
    assert cost(many, BUILTIN_PRICES) == Decimal("0.000008")  # $3 + $5 per million
    assert cost({"unknown": Usage(input_tokens=1)}, BUILTIN_PRICES) is None
    assert cost({"unknown": Usage()}, BUILTIN_PRICES) == 0  # no tokens, no price needed
    # ten million reads at $0.1: a sum of floats would not land on 1.0 exactly
    reads = {"claude-haiku-4-5": Usage(cache_read_input_tokens=1)}
    total = sum((cost(reads, BUILTIN_PRICES) or Decimal(0)) for _ in range(10_000_000 // 10**6))
    assert total == Decimal("0.0000010")
    assert cost_usd({MODEL: Usage(input_tokens=1)}, BUILTIN_PRICES) == 0.000003


def test_the_reason_rounds_the_spend_up_to_the_cent() -> None:
    budget = Budget(usd=1.0)
    three_turns = {MODEL: Usage(input_tokens=300_000, output_tokens=30_000)}
    assert budget.reached(three_turns, BUILTIN_PRICES) == "budget: $1.35 of $1.00"
    a_bit_more = {MODEL: Usage(input_tokens=300_001, output_tokens=30_000)}  # $1.350003
    assert budget.reached(a_bit_more, BUILTIN_PRICES) == "budget: $1.36 of $1.00"
    assert Budget(usd=1.36).reached(a_bit_more, BUILTIN_PRICES) is None
    assert Budget(usd=1.350003).reached(a_bit_more, BUILTIN_PRICES) is not None  # at it: held
    tokens = Budget(tokens=100_000)
    spent = {MODEL: Usage(120_000, 431, cache_creation_input_tokens=0, cache_read_input_tokens=0)}
    assert tokens.reached(spent, BUILTIN_PRICES) == "budget: 120431 of 100000 tokens"
    cached = {MODEL: Usage(1, 1, cache_creation_input_tokens=1, cache_read_input_tokens=1)}
    assert Budget(tokens=4).reached(cached, BUILTIN_PRICES) == "budget: 4 of 4 tokens"
    assert Budget().reached(a_bit_more, BUILTIN_PRICES) is None
    assert budget.below(three_turns, BUILTIN_PRICES) == "$1.00 is below the $1.35 spent so far"
    assert Budget(usd=1.35).below(three_turns, BUILTIN_PRICES) is None


def test_prices_and_budget_in_the_config(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text(
        '[budget]\nusd = 5\ntokens = 2000000\n[prices."my-model"]\ninput = 2\noutput = 8.5\n'
        '[prices."other"]\ninput = 1\noutput = 1\ncache_write = 0\ncache_write_1h = 0\n'
        "cache_read = 0\n"
    )
    config = load_config(path, environ={})
    assert config.budget == Budget(usd=5.0, tokens=2_000_000)
    # a cache rate left out is the API's usual one: 1.25, 2 and 0.1 times the input's
    assert config.prices["my-model"] == Price.of(2, 8.5, 2.5, 4, 0.2)
    assert config.prices["other"] == Price.of(1, 1, 0, 0, 0)
    assert price_of("claude-opus-5", config.price_table) == BUILTIN_PRICES["claude-opus-5"]
    for bad, where in (
        ('[prices."m"]\ninput = 1\n', "prices.m.output is required"),
        ('[prices."m"]\ninput = -1\noutput = 1\n', "prices.m.input must be USD"),
        ('[prices."m"]\ninput = 1\noutput = 1\ncache = 1\n', "prices.m.cache is not a known key"),
        ("[prices]\nm = 3\n", "prices.m must be a table of rates"),
        ("[budget]\nusd = -1\n", "budget.usd must be a number"),
        ("[budget]\ntokens = 1.5\n", "budget.tokens must be a whole number"),
        ("[budget]\ndollars = 1\n", "budget.dollars is not a known key"),
        ('[model]\nname = "proxy-m"\n[budget]\nusd = 1\n', "budget.usd needs the price of"),
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            load_config(path, environ={})


# -- spend by model, through the fold -----------------------------------------------------


def _turn(n: int, model: str, tokens: int, *, stop: str = "end_turn") -> dict[str, Any]:
    return {
        "k": "turn",
        "turn": n,
        "message": {"role": "assistant", "content": [{"type": "text", "text": f"t{n}"}]},
        "stop_reason": stop,
        "usage": {"input_tokens": tokens, "output_tokens": 1},
        "model": model,
    }


def _user() -> dict[str, Any]:
    return {"k": "user", "content": [{"type": "text", "text": "go on"}]}


def test_spend_counts_every_branch_and_every_summary_call_once() -> None:
    records = [
        {"k": "header"},
        _turn(1, "a", 10),
        _user(),
        _turn(2, "b", 20),
        _user(),
        {
            "k": "compaction",
            "summary": "the story so far",
            "keep": 2,
            "first": 1,
            "last": 1,
            "usage": {"input_tokens": 5, "output_tokens": 1},
            "model": "c",
        },
        _turn(3, "b", 30),
        {"k": "rewind", "to": 1},  # turns 2 and 3 and the compaction leave the branch...
        _user(),
        _turn(2, "a", 40),
    ]
    state = fold("p", records)
    # ...but not the life: every call ever recorded counts once, by its model
    assert state.spend_total == {
        "a": Usage(50, 2),
        "b": Usage(50, 2),
        "c": Usage(5, 1),
    }
    assert state.spend == {"a": Usage(50, 2)}  # the live branch's
    assert sum(state.spend_total.values(), Usage()) == state.usage_total
    again, _ = TaskState.from_snapshot(state.compact().to_snapshot(99))
    assert (again.spend, again.spend_total) == (state.spend, state.spend_total)


def test_a_snapshot_of_format_1_is_a_quiet_miss_and_a_fork_of_0_1_keeps_its_spend() -> None:
    state = fold("p", [{"k": "header"}, _turn(1, "a", 10), _user(), _turn(2, "b", 20)])
    old = state.to_snapshot(7)
    old["v"] = 1
    del old["spend"], old["spend_total"]
    with pytest.raises(OutdatedSnapshot):
        TaskState.from_snapshot(old)
    # a fork's base record of release 0.1: its turns say which model spent what
    forked, _ = TaskState.from_snapshot(old, base=True)
    assert forked.spend_total == {"a": Usage(10, 1), "b": Usage(20, 1)}
    # turns that do not add up to the usage: the usage is kept, under no model
    old["usage"] = {"input_tokens": 99, "output_tokens": 0}
    odd, _ = TaskState.from_snapshot(old, base=True)
    assert odd.spend == {"": Usage(99, 0)}


# -- the loop's hold -------------------------------------------------------------------------


def run(task: TaskDir, config: Config = CONFIG) -> Outcome:
    loop = make_loop(task, config=config)
    try:
        return loop.run()
    finally:
        loop.close()


def tool_turns(count: int) -> list[dict[str, Any]]:
    return [reply(tool_use_block("list_dir"), usage=TURN_USAGE) for _ in range(count)]


def events(task: TaskDir) -> list[dict[str, Any]]:
    return read_events(task.events)


def test_a_dollar_budget_at_45_cents_a_turn_holds_at_turn_3_and_a_raise_resumes_it(
    spool: Spool,
) -> None:
    done = reply(text_block("Done."), usage=TURN_USAGE)
    task = scripted_task(
        spool, [*tool_turns(4), done], config=CONFIG, budget=Budget(usd=1.0), name="dollar"
    )
    outcome = run(task)
    assert outcome == Outcome("held", "budget: $1.35 of $1.00", ExitCode.HELD)
    records = journal_records(task)
    assert len(of_kind(records, "turn")) == 3  # the third call crossed it; no fourth was made
    (hold,) = of_kind(records, "hold")
    assert hold["calls"] == [] and hold["budget"] == "budget: $1.35 of $1.00"
    (exhausted,) = [e for e in events(task) if e["event"] == "budget_exhausted"]
    assert exhausted["level"] == "warning" and exhausted["budget"] == {"usd": 1.0, "tokens": None}
    # a worker started again without a change holds again, before any call
    assert run(task).reason == "budget: $1.35 of $1.00"
    assert len(of_kind(journal_records(task), "turn")) == 3
    change_budget(spool, CONFIG, task.id, usd=3.0, operator=Operator("ops", Via.CLI))
    assert run(task) == Outcome("done", "end_turn", ExitCode.DONE)
    state = fold("p", journal_records(task))
    assert state.turn == 5
    assert cost(state.spend_total, CONFIG.price_table) == Decimal("2.25")  # 5 calls, exactly


def test_a_token_budget_counts_cache_tokens_and_holds_after_the_call_that_reached_it(
    spool: Spool,
) -> None:
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 15}
    turns = [reply(tool_use_block("list_dir"), usage=usage) for _ in range(5)]
    task = scripted_task(spool, turns, config=CONFIG, budget=Budget(tokens=60), name="tok")
    assert run(task) == Outcome("held", "budget: 60 of 60 tokens", ExitCode.HELD)
    assert len(of_kind(journal_records(task), "turn")) == 2


def test_a_summary_call_counts_and_the_hold_comes_before_the_next_turn(spool: Spool) -> None:
    config = dataclasses.replace(
        CONFIG, context=ContextConfig(window=1000, compact_at=0.5, keep_turns=1)
    )
    big = {"input_tokens": 600, "output_tokens": 10}
    turns = [
        reply(text_block("one"), tool_use_block("list_dir"), usage=big),
        reply(text_block("two"), tool_use_block("list_dir"), usage=big),
        reply(text_block("Done."), usage=big),
    ]
    # two turns of 610 tokens, then the summary call's (a few tokens more): the budget is
    # reached by the summary, so the turn after the compaction is never asked for
    task = scripted_task(spool, turns, config=config, budget=Budget(tokens=1221))
    outcome = run(task, config)
    records = journal_records(task)
    assert len(of_kind(records, "compaction")) == 1, [r["k"] for r in records]
    assert outcome.state == "held" and outcome.reason.startswith("budget: ")
    assert len(of_kind(records, "turn")) == 2
    assert [r["k"] for r in records][-2:] == ["compaction", "hold"]


def test_a_usd_budget_for_a_model_without_a_price_is_a_config_error(spool: Spool) -> None:
    task = scripted_task(spool, tool_turns(1), config=CONFIG, budget=Budget(tokens=10))
    with pytest.raises(ConfigError, match="has none; add"):
        scripted_task(
            spool,
            tool_turns(1),
            config=Config(model=ModelConfig(name="my-proxy-model")),
            budget=Budget(usd=1.0),
        )
    # the price table changed under a task that has a USD budget: its worker refuses (78)
    data = json.loads(task.spec.read_text())
    data["budget"]["usd"] = 2.0
    task.spec.write_text(json.dumps(data))
    assert task.load_spec().budget == Budget(usd=2.0, tokens=10)
    outcome = run(task, Config(model=ModelConfig(name="my-proxy-model")))
    assert outcome.exit_code == ExitCode.CONFIG and "[prices." in outcome.reason


def test_a_change_recorded_before_the_next_call_is_the_budget_the_worker_keeps(
    spool: Spool,
) -> None:
    """``agentd budget`` on a task that is not held: the worker reads the change before its
    next model call (a lower budget holds it; ``none`` lifts it), each change once."""
    task = scripted_task(spool, tool_turns(4), config=CONFIG, name="lowered")
    change_budget(spool, CONFIG, task.id, tokens=100_000, operator=Operator("ops", Via.CLI))
    assert run(task).reason == "budget: 110000 of 100000 tokens"  # one call, then held
    assert len(of_kind(journal_records(task), "turn")) == 1
    change = change_budget(spool, CONFIG, task.id, tokens=None)
    assert change.number == 2 and change.before == Budget(tokens=100_000)
    assert change.after == Budget() and change.tokens == 110_000
    with pytest.raises(StateConflictError, match="below the 110000 spent"):
        change_budget(spool, CONFIG, task.id, tokens=50_000)
    assert run(task).state == "failed"  # past the script's end: no budget held it
    assert len(of_kind(journal_records(task), "turn")) == 4
