"""The judge of class 25 (``tests.chaos.approvals``): how a task's ledger of real runs is
tied to the operator's decisions. The campaign itself runs in ``tests/test_campaigns.py``;
here, that each wrong run it exists to find is counted, and a right one is not."""

from __future__ import annotations

from typing import Any

from tests.chaos.approvals import Book, judge_runs


def run(ran: int, decided: int = 0, action: str | None = "rerun") -> dict[str, Any]:
    """A ledger line: a run of attempt ``ran`` begun on the decision of ``decided``."""
    return {"r": ran, "d": decided, "action": action if decided else None}


def test_runs_each_on_a_current_decision_are_right() -> None:
    book = Book(asked=False, accepted={1: "rerun", 2: "rerun"})
    ledger = [run(1), run(2, 1), run(3, 2)]  # the first run, then one on each decision
    assert judge_runs(ledger, book) == (1, 0, [])


def test_an_asked_call_runs_on_its_decision_only() -> None:
    book = Book(asked=True, accepted={1: "rerun"})
    assert judge_runs([run(1, 1)], book) == (1, 0, [])
    most, unsafe, _ = judge_runs([run(1)], book)  # before it was decided
    assert (most, unsafe) == (0, 1)


def test_a_decision_used_twice_is_two_runs_on_it() -> None:
    book = Book(asked=False, accepted={1: "rerun"})
    most, unsafe, _ = judge_runs([run(1), run(2, 1), run(3, 1)], book)
    assert most == 2
    assert unsafe == 1  # (the second is also of an attempt its decision did not answer)


def test_runs_no_operator_made_current_are_unsafe() -> None:
    book = Book(asked=False, accepted={1: "rerun", 3: "skip"}, expired={4})
    book.accepted[4] = "rerun"
    ledger = [
        run(1),
        run(2),  # a second run with no decision at all
        run(3, 2),  # on a decision no command of the operator's was accepted for
        run(4, 3, "skip"),  # on a skip
        run(5, 4),  # on a decision that expired
    ]
    most, unsafe, wrong = judge_runs(ledger, book)
    assert (most, unsafe) == (1, 4), wrong
