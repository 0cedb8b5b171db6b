"""Compaction: how a transcript that outgrows the context window becomes a summary and
the latest turns (docs/design.md section 4).

The pure half of it lives here: where the transcript is cut, what the summary call is
asked, and what the next request holds. The loop (``worker.loop``) decides when, makes
the call and records a ``compaction`` record; the fold (``worker.state``) applies the
record with ``compacted``, so a resume and a live worker build the same transcript.

The cut is always just before an assistant message that follows a user message (or at
the end), so every tool_use stays in the same part as the user message that answers it,
and the compacted transcript alternates roles: the first user message carries the
original prompt and the summary, then come the kept turns, starting with an assistant
message.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.models.base import JSON
from worker.store.durable import dump_json

SUMMARY_INSTRUCTION = """\
Your context window is nearly full. Write a summary of the conversation so far that will \
replace it: you will continue the task from the original request, this summary and the \
latest turns, and nothing else. Do not call any tool; answer with the summary only, as \
plain text, starting with a one-line headline of where the task stands. Cover:
1. The goal: what the user asked for, with every requirement and constraint they set.
2. What was done and decided, and why, including approaches that failed and must not be \
tried again.
3. Files and external effects so far: every file created, changed or deleted (with paths), \
every command run for its effect, every message sent or resource created outside the \
workspace, so that none is repeated or forgotten.
4. Open threads: questions not yet answered, errors not yet fixed, work begun and not \
finished.
5. The next step, precisely enough to take it at once.
Keep exact names, paths, identifiers and numbers; drop tool output that no longer matters."""

SUMMARY_HEADER = "Summary of the earlier part of this task (it replaces those turns):"


def cut(messages: Sequence[JSON], keep_turns: int) -> int | None:
    """The index of the first kept message when ``messages`` keeps at least its last
    ``keep_turns`` turns verbatim, or None when that leaves nothing to summarise.

    A cut is just before an assistant message that follows a user message, or at the
    end, so a tool_use and its tool_result are never split; when the natural cut falls
    between two assistant messages (after a ``pause_turn``), one more turn is kept."""
    cuts = [
        i
        for i in range(2, len(messages) + 1)
        if i == len(messages)
        or (messages[i]["role"] == "assistant" and messages[i - 1]["role"] == "user")
    ]
    for at in reversed(cuts):
        if sum(m["role"] == "assistant" for m in messages[at:]) >= keep_turns:
            return at
    return None


def summary_messages(prefix: Sequence[JSON], instruction: str) -> list[JSON]:
    """The summary call's transcript: ``prefix`` and the instruction as a last user
    text block (in the last user message, so roles keep alternating)."""
    ask = {"type": "text", "text": instruction}
    messages = [dict(m) for m in prefix]
    if messages[-1]["role"] == "user":
        messages[-1] = {"role": "user", "content": [*messages[-1]["content"], ask]}
    else:
        messages.append({"role": "user", "content": [ask]})
    return messages


def instruction(extra: str) -> str:
    """The summary instruction, with ``[context] instructions`` after it when set."""
    return f"{SUMMARY_INSTRUCTION}\n\n{extra.strip()}" if extra.strip() else SUMMARY_INSTRUCTION


def compacted(prompt: str, summary: str, kept: Sequence[JSON]) -> list[JSON]:
    """The transcript after a compaction: the prompt and the summary, then ``kept``."""
    first: JSON = {
        "role": "user",
        "content": [
            {"type": "text", "text": prompt},
            {"type": "text", "text": f"{SUMMARY_HEADER}\n\n{summary}"},
        ],
    }
    return [first, *kept]


def summary_text(content: Sequence[JSON]) -> str:
    """The text of a summary reply (any tool_use it holds is ignored)."""
    text = "\n".join(str(b.get("text", "")) for b in content if b.get("type") == "text").strip()
    return text or "(the model returned an empty summary)"


def estimate_tokens(before: int, old: Sequence[JSON], new: Sequence[JSON]) -> int:
    """``tokens_used`` after a compaction, until the next call measures it: ``before``
    scaled by how much smaller the transcript became (its JSON size)."""
    old_size = len(dump_json(list(old)))
    return round(before * len(dump_json(list(new))) / old_size) if old_size else before
