"""Messages an operator says to a live task (``agentd say``, docs/design.md section 19).

A message is stored through the task's store as a numbered document of its own, written
once: ``MESSAGE_KEY`` with numbers 1, 2, ... (the store's decisions, as budget changes are:
every backend already keeps such documents durably and gives one writer each number). The
worker takes them at each turn boundary, before its next model call
(``worker.loop.AgentLoop``): each message numbered past the highest one any branch of the
journal recorded (``TaskState.said``) becomes a ``user`` record that carries its number,
so it joins the transcript after the current turn's tool results, in the same user
message. A restart folds the record back and never takes the message twice; a rewind to
before it drops it from the live branch, and it is not taken again (``said`` counts every
branch).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

#: The store's name for an operator's messages to a task, numbered 1, 2, ...
MESSAGE_KEY = "message"
#: The most bytes of text one message may hold.
MESSAGE_LIMIT = 1024 * 1024


class Said(TypedDict):
    """A message as stored: its text, when, and who said it (docs/design.md section 15)."""

    text: str
    at: str
    by: NotRequired[str]
    via: NotRequired[str]


def said_fields(data: Any) -> Said:
    """A stored message, checked; ``ValueError`` for one that is not."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise ValueError("a message without its text")
    said: Said = {"text": data["text"], "at": str(data.get("at", ""))}
    if isinstance(by := data.get("by"), str):
        said["by"] = by
    if isinstance(via := data.get("via"), str):
        said["via"] = via
    return said
