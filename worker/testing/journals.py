"""Long journals for tests and benchmarks, written as a worker would have written them.

``long_journal`` appends ``turns`` turns to a task's journal, each an assistant answer of
``body`` text with one ``read_file`` call, its intent and its result (``body`` again):
what a task of a thousand turns looks like to ``history``, ``show``, ``rewind``, ``fork``
and the console, made in a second instead of a thousand model calls.
"""

from __future__ import annotations

from worker.store.base import TaskStore


def long_journal(store: TaskStore, task: str, turns: int, body: str = "y" * 900) -> None:
    """Append ``turns`` turns (from turn 1) to the journal of ``task`` in ``store``, as its
    owner (through the store, as a worker writes: any backend)."""
    owner = store.acquire(task)
    journal, _ = store.open_journal(owner)
    try:
        for turn in range(1, turns + 1):
            cid = f"toolu_{turn:05d}"
            message = {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": body},
                    {"type": "tool_use", "id": cid, "name": "read_file", "input": {"path": "a"}},
                ],
            }
            journal.append(
                [
                    {"k": "turn", "turn": turn, "message": message, "stop_reason": "tool_use",
                     "usage": {"input_tokens": 10, "output_tokens": 5}, "at": "t"},
                    {"k": "intent", "call_id": cid, "tool": "read_file", "effect": "read_only",
                     "key": f"agentd-{turn:032x}", "attempt": 1, "at": "t"},
                    {"k": "result", "call_id": cid, "content": body, "is_error": False, "at": "t"},
                ],
                sync=False,
            )  # fmt: skip
        journal.sync()
    finally:
        journal.close()
        store.release(owner)


#: The call ``held_call`` leaves dangling.
HELD_CALL = "toolu_held"


def held_call(store: TaskStore, task: str, turn: int) -> None:
    """Append turn ``turn`` to ``task``'s journal: one unsafe ``append_file`` call whose
    intent was recorded and whose result never was, held for an operator (as a worker
    that resumed after a crash inside the call leaves it)."""
    owner = store.acquire(task)
    journal, _ = store.open_journal(owner)
    message = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": HELD_CALL, "name": "append_file", "input": {}}],
    }
    try:
        journal.append(
            [
                {"k": "turn", "turn": turn, "message": message, "stop_reason": "tool_use",
                 "usage": {"input_tokens": 1, "output_tokens": 1}, "at": "t"},
                {"k": "intent", "call_id": HELD_CALL, "tool": "append_file", "effect": "unsafe",
                 "key": "agentd-" + "f" * 32, "attempt": 1, "at": "t"},
                {"k": "hold", "calls": [{"call_id": HELD_CALL, "attempt": 1,
                 "tool": "append_file", "why": "unsafe: its outcome is unknown"}], "at": "t"},
            ],
            sync=True,
        )  # fmt: skip
    finally:
        journal.close()
        store.release(owner)
