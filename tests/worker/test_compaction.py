"""Compaction (DESIGN.md section 4): the cut, the fold of a compaction record, rewind
across one, and snapshots of a compacted scene."""

from __future__ import annotations

from typing import Any

from tests.support import assert_paired, scene, tool_results
from tests.worker.test_state import HEADER, PROMPT, result, turn
from worker import compaction
from worker.state import TaskState, fold, parse_snapshot, snapshot_bytes

JSON = dict[str, Any]


def tool_turns(count: int) -> list[JSON]:
    """A journal of ``count`` turns, each with one tool call and its result."""
    records: list[JSON] = [HEADER]
    for n in range(1, count + 1):
        records += [turn(n, f"c{n}"), result(f"c{n}", f"out {n}")]
    return records


def compaction_of(state: TaskState, keep_turns: int, summary: str = "S") -> JSON:
    """The compaction record the loop would write for ``state``."""
    messages = state.messages
    at = compaction.cut(messages, keep_turns)
    assert at is not None
    kept = sum(m["role"] == "assistant" for m in messages[at:])
    last = state.turn - kept
    return {
        "k": "compaction",
        "summary": summary,
        "keep": len(messages) - at,
        "first": last - sum(m["role"] == "assistant" for m in messages[:at]) + 1,
        "last": last,
        "usage": {"input_tokens": 100, "output_tokens": 7},
        "tokens_before": state.tokens_used,
        "tokens_after": 42,
        "at": "tc",
    }


def test_cut_keeps_the_last_turns_with_their_results() -> None:
    state = fold(PROMPT, tool_turns(6))
    at = compaction.cut(state.messages, 2)
    assert at is not None
    kept = state.messages[at:]
    assert [m["role"] for m in kept] == ["assistant", "user"] * 2
    assert [b["id"] for m in kept for b in m["content"] if b["type"] == "tool_use"] == [
        "c5",
        "c6",
    ]
    assert set(tool_results(kept)) == {"c5", "c6"}  # no tool_use without its result


def test_cut_with_nothing_to_summarise_is_none() -> None:
    state = fold(PROMPT, tool_turns(2))
    assert compaction.cut(state.messages, 2) is None
    assert compaction.cut(state.messages, 5) is None
    assert compaction.cut(fold(PROMPT, [HEADER]).messages, 0) is None


def test_cut_never_falls_between_two_assistant_messages() -> None:
    messages: list[JSON] = [
        {"role": "user", "content": [{"type": "text", "text": "p"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
        {"role": "user", "content": [{"type": "text", "text": "u1"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "paused"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a3"}]},
    ]
    assert compaction.cut(messages, 1) == 3  # keeps the paused turn with the last one
    assert compaction.cut(messages, 0) == 5


def test_fold_of_a_compaction_is_prompt_summary_and_kept_turns() -> None:
    records = tool_turns(6)
    before = fold(PROMPT, records)
    record = compaction_of(before, 2, "Wrote c1 to c4.\nMore detail.")
    assert (record["first"], record["last"]) == (1, 4)
    state = fold(PROMPT, [*records, record])
    assert state.messages[0]["content"][0] == {"type": "text", "text": PROMPT}
    assert "Wrote c1 to c4." in state.messages[0]["content"][1]["text"]
    assert state.messages[1:] == before.messages[-4:]
    assert_paired(state.messages)
    assert state.usage_total.input_tokens == before.usage_total.input_tokens + 100
    assert state.tokens_used == 42
    (made,) = state.live_compactions()
    assert (made.turn, made.headline, made.tokens_before) == (6, "Wrote c1 to c4.", 66)
    assert state.compacted_at(6)


def test_turns_after_a_compaction_append_to_the_compacted_transcript() -> None:
    records = tool_turns(6)
    records.append(compaction_of(fold(PROMPT, records), 1))
    records += [turn(7, "c7"), result("c7"), turn(8)]
    state = fold(PROMPT, records)
    assert_paired(state.messages)
    assert [m["role"] for m in state.messages] == ["user"] + ["assistant", "user"] * 2 + [
        "assistant"
    ]
    assert state.turn == 8 and state.stop_reason == "end_turn"


def test_rewind_before_a_compaction_restores_the_full_transcript() -> None:
    records = tool_turns(6)
    records.append(compaction_of(fold(PROMPT, records), 2))
    records += [turn(7, "c7"), result("c7")]
    uncompacted = fold(PROMPT, tool_turns(4))  # the scene after turn 4, never compacted
    state = fold(PROMPT, [*records, {"k": "rewind", "to": 4, "at": "tr"}])
    assert state.messages == uncompacted.messages
    assert state.live_compactions() == []
    assert state.compactions[0].rewound
    assert state.tokens_used == uncompacted.tokens_used
    # the new branch goes on from the full transcript and may compact again
    state.apply(turn(5, "d5"))
    state.apply(result("d5"))
    assert_paired(state.messages)
    assert len(state.messages) == len(uncompacted.messages) + 2


def test_rewind_to_the_compacted_turn_keeps_the_compaction() -> None:
    records = tool_turns(6)
    records.append(compaction_of(fold(PROMPT, records), 2))
    compacted = fold(PROMPT, records)
    records += [turn(7, "c7"), result("c7"), {"k": "rewind", "to": 6, "at": "tr"}]
    state = fold(PROMPT, records)
    assert state.messages == compacted.messages
    assert len(state.live_compactions()) == 1


def test_a_snapshot_holds_the_compacted_scene() -> None:
    records = tool_turns(6)
    records.append(compaction_of(fold(PROMPT, records), 2))
    state = fold(PROMPT, records)
    restored, _ = parse_snapshot(snapshot_bytes(state, 0))
    assert restored.messages == state.messages
    assert len(restored.messages) == 5  # bounded by the kept turns, not the task's age
    assert [c.turn for c in restored.live_compactions()] == [6]
    assert scene(restored)["compactions"] == scene(state)["compactions"]


def test_a_compaction_record_that_does_not_fit_the_scene_is_ignored() -> None:
    records = tool_turns(3)
    state = fold(PROMPT, records)
    bad = {**compaction_of(state, 1), "keep": len(state.messages)}  # would drop the prompt
    assert fold(PROMPT, [*records, bad]).messages == state.messages
