"""The journal's record kinds (``worker.records.RecordKind``), read from the code and the
docs: no record is written or read back by a bare kind string, the fold has a handler
only for kinds there are, and the architecture page says what each kind carries."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from tests.codewalk import REPO, compared_with, found_in_code, texts
from worker.records import RecordKind
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
