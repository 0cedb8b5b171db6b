"""What the model said and what each tool returned: a task's journal as the lines of
``agentd show`` (docs/design.md sections 2 and 16).

A line is one JSON object, ``{"turn": N, "kind": KIND, ...}``, in journal order:

* ``text``: ``role`` (``user`` or ``assistant``) and ``text``: the prompt (turn 0), the
  model's words, a message an operator added;
* ``tool_use``: ``call_id``, ``tool``, ``input``, as the model asked for it;
* ``tool_result``: ``call_id``, ``tool``, ``effect``, ``outcome`` (``ran``, ``rerun``,
  ``reconciled``, ``skipped``, ``operator``, ``error``, ``not_run``, ``inherited``: a
  fork's call, run by the task it was forked from; ``worker.records.CallOutcome``),
  ``is_error`` and ``content``, as recorded (results are redacted before they are
  recorded);
* ``compaction``: the turns it replaced (``first``, ``last``), ``tokens_before``,
  ``tokens_after`` and the ``summary``;
* ``hold``: the ``calls`` held for an operator, each with its ``call_id``, ``tool`` and
  ``why``; a hold on the task's budget holds no call and says why in ``budget``
  (``budget: $1.35 of $1.00``);
* ``decision``: an operator's ``action`` on a held call (``rerun``, ``skip``, ``result``),
  with its ``reason`` or ``result``, and ``by`` and ``via`` where recorded.

With a price table, the first line a model call produced (a turn's first block, a
compaction) carries ``cost_usd``, that call's cost (null when its model has no price).

Only the live branch is shown: a turn a rewind cut, with everything recorded for it, is
left out, as the model no longer sees it. A fork's inherited scene is its first lines.
``task_lines`` reads a task's lines for ``agentd show`` and the console alike, each line
passed through the one redactor (``worker.redactor``): a secret the model wrote in a
tool's input, say, is never shown (results were redacted before they were recorded).
``Renderer`` turns the lines into text for a terminal, the same for ``show`` and for any
command that streams a transcript, so the two never differ.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from supervisor.operator import shown_by
from supervisor.stores import store_for
from supervisor.submit import existing_task
from worker.budget import Price, cost_usd
from worker.errors import NotFoundError, UsageError
from worker.models.base import Usage
from worker.protocol import DecisionAction
from worker.records import CallOutcome, RecordKind
from worker.redactor import redact
from worker.spool import Spool

JSON = dict[str, Any]

#: What a terminal shows of one text, result or input before it is cut (``--json``
#: prints everything).
CUT_AT = 2000


@dataclass
class _Fold:
    """What the lines of one record depend on: each call's turn and tool."""

    turn: int = 0
    calls: dict[str, tuple[int, str]] = field(default_factory=dict)
    effects: dict[str, str] = field(default_factory=dict)

    def of_record(self, record: JSON) -> Iterator[JSON]:
        kind = record.get("k")
        if kind == RecordKind.BASE:
            yield from self._base(record.get("scene") or {})
        elif kind == RecordKind.TURN:
            self.turn = int(record["turn"])
            for block in (record.get("message") or {}).get("content", []):
                yield from self._block(block, "assistant")
        elif kind == RecordKind.USER:
            # an operator's words (``agentd say``, ``continue``) say who and how
            who: JSON = {k: record[k] for k in ("by", "via", "message") if k in record}
            for block in record.get("content", []):
                if block.get("type") == "text":
                    line = {"turn": self.turn, "kind": "text", "role": "user"}
                    yield {**line, "text": block["text"], **who}
        elif kind == RecordKind.INTENT:
            self.effects[str(record["call_id"])] = str(record.get("effect") or "")
        elif kind == RecordKind.RESULT:
            yield self._result(record)
        elif kind == RecordKind.COMPACTION:
            yield {
                "turn": self.turn,
                "kind": "compaction",
                **{k: record.get(k) for k in ("first", "last", "tokens_before", "tokens_after")},
                "summary": str(record.get("summary", "")),
            }
        elif kind == RecordKind.HOLD:
            calls = [
                {k: c.get(k) for k in ("call_id", "tool", "why")} for c in record.get("calls", [])
            ]
            line = {"turn": self.turn, "kind": "hold", "calls": calls}
            yield line | ({"budget": record["budget"]} if record.get("budget") else {})
        elif kind == RecordKind.DECISION:
            call_id = str(record["call_id"])
            turn, tool = self.calls.get(call_id, (self.turn, ""))
            line = {"turn": turn, "kind": "decision", "call_id": call_id, "tool": tool}
            for name in ("action", "reason", "result", "by", "via"):
                if name in record:
                    line[name] = record[name]
            yield line

    def _block(self, block: JSON, role: str) -> Iterator[JSON]:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            yield {"turn": self.turn, "kind": "text", "role": role, "text": block["text"]}
        elif kind == "tool_use":
            call_id = str(block.get("id"))
            self.calls[call_id] = (self.turn, str(block.get("name")))
            yield {
                "turn": self.turn,
                "kind": "tool_use",
                "call_id": call_id,
                "tool": block.get("name"),
                "input": block.get("input"),
            }

    def _result(self, record: JSON) -> JSON:
        call_id = str(record["call_id"])
        turn, tool = self.calls.get(call_id, (self.turn, ""))
        return {
            "turn": turn,
            "kind": "tool_result",
            "call_id": call_id,
            "tool": tool,
            "effect": self.effects.get(call_id) or None,
            "outcome": record.get("outcome", CallOutcome.RAN),
            "is_error": bool(record.get("is_error")),
            "content": record.get("content"),
        }

    def _base(self, scene: JSON) -> Iterator[JSON]:
        """A fork's inherited scene: its messages, numbered by the turns it kept."""
        self.turn = 0
        for message in scene.get("messages", []):
            role = message.get("role")
            if role == "assistant":
                self.turn += 1
            for block in message.get("content", []):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    call_id = str(block.get("tool_use_id"))
                    turn, tool = self.calls.get(call_id, (self.turn, ""))
                    text = _block_text(block.get("content"))
                    yield {
                        "turn": turn,
                        "kind": "tool_result",
                        "call_id": call_id,
                        "tool": tool,
                        "effect": None,
                        "outcome": CallOutcome.INHERITED,
                        "is_error": bool(block.get("is_error")),
                        "content": text,
                    }
                elif isinstance(block, dict):
                    yield from self._block(block, str(role))
        self.turn = int(scene.get("turn", self.turn))


def lines(
    records: Iterable[JSON],
    *,
    prompt: str | None = None,
    prices: Mapping[str, Price] | None = None,
) -> list[JSON]:
    """The live branch's lines of a journal's ``records`` (oldest first), after the task's
    ``prompt`` as turn 0 (a fork's scene carries its own); with ``prices``, each model
    call's cost on its first line."""
    fold = _Fold()
    kept: list[tuple[int, JSON]] = []  # (the live turn when recorded, line)
    if prompt is not None:
        kept.append((0, {"turn": 0, "kind": "text", "role": "user", "text": prompt}))
    for record in records:
        if record.get("k") == RecordKind.BASE:
            kept = []  # a fork's scene begins with the prompt itself
        elif record.get("k") == RecordKind.REWIND:
            to = int(record["to"])
            kept = [(at, line) for at, line in kept if line["turn"] <= to and at <= to]
            fold.turn = min(fold.turn, to)
            continue
        for index, line in enumerate(fold.of_record(record)):
            cost = {}
            if (
                index == 0
                and prices is not None
                and record.get("k") in (RecordKind.TURN, RecordKind.COMPACTION)
            ):
                usage = Usage.from_json(record.get("usage") or {})
                cost = {"cost_usd": cost_usd({str(record.get("model", "")): usage}, prices)}
            kept.append((fold.turn, line | cost))
    return [line for _, line in kept]


def task_lines(
    spool: Spool,
    task_id: str,
    *,
    turn: int | None = None,
    prices: Mapping[str, Price] | None = None,
) -> list[JSON]:
    """``agentd show TASK [--turn N] --json``: the task's lines (``lines``: each call's cost
    at ``prices``), or turn ``turn``'s alone (0: the prompt), redacted."""
    task = existing_task(spool, task_id)
    if turn is not None and turn < 0:
        raise UsageError(f"--turn {turn}: a turn is 0 (the prompt) or more")
    store = store_for(spool)
    spec = store.load_spec(task.id)
    shown = lines(store.replay(task.id), prompt=spec.prompt, prices=prices)
    if turn is not None:
        shown = [line for line in shown if line["turn"] == turn]
        if not shown:
            raise NotFoundError(
                f"task {task.id} has no turn {turn} on its live branch; "
                f"`agentd history {task.id}` lists its turns."
            )
    return [redact.clean_prose(line) for line in shown]


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            (str(b["text"]) if "text" in b else f"[{b.get('type')}]")
            if isinstance(b, dict)
            else str(b)
            for b in content
        )
    return "" if content is None else json.dumps(content, ensure_ascii=False)


# -- text for a terminal ------------------------------------------------------------------


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


#: How ``agentd show`` says each decision an operator made.
DECIDED: dict[str, str] = {
    DecisionAction.RERUN: "re-run",
    DecisionAction.SKIP: "skipped",
    DecisionAction.RESULT: "result recorded",
}


class Renderer:
    """Lines as text: a header per turn, the model's words as they are, a tool call as
    ``→ tool input``, its result as ``← tool (effect, outcome)`` and the content indented.
    Long texts are cut at ``cut`` characters with a note (``None``: never cut)."""

    def __init__(self, out: TextIO, *, colour: bool = False, cut: int | None = CUT_AT) -> None:
        self.out = out
        self.colour = colour
        self.cut = cut
        self._turn: int | None = None

    def _paint(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def _cut(self, text: str) -> str:
        if self.cut is None or len(text) <= self.cut:
            return text
        more = len(text) - self.cut
        return f"{text[: self.cut]}\n… ({more} more characters: --json shows everything)"

    def line(self, line: JSON) -> None:
        turn = int(line.get("turn", 0))
        if turn != self._turn:
            self._turn = turn
            head = "prompt" if turn == 0 else f"turn {turn}"
            if line.get("cost_usd") is not None and line.get("kind") != "compaction":
                head += f"  ${line['cost_usd']:.6f}"
            print(self._paint("1", f"── {head}"), file=self.out)
        kind = line.get("kind")
        if kind == "text":
            who = "" if line.get("role") == "assistant" or turn == 0 else "user: "
            said = " ".join(f"{k} {line[k]}" for k in ("by", "via") if line.get(k))
            who = f"user ({said}): " if said and who else who
            print(who + self._cut(str(line.get("text", ""))), file=self.out)
        elif kind == "tool_use":
            shown = json.dumps(line.get("input"), ensure_ascii=False)
            print(self._paint("36", f"→ {line.get('tool')} {self._cut(shown)}"), file=self.out)
        elif kind == "tool_result":
            facts = ", ".join(str(v) for v in (line.get("effect"), line.get("outcome")) if v)
            mark = self._paint("31", "error") if line.get("is_error") else ""
            head = f"← {line.get('tool')} ({facts})" + (f" {mark}" if mark else "")
            print(self._paint("2", head) if not mark else head, file=self.out)
            body = self._cut(_block_text(line.get("content")))
            for text in body.splitlines() or [""]:
                print(f"    {text}", file=self.out)
        elif kind == "compaction":
            print(
                self._paint(
                    "33",
                    f"⋯ compacted turns {line.get('first')} to {line.get('last')} "
                    f"({line.get('tokens_before')} → {line.get('tokens_after')} tokens)",
                ),
                file=self.out,
            )
            for text in self._cut(str(line.get("summary", ""))).splitlines():
                print(f"    {text}", file=self.out)
        elif kind == "hold":
            if line.get("budget"):
                print(self._paint("33", f"‖ held: {line['budget']}"), file=self.out)
            for call in line.get("calls", []):
                print(
                    self._paint(
                        "33",
                        f"‖ held: {call.get('tool')} call {call.get('call_id')}: {call.get('why')}",
                    ),
                    file=self.out,
                )
        elif kind == "decision":
            action = line.get("action")
            what = DECIDED.get(str(action), str(action))
            who = " ".join(f"{k} {shown_by(str(line[k]))}" for k in ("by", "via") if line.get(k))
            detail = line.get("reason") or line.get("result")
            text = f"✓ decided: {line.get('tool')} call {line.get('call_id')} {what}"
            text += f" ({who})" if who else ""
            text += f": {self._cut(str(detail))}" if detail else ""
            print(self._paint("33", text), file=self.out)
