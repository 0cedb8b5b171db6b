"""Compaction (docs/design.md section 4): the cut, the fold of a compaction record, rewind
across one, and snapshots of a compacted scene."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from supervisor.submit import submit
from tests.support import (
    assert_paired,
    journal_records,
    make_loop,
    of_kind,
    reply,
    scene,
    text,
    tool_results,
    tool_use,
)
from tests.worker.test_state import HEADER, PROMPT, result, turn
from worker import compaction
from worker.config import Config, ContextConfig, ModelConfig
from worker.errors import ContextTooLongError, TaskSpecError
from worker.events import Event, read_events
from worker.loop import AgentLoop, Outcome
from worker.models.base import ModelReply, ModelRequest, SummaryOf
from worker.models.scripted import ScriptedModel, default_summary, validate_script
from worker.spool import Spool, TaskDir
from worker.state import TaskState, fold, open_snapshot, parse_snapshot, snapshot_bytes
from worker.tool_calls import idempotency_key

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


# -- the loop -------------------------------------------------------------------------

CONFIG = Config(
    model=ModelConfig(max_tokens=50),
    context=ContextConfig(window=200, compact_at=0.5, keep_turns=1),
)
# tokens_used reaches the threshold (100) after turns 4 and 8: two compactions
USED = [30, 60, 90, 120, 40, 60, 80, 110]


def compacting_script(summaries: list[str] | None = None) -> JSON:
    responses = [
        reply(
            text(f"Writing f{k}."),
            tool_use("write_file", path=f"f{k}.txt", content=str(k)),
            usage={"input_tokens": used - 5, "output_tokens": 5},
        )
        for k, used in enumerate(USED, 1)
    ]
    responses.append(reply(text("All written.")))
    return {"responses": responses, "summaries": summaries or []}


def submit_script(spool: Spool, script: JSON, name: str = "long") -> TaskDir:
    path = spool.root.parent / f"{name}-script.json"
    path.write_text(json.dumps(script))
    return submit(spool, CONFIG, prompt="Write nine files.", script=path, name=name)


class SummaryCrash(BaseException):
    """Stands for kill -9 inside a summary call."""


class Summaries:
    """A model wrapper that sees the summary calls (and may die in the first)."""

    def __init__(self, inner: Any, *, crash: bool = False) -> None:
        self.inner = inner
        self.crash = crash
        self.summary_calls: list[SummaryOf] = []
        self.requests: list[list[JSON]] = []

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        self.requests.append(copy.deepcopy(list(request.messages)))
        if request.summary is not None:
            self.summary_calls.append(request.summary)
            if self.crash:
                self.crash = False
                raise SummaryCrash
        reply: ModelReply = self.inner.complete(request, turn_index=turn_index)
        return reply

    def close(self) -> None:
        self.inner.close()


def run_loop(task: TaskDir, model: Any) -> tuple[Outcome, AgentLoop]:
    loop = make_loop(task, config=CONFIG, model=model)
    try:
        return loop.run(), loop
    finally:
        loop.close()


def test_a_long_scripted_task_compacts_and_finishes_done(spool: Spool) -> None:
    task = submit_script(spool, compacting_script(["Files f1 to f3 are written.\nDetail."]))
    model = Summaries(ScriptedModel.from_file(task.script))
    outcome, loop = run_loop(task, model)

    assert outcome.state == "done" and outcome.reason == "end_turn"
    assert model.summary_calls == [SummaryOf(0, 1, 3), SummaryOf(1, 4, 7)]
    for sent in model.requests:
        assert_paired(sent)
    assert_paired(loop.state.messages)
    records = journal_records(task)
    made = of_kind(records, "compaction")
    assert [(c["first"], c["last"], c["keep"]) for c in made] == [(1, 3, 2), (4, 7, 2)]
    assert made[0]["summary"].startswith("Files f1 to f3 are written.")
    assert made[1]["summary"] == default_summary(SummaryOf(1, 4, 7))
    # the request after a compaction: the prompt, the summary, then the kept turn
    after = model.requests[5]  # turns 1-4, the summary call, then turn 5
    assert after[0]["content"][0]["text"] == "Write nine files."
    assert "Files f1 to f3 are written." in after[0]["content"][1]["text"]
    assert [b["input"]["path"] for b in after[1]["content"] if b["type"] == "tool_use"] == [
        "f4.txt"
    ]
    # every turn stays in the journal; every file was written once; usage counts each call
    assert len(of_kind(records, "turn")) == 9
    assert sorted(p.name for p in loop.workspace.iterdir()) == [f"f{k}.txt" for k in range(1, 9)]
    summary_usage = sum(c["usage"]["input_tokens"] for c in made)
    turn_usage = sum(t["usage"]["input_tokens"] for t in of_kind(records, "turn"))
    assert loop.state.usage_total.input_tokens == turn_usage + summary_usage
    assert len(loop.state.live_compactions()) == 2
    events = [e["event"] for e in read_events(task.events)]
    assert events.count("compaction") == 2


def test_a_crash_in_the_summary_call_makes_it_again_and_counts_it_once(spool: Spool) -> None:
    task = submit_script(spool, compacting_script())
    model = Summaries(ScriptedModel.from_file(task.script), crash=True)
    with pytest.raises(SummaryCrash):
        run_loop(task, model)
    assert of_kind(journal_records(task), "compaction") == []

    again = Summaries(ScriptedModel.from_file(task.script))
    outcome, loop = run_loop(task, again)
    assert outcome.state == "done"
    assert again.summary_calls[0] == SummaryOf(0, 1, 3)  # made again, on resume
    made = of_kind(journal_records(task), "compaction")
    assert len(made) == 2
    assert (
        loop.state.usage_total == fold(task.load_spec().prompt, journal_records(task)).usage_total
    )


def test_a_crash_after_the_record_resumes_compacted_with_no_second_summary(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = submit_script(spool, compacting_script())
    loop = make_loop(task, config=CONFIG, model=Summaries(ScriptedModel.from_file(task.script)))
    event = loop.recorder.event

    def crash_on_compaction(name: Event, level: str = "info", **fields: Any) -> None:
        event(name, level, **fields)
        if name == Event.COMPACTION:
            raise SummaryCrash

    monkeypatch.setattr(loop.recorder, "event", crash_on_compaction)
    with pytest.raises(SummaryCrash):
        loop.run()
    loop.close()
    assert len(of_kind(journal_records(task), "compaction")) == 1

    again = Summaries(ScriptedModel.from_file(task.script))
    outcome, loop = run_loop(task, again)
    assert outcome.state == "done"
    assert again.summary_calls == [SummaryOf(1, 4, 7)]  # no second summary of turns 1-3
    assert "Compaction 1" in again.requests[0][0]["content"][1]["text"]
    assert len(again.requests[0]) == 3  # resumed from the compacted transcript
    assert len(of_kind(journal_records(task), "compaction")) == 2


class TooLong:
    """A model whose window is ``limit`` messages: a longer prompt is refused as the API
    refuses it; with ``from_turn``, every turn's prompt from that turn on is."""

    def __init__(self, inner: Any, limit: int, from_turn: int | None = None) -> None:
        self.inner = inner
        self.limit = limit
        self.from_turn = from_turn
        self.refused = 0

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        hopeless = self.from_turn is not None and turn_index >= self.from_turn
        if len(request.messages) > self.limit or (hopeless and request.summary is None):
            self.refused += 1
            raise ContextTooLongError(f"prompt is too long: {len(request.messages)} messages")
        reply: ModelReply = self.inner.complete(request, turn_index=turn_index)
        return reply

    def close(self) -> None:
        self.inner.close()


def test_a_prompt_too_long_is_compacted_once_and_retried(spool: Spool) -> None:
    script = compacting_script()
    for response in script["responses"]:
        response["usage"] = SMALL_USAGE  # tokens_used never reaches the threshold
    task = submit_script(spool, script)
    model = TooLong(ScriptedModel.from_file(task.script), limit=8)
    outcome, _ = run_loop(task, model)

    assert outcome.state == "done"
    assert model.refused == 2  # each answered by one compaction and one retry
    made = of_kind(journal_records(task), "compaction")
    assert [c["trigger"] for c in made] == ["too_long", "too_long"]
    assert len(of_kind(journal_records(task), "turn")) == 9


def test_a_prompt_still_too_long_after_compaction_fails_naming_the_setting(spool: Spool) -> None:
    script = compacting_script()
    for response in script["responses"]:
        response["usage"] = SMALL_USAGE
    task = submit_script(spool, script)
    model = TooLong(ScriptedModel.from_file(task.script), limit=99, from_turn=3)
    outcome, _ = run_loop(task, model)

    assert outcome.state == "failed"
    assert "[context] keep_turns (now 1)" in outcome.reason
    assert "\n" not in outcome.reason
    assert len(of_kind(journal_records(task), "compaction")) == 1
    assert model.refused == 2  # the prompt, then the compacted prompt: no third try


#: The usage a response reports in a test that reaches the window only by the message count
#: (without one, the scripted model reports the request's size, which would).
SMALL_USAGE = {"input_tokens": 10, "output_tokens": 5}


class WindowExceeded:
    """A model whose reply to turn ``at`` hits the context window, once."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner = inner
        self.at: int | None = at

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        if turn_index == self.at and request.summary is None:
            self.at = None
            return ModelReply([text("Half a repl")], "model_context_window_exceeded")
        reply: ModelReply = self.inner.complete(request, turn_index=turn_index)
        return reply

    def close(self) -> None:
        self.inner.close()


def test_a_reply_cut_by_the_window_is_not_recorded_and_is_retried_compacted(
    spool: Spool,
) -> None:
    script = compacting_script()
    for response in script["responses"]:
        response["usage"] = SMALL_USAGE
    task = submit_script(spool, script)
    outcome, _ = run_loop(task, WindowExceeded(ScriptedModel.from_file(task.script), at=5))

    assert outcome.state == "done"
    records = journal_records(task)
    assert [c["trigger"] for c in of_kind(records, "compaction")] == ["too_long"]
    assert all(
        t["stop_reason"] != "model_context_window_exceeded" for t in of_kind(records, "turn")
    )
    assert len(of_kind(records, "turn")) == 9


def test_a_first_reply_cut_by_the_window_fails_naming_the_setting(spool: Spool) -> None:
    task = submit_script(spool, compacting_script())
    outcome, _ = run_loop(task, WindowExceeded(ScriptedModel.from_file(task.script), at=0))

    assert outcome.state == "failed"
    assert outcome.reason.startswith("the reply hit the model's context window: ")
    assert "[context] keep_turns" in outcome.reason
    assert of_kind(journal_records(task), "turn") == []


def test_a_snapshot_after_a_compaction_resumes_the_compacted_scene(spool: Spool) -> None:
    task = submit_script(spool, compacting_script())
    loop = make_loop(task, config=CONFIG, snapshot_every=1)
    try:
        assert loop.run().state == "done"
    finally:
        loop.close()

    scene_of_snapshot = open_snapshot(task.snapshot.read_bytes())
    assert len(scene_of_snapshot["messages"]) == 4  # prompt and summary, turns 8 and 9
    resumed = make_loop(task, config=CONFIG)
    try:
        state = resumed.open()
    finally:
        resumed.close()
    full = fold(task.load_spec().prompt, journal_records(task))
    assert state.messages == full.messages
    assert len(state.live_compactions()) == 2
    # compactions leave every call's idempotency key as it was
    keys = {r["call_id"]: r["key"] for r in of_kind(journal_records(task), "intent")}
    assert keys == {cid: idempotency_key(task.id, 0, cid) for cid in keys}


def test_summaries_must_be_a_list_of_strings(spool: Spool) -> None:
    with pytest.raises(TaskSpecError, match='"summaries" must be a list of strings'):
        validate_script({"responses": [reply(text("hi"))], "summaries": ["ok", 3]}, "s.json")


def test_the_server_strategy_on_the_scripted_model_compacts_as_client_and_says_so(
    spool: Spool,
) -> None:
    config = dataclasses.replace(
        CONFIG, context=dataclasses.replace(CONFIG.context, strategy="server")
    )
    task = submit_script(spool, compacting_script())
    loop = make_loop(task, config=config)
    try:
        assert loop.run().state == "done"
    finally:
        loop.close()

    (fallback,) = [e for e in read_events(task.events) if e["event"] == "context_strategy_fallback"]
    assert fallback["level"] == "warning" and "offers no server compaction" in fallback["error"]
    assert len(of_kind(journal_records(task), "compaction")) == 2


def test_a_script_without_usage_reports_the_request_size_so_compaction_shrinks_it(
    spool: Spool,
) -> None:
    """The scripted model reports ``input_tokens`` = ceil(characters of the request / 4)
    for a response without ``usage``: a growing transcript reaches ``compact_at``, and a
    compacted one reports its smaller size, so it compacts now and then, not at every
    turn past the threshold (as a usage that only grows would make it)."""
    body = "x" * 200
    responses = [
        reply(text(f"Writing f{k}."), tool_use("write_file", path=f"f{k}.txt", content=body))
        for k in range(1, 31)
    ]
    path = spool.root.parent / "sized.json"
    path.write_text(json.dumps({"responses": [*responses, reply(text("All written."))]}))
    config = Config(
        model=ModelConfig(max_tokens=50),
        context=ContextConfig(window=2400, compact_at=0.5, keep_turns=2),
    )
    task = submit(spool, config, prompt="Write thirty files.", script=path, name="sized")
    loop = make_loop(task, config=config)
    try:
        assert loop.run().state == "done"
    finally:
        loop.close()
    sizes: dict[int, int] = {}  # turn -> the input_tokens its request reported
    after: list[int] = []  # the turn each compaction followed
    for record in journal_records(task):
        if record["k"] == "turn":
            sizes[record["turn"]] = record["usage"]["input_tokens"]
        elif record["k"] == "compaction":
            assert record["tokens_after"] < record["tokens_before"] <= 2400, record
            after.append(max(sizes))
    assert 1 <= len(after) <= 6, after
    for followed in after:
        assert sizes[followed + 1] < sizes[followed], (followed, sizes)
