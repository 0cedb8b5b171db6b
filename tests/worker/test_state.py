"""The fold of journal records into a task's state, and snapshots of it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import assert_paired, scene, tool_results
from worker.models.base import Usage
from worker.state import TaskState, dump_scene, fold
from worker.store.durable import dump_json, load_json

PROMPT = "Build the thing."
HEADER = {"k": "header", "v": 1}


def turn(n: int, *call_ids: str, stop: str | None = None, text: str = "ok") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"{text} {n}"}]
    content += [
        {"type": "tool_use", "id": cid, "name": "write_file", "input": {"path": cid}}
        for cid in call_ids
    ]
    return {
        "k": "turn",
        "turn": n,
        "message": {"role": "assistant", "content": content},
        "stop_reason": stop or ("tool_use" if call_ids else "end_turn"),
        "usage": {"input_tokens": 10 * n, "output_tokens": n},
        "model": "m",
        "at": f"t{n}",
    }


def intent(call_id: str, attempt: int = 1, key: str | None = None) -> dict[str, Any]:
    return {
        "k": "intent",
        "call_id": call_id,
        "tool": "write_file",
        "input": {"path": call_id},
        "effect": "idempotent",
        "key": key or f"key-{call_id}",
        "attempt": attempt,
        "at": "t",
    }


def result(call_id: str, content: str = "done", **fields: Any) -> dict[str, Any]:
    return {"k": "result", "call_id": call_id, "content": content, "is_error": False, **fields}


def roles(state: TaskState) -> list[str]:
    return [m["role"] for m in state.messages]


def test_fold_builds_an_alternating_paired_transcript() -> None:
    records = [
        HEADER,
        turn(1, "a", "b"),
        intent("a"),
        result("a", "A"),
        intent("b"),
        result("b", "B"),
        turn(2),
        {"k": "end", "state": "done", "reason": "end_turn"},
    ]
    state = fold(PROMPT, records)
    assert roles(state) == ["user", "assistant", "user", "assistant"]
    assert state.messages[0]["content"] == [{"type": "text", "text": PROMPT}]
    assert_paired(state.messages)
    assert [b["tool_use_id"] for b in state.messages[2]["content"]] == ["a", "b"]
    assert [b["content"] for b in state.messages[2]["content"]] == ["A", "B"]
    assert state.turn == 2
    assert state.usage == Usage(30, 3)
    assert state.tokens_used == 22  # the latest call's context
    assert state.ended == {"state": "done", "reason": "end_turn"}
    assert state.records == len(records)
    assert [t.turn for t in state.turns] == [1, 2]
    assert state.calls["a"].outcome == "ran"


def test_results_are_sent_only_once_all_arrived_in_tool_use_order() -> None:
    state = fold(PROMPT, [HEADER, turn(1, "a", "b", "c")])
    assert [c.call_id for c in state.pending_calls()] == ["a", "b", "c"]
    for cid in ("c", "a"):
        state.apply(result(cid, cid.upper()))
        assert roles(state) == ["user", "assistant"], "results sent before all arrived"
    assert [c.call_id for c in state.pending_calls()] == ["b"]
    state.apply(result("b", "B"))
    assert roles(state) == ["user", "assistant", "user"]
    blocks = state.messages[2]["content"]
    assert [(b["tool_use_id"], b["content"]) for b in blocks] == [
        ("a", "A"),
        ("b", "B"),
        ("c", "C"),
    ]
    assert state.pending_calls() == []


def test_duplicate_result_is_ignored() -> None:
    state = fold(
        PROMPT,
        [HEADER, turn(1, "a"), intent("a"), result("a", "first"), result("a", "second")],
    )
    assert tool_results(state.messages)["a"]["content"] == "first"
    assert len(state.messages[2]["content"]) == 1
    assert state.calls["a"].result is not None
    assert state.calls["a"].result["content"] == "first"


def test_error_results_are_marked() -> None:
    state = fold(PROMPT, [HEADER, turn(1, "a"), result("a", "no", is_error=True)])
    assert tool_results(state.messages)["a"]["is_error"] is True
    state = fold(PROMPT, [HEADER, turn(1, "a"), result("a", "yes")])
    assert "is_error" not in tool_results(state.messages)["a"]


def test_results_of_unknown_calls_and_late_intents_are_ignored() -> None:
    state = fold(
        PROMPT,
        [HEADER, turn(1, "a"), result("zzz"), intent("a"), result("a"), intent("a", 2)],
    )
    assert "zzz" not in state.calls
    assert state.calls["a"].attempt == 1
    assert not state.calls["a"].dangling
    assert_paired(state.messages)


def test_intents_make_a_call_dangling_and_count_attempts() -> None:
    state = fold(PROMPT, [HEADER, turn(1, "a", "b"), intent("a"), intent("a", 2, key="k")])
    call = state.calls["a"]
    assert call.dangling
    assert call.attempt == 2
    assert call.key == "k"
    assert call.outcome == "dangling"
    assert state.calls["b"].outcome == "pending"
    assert [c.call_id for c in state.dangling()] == ["a"]


def test_decisions_apply_to_their_attempt_only() -> None:
    decision = {"k": "decision", "call_id": "a", "attempt": 1, "action": "skip"}
    state = fold(PROMPT, [HEADER, turn(1, "a"), intent("a"), {**decision, "attempt": 2}])
    assert state.calls["a"].decision is None
    state.apply(decision)
    assert state.calls["a"].decision == decision
    state.apply(intent("a", 2))  # a new attempt: the old decision is spent
    assert state.calls["a"].decision is None


def test_hold_is_cleared_by_the_result() -> None:
    hold = {"k": "hold", "calls": [{"call_id": "a", "attempt": 1, "tool": "write_file"}]}
    state = fold(PROMPT, [HEADER, turn(1, "a"), intent("a"), hold])
    assert [h["call_id"] for h in state.held] == ["a"]
    state.apply(result("a"))
    assert state.held == []


def test_user_record_merges_after_tool_results() -> None:
    extra = {"k": "user", "content": [{"type": "text", "text": "continue"}]}
    state = fold(PROMPT, [HEADER, turn(1, "a"), result("a"), extra])
    assert roles(state) == ["user", "assistant", "user"]
    assert [b["type"] for b in state.messages[2]["content"]] == ["tool_result", "text"]
    assert_paired(state.messages)
    state = fold(PROMPT, [HEADER, turn(1, stop="max_tokens"), extra])
    assert roles(state) == ["user", "assistant", "user"]


def _through_json(data: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(data))
    return loaded


def test_snapshot_round_trip_equals_the_fold() -> None:
    records = [
        HEADER,
        turn(1, "a", "b"),
        intent("a"),
        result("a"),
        intent("b"),
        {"k": "hold", "calls": [{"call_id": "b", "attempt": 1}]},
        {"k": "decision", "call_id": "b", "attempt": 1, "action": "rerun"},
    ]
    state = fold(PROMPT, records)
    again, offset = TaskState.from_snapshot(_through_json(state.to_snapshot(1234)))
    assert offset == 1234
    assert scene(again) == scene(state)
    more = [intent("b", 2), result("b"), turn(2)]
    for record in more:
        again.apply(record)
    assert scene(again) == scene(fold(PROMPT, records + more))


def test_snapshot_of_another_version_is_refused() -> None:
    data = fold(PROMPT, [HEADER]).to_snapshot(0)
    with pytest.raises(ValueError, match="snapshot version"):
        TaskState.from_snapshot({**data, "v": 99})
    del data["messages"]
    with pytest.raises(KeyError):
        TaskState.from_snapshot(data)


# -- random journals --------------------------------------------------------------------


@st.composite
def journals(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Record sequences a worker can leave behind, crashes and reruns included: each turn
    is followed by its calls' intents (one or more attempts) and results (in any order,
    sometimes twice); only the last turn may stop short (the worker died)."""
    records: list[dict[str, Any]] = [HEADER]
    turns = draw(st.integers(0, 5))
    for n in range(1, turns + 1):
        last = n == turns
        ids = [f"c{n}_{i}" for i in range(draw(st.integers(0, 3)))]
        if last:
            stop = draw(st.sampled_from(["end_turn", "max_tokens", "pause_turn", "refusal"]))
        else:  # the loop calls the model again only after these
            stop = draw(st.sampled_from(["max_tokens", "pause_turn"]))
        if ids and draw(st.integers(0, 4)) != 0:
            stop = "tool_use"
        records.append(turn(n, *ids, stop=stop))
        if stop == "max_tokens":  # the loop answers cut-off calls at once, unexecuted
            records += [result(cid, "not executed", is_error=True) for cid in ids]
            if not ids or draw(st.booleans()):
                records.append({"k": "user", "content": [{"type": "text", "text": "continue"}]})
            ids = []
        for cid in draw(st.permutations(ids)):
            attempts = draw(st.integers(0, 2))
            for attempt in range(1, attempts + 1):
                records.append(intent(cid, attempt))
                if draw(st.integers(0, 3)) == 0:
                    records.append({"k": "hold", "calls": [{"call_id": cid, "attempt": attempt}]})
                    records.append(
                        {"k": "decision", "call_id": cid, "attempt": attempt, "action": "rerun"}
                    )
            if last and draw(st.booleans()):
                continue  # the worker died before this result was recorded
            records.append(result(cid, f"result of {cid}"))
            if draw(st.integers(0, 4)) == 0:
                records.append(result(cid, f"late duplicate for {cid}"))
            if draw(st.integers(0, 6)) == 0:
                records.append(result(f"stray{n}", "for no call"))
    return records


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=journals(), split=st.integers(0, 10_000))
def test_fold_invariants_on_random_journals(records: list[dict[str, Any]], split: int) -> None:
    state = fold(PROMPT, records)
    assert_paired(state.messages, alternating=False, allow_pending=True)
    # Roles alternate, except that a pause_turn reply is followed by the next reply.
    stops = iter(r["stop_reason"] for r in records if r["k"] == "turn")
    previous = None
    for message in state.messages:
        stop = next(stops) if message["role"] == "assistant" else None
        if previous is not None and message["role"] == previous[0]:
            assert message["role"] == "assistant" and previous[1] == "pause_turn"
        previous = (message["role"], stop)

    # Each answered call carries its first result. Only the last turn may be unanswered,
    # and then as a whole: its results are held back until every call has one.
    answered = tool_results(state.messages)
    firsts: dict[str, str] = {}
    for record in records:
        if record["k"] == "result" and record["call_id"] in state.calls:
            firsts.setdefault(record["call_id"], record["content"])
    uses = [
        b["id"]
        for m in state.messages
        if m["role"] == "assistant"
        for b in m["content"]
        if b.get("type") == "tool_use"
    ]
    for cid in uses:
        if cid in answered:
            assert answered[cid]["content"] == firsts[cid]
    unanswered = [cid for cid in uses if cid not in answered]
    pending = [c.call_id for c in state.pending_calls()]
    if pending:
        assert unanswered == state.turn_calls
        assert pending == [cid for cid in state.turn_calls if state.calls[cid].result is None]
    else:
        assert unanswered == []
    assert all(state.calls[cid].turn == state.turn for cid in unanswered)

    turns = [r for r in records if r["k"] == "turn"]
    assert state.turn == len(turns)
    assert state.usage.input_tokens == sum(r["usage"]["input_tokens"] for r in turns)

    # A snapshot at any record boundary, then the rest, equals the whole fold.
    cut = split % (len(records) + 1)
    head = fold(PROMPT, records[:cut])
    resumed, _ = TaskState.from_snapshot(_through_json(head.to_snapshot(cut)))
    for record in records[cut:]:
        resumed.apply(record)
    assert scene(resumed) == scene(state)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=journals(), split=st.integers(0, 10_000))
def test_a_detached_state_is_not_changed_by_the_fold_that_goes_on(
    records: list[dict[str, Any]], split: int
) -> None:
    """What the snapshot thread serializes (``TaskState.detached``) stays as it was taken
    whatever the loop folds afterwards: extra user messages extending the last one, results,
    holds, decisions, the next turns."""
    at = split % (len(records) + 1)
    state = fold(PROMPT, records[:at])
    detached = state.detached()
    taken = _through_json(state.compact().to_snapshot(7))
    later = [
        {"k": "user", "content": [{"type": "text", "text": "and more"}]},
        *records[at:],
        {"k": "hold", "calls": [{"call_id": "x", "attempt": 1}]},
        {"k": "vcs", "turn": 99, "commit": "c", "snapshot": "s"},
        {"k": "user", "content": [{"type": "text", "text": "the last word"}]},
    ]
    for call_id in list(state.calls):
        later += [intent(call_id, 5), result(call_id, "late")]
    fold(PROMPT, later, state)
    assert _through_json(detached.to_snapshot(7)) == taken


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=journals(), text=st.text(max_size=20))
def test_a_scene_made_a_piece_at_a_time_is_the_bytes_of_one_dump(
    records: list[dict[str, Any]], text: str
) -> None:
    """``dump_scene`` (what snapshots are written with) is ``dump_json`` byte for byte,
    and the same JSON when a piece needs the standard library (an integer past 64 bits,
    read back exactly)."""
    state = fold(PROMPT, [*records, {"k": "user", "content": [{"type": "text", "text": text}]}])
    scene = state.compact().to_snapshot(7)
    assert dump_scene(scene) == dump_json(scene)
    assert dump_scene({}) == dump_json({})
    for n in (63, 64, 65, 129, 1000):  # lists dumped a slice at a time
        long = {"messages": [{"i": i, "text": f"é{i}"} for i in range(n)], "turn": n, "held": []}
        assert dump_scene(long) == dump_json(long)
    wide = {"messages": [{"n": 2**70}, {"n": -(2**63) - 1}], "usage": {"cost": 1e-7}}
    assert load_json(dump_scene(wide)) == load_json(dump_json(wide)) == wide
