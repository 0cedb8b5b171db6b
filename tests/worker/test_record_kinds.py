"""The words of the journal's records (``worker.records``), read from the code and the
docs: no record's kind (``RecordKind``) or call's outcome (``CallOutcome``) is written or
read back as a bare string, the fold has a handler only for kinds there are, the
architecture page says what each kind carries, and ``agentd show`` lists every outcome."""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterator

from tests.codewalk import REPO, compared_with, found_in_code, reads_key, texts
from tests.support import misshapen
from worker.records import SHAPES, CallOutcome, RecordKind
from worker.state import TaskState
from worker.store.base import record_bytes


def bare_kinds(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Where ``tree`` writes a record's kind as a string, or compares one read back with a
    string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if texts(key) == ["k"]:
                    yield from ((node.lineno, text) for text in texts(value))
        elif isinstance(node, ast.Compare):
            yield from ((node.lineno, text) for text in compared_with(node, "k"))


def bare_outcomes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Where ``tree`` writes a call's outcome as a string (in a record, as an ``outcome=``
    argument or default), or compares one read back with a string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if texts(key) == ["outcome"]:
                    yield from ((node.lineno, text) for text in texts(value))
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "outcome":
                    yield from ((node.lineno, text) for text in texts(keyword.value))
            if reads_key(node, "outcome") and len(node.args) == 2:  # .get("outcome", default)
                yield from ((node.lineno, text) for text in texts(node.args[1]))
        elif isinstance(node, ast.Compare):
            yield from ((node.lineno, text) for text in compared_with(node, "outcome"))
        elif isinstance(node, ast.arguments):
            named = [*node.posonlyargs, *node.args][-len(node.defaults) or len(node.args) :]
            pairs = [*zip(named, node.defaults, strict=False)]
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d]
            for arg, default in pairs:
                if arg.arg == "outcome":
                    yield from ((default.lineno, text) for text in texts(default))


def test_the_finder_sees_each_way_of_naming_a_kind_by_a_string() -> None:
    source = """
recorder.record({"k": "intent", "call_id": c})
if record["k"] == "turn": pass
if record.get("k") in ("base", "rewind"): pass
recorder.record({"k": RecordKind.RESULT})
if record.get("kind") == "text": pass
"""
    assert sorted(text for _, text in bare_kinds(ast.parse(source))) == [
        "base",
        "intent",
        "rewind",
        "turn",
    ]


def test_the_finder_sees_each_way_of_naming_an_outcome_by_a_string() -> None:
    source = """
recorder.record({"k": RecordKind.RESULT, "outcome": "reconciled"})
calls.run(call, attempt=2, outcome="rerun")
shown = record.get("outcome", "ran")
if call.get("outcome") in ("pending", "dangling"): pass
def error_result(call, message, outcome="error"): pass
def run(call, *, attempt, outcome="ran"): pass
calls.run(call, attempt=2, outcome=CallOutcome.RERUN)
"""
    assert sorted(text for _, text in bare_outcomes(ast.parse(source))) == [
        "dangling",
        "error",
        "pending",
        "ran",
        "ran",
        "reconciled",
        "rerun",
    ]


def test_no_call_outcome_is_a_bare_string() -> None:
    found = found_in_code(bare_outcomes)
    assert found == [], "name these outcomes by worker.records.CallOutcome:\n" + "\n".join(found)


def test_agentd_show_s_page_lists_every_outcome() -> None:
    """``supervisor.transcript``'s docstring (what ``agentd show`` prints) names each
    outcome a result line can have."""
    from supervisor import transcript

    doc = transcript.__doc__ or ""
    start = doc.index("``outcome`` (") + len("``outcome`` (")
    listed = doc[start:].split(")", 1)[0]
    shown = set(re.findall(r"``([a-z_]+)``", listed))
    assert shown == {o.value for o in CallOutcome} - {"pending", "dangling"}


def test_no_record_kind_is_a_bare_string() -> None:
    found = found_in_code(bare_kinds)
    assert found == [], "name these kinds by worker.records.RecordKind:\n" + "\n".join(found)


def test_the_fold_handles_only_kinds_there_are() -> None:
    handled = {
        name.removeprefix("_apply_") for name in dir(TaskState) if name.startswith("_apply_")
    }
    assert {"turn", "intent", "result", "rewind"} <= handled
    assert handled - {k.value for k in RecordKind} == set()


def test_the_architecture_page_says_what_each_kind_carries() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    start = text.index("Record kinds (")
    paragraph = text[start : text.index("\n\n", start)]
    described = set(re.findall(r"`([a-z]+)`\s\(", paragraph)) | {"header"}
    assert described == {k.value for k in RecordKind}


def test_a_kind_is_written_as_its_text() -> None:
    """A member is its text in the journal's bytes: what an earlier release wrote and
    what this one writes are the same records."""
    for kind in RecordKind:
        assert record_bytes({"k": kind}) == record_bytes({"k": kind.value})


def test_each_kind_has_one_shape_and_the_check_of_a_shape_can_fail() -> None:
    assert set(SHAPES) == set(RecordKind)
    assert len({id(shape) for shape in SHAPES.values()}) == len(RecordKind)
    intent = {"k": "intent", "call_id": "c1", "tool": "t", "effect": "unsafe", "key": "k1"}
    assert misshapen([{**intent, "attempt": 1, "at": "now"}]) == []  # (``at``: any record's)
    assert misshapen([intent]) == ["intent: 'attempt' is missing"]
    assert misshapen([{**intent, "attempt": True}]) == ["intent: attempt: True is not an int"]
    assert misshapen([{"k": "nope"}]) == ["'nope' is no record kind: {'k': 'nope'}"]
    held = {"k": "hold", "calls": [{"call_id": "c1", "attempt": 1, "tool": "t"}]}
    assert misshapen([held]) == ["hold: calls: 'why' is missing"]


def test_an_intent_carries_no_input() -> None:
    """The input of a call is its turn's ``tool_use`` block, never copied into its intent
    (the issue: two documents said it was, and the code never wrote it)."""
    assert "input" not in typing.get_type_hints(SHAPES[RecordKind.INTENT])
    page = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    assert "its input is in the turn's\n`tool_use` block, not copied" in page
