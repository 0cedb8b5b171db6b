"""The event vocabulary (``worker.events.Event``), read from the code and the docs: every
event agentd says is named by a member, never by a bare string, and each member is said
somewhere, documented in docs/reference/events.md, and among them are all the names
docs/design.md section 8 promises."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import pytest

from tests.codewalk import REPO, SOURCES, compared_with, found_in_code, texts
from worker.events import Event, event_line

#: The calls whose first argument is an event's name: the daemon's and ``agentd run``'s
#: ``emit``/``event``, a worker's ``Recorder.event``, the console's, structlog's methods.
EMITTERS = frozenset(
    {"emit", "event", "_event", "event_line", "info", "warning", "error", "debug", "critical"}
)
#: Where the name is in the calls that take a store or a path first.
POSITION = {"record_event": 2, "append_event": 1}
#: What an event's name looks like: two or more words joined by ``_``.
NAME = re.compile(r"[a-z]+(?:_[a-z0-9]+)+")
NAMES = frozenset(Event)


def bare_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Where ``tree`` names an event by a string: said, compared, or put in a line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            at = POSITION.get(called or "", 0 if called in EMITTERS else None)
            if at is not None and len(node.args) > at:
                for text in texts(node.args[at]):
                    if text in NAMES or NAME.fullmatch(text):
                        yield node.lineno, text
        elif isinstance(node, ast.Compare):
            yield from ((node.lineno, text) for text in compared_with(node, "event"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if texts(key) == ["event"]:
                    yield from ((node.lineno, text) for text in texts(value))


def test_the_finder_sees_each_way_of_naming_an_event_by_a_string() -> None:
    """The check below can fail: each form it looks for, written with a string, is found."""
    source = """
log.warning("worker_hung", pid=1)
daemon.emit("something_new", slot)
record_event(store, task, "task_done")
if event.get("event") == "worker_killed": pass
line = {"event": "console_failed"}
log.warning("a message, not a name")
daemon.emit(Event.WORKER_HUNG, slot)
"""
    assert [text for _, text in bare_names(ast.parse(source))] == [
        "worker_hung",
        "something_new",
        "task_done",
        "worker_killed",
        "console_failed",
    ]


def test_no_event_is_named_by_a_bare_string() -> None:
    found = found_in_code(bare_names)
    assert found == [], "name these events by worker.events.Event:\n" + "\n".join(found)


def test_every_event_is_said_somewhere() -> None:
    """A member no code uses is a name the docs promise and nothing says."""
    code = "\n".join(p.read_text() for p in SOURCES if p != REPO / "worker" / "events.py")
    unsaid = [e.name for e in Event if not re.search(rf"\bEvent\.{e.name}\b", code)]
    assert unsaid == []


def _reference_rows() -> list[str]:
    text = (REPO / "docs" / "reference" / "events.md").read_text()
    return re.findall(r"^\| `([a-z0-9_]+)` \|", text, re.MULTILINE)


def test_the_reference_documents_every_event_once_and_nothing_else() -> None:
    rows = _reference_rows()
    assert sorted(rows) == sorted(e.value for e in Event)
    assert len(rows) == len(set(rows))


def test_the_design_s_names_are_all_events() -> None:
    """docs/design.md section 8 names the events operators build on; each is a member."""
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("## 8.", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", section))
    assert named, "section 8 names events"
    assert named - {e.value for e in Event} <= {"on_held", "on_failed", "on_done"}


@pytest.mark.parametrize("event", [Event.TASK_DONE, Event.SPAN])
def test_an_event_is_written_and_read_back_as_its_name(event: Event) -> None:
    import json

    line = json.loads(json.dumps(event_line(event, reason="x")))
    assert line["event"] == event.value and Event(line["event"]) is event
