"""Long journals for tests and benchmarks, written as a worker would have written them.

``long_journal`` appends ``turns`` turns to a task's journal, each an assistant answer of
``body`` text with one ``read_file`` call, its intent and its result (``body`` again):
what a task of a thousand turns looks like to ``history``, ``show``, ``rewind``, ``fork``
and the console, made in a second instead of a thousand model calls.
"""

from __future__ import annotations

from pathlib import Path

from worker.store.journal import Journal


def long_journal(path: Path, task: str, turns: int, body: str = "y" * 900) -> None:
    """Append ``turns`` turns (from turn 1) to the journal at ``path`` of task ``task``."""
    journal, _ = Journal.open(path, task=task)
    with journal:
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
