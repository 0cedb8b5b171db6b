"""The agent loop in-process: stop reasons, limits, tool failures, dangling calls on
resume (every effect class, holds and operator decisions), policies and snapshots."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.decisions import decide
from supervisor.status import held_calls
from tests.support import (
    RecordingModel,
    assert_paired,
    journal_records,
    make_loop,
    of_kind,
    reply,
    scene,
    scripted_task,
    text,
    tool_results,
    tool_use,
)
from worker.config import Config, ToolsConfig
from worker.errors import ModelError, RetryableModelError
from worker.events import read_events
from worker.loop import CONTINUE_PROMPT, AgentLoop, Outcome
from worker.models.base import ModelReply, ModelRequest
from worker.models.scripted import ScriptedModel
from worker.protocol import ExitCode
from worker.recorder import SNAPSHOT_GROWTH
from worker.spool import Spool, TaskDir
from worker.state import TaskState, fold, open_snapshot, seal_snapshot
from worker.store import files as files_module
from worker.store import journal as journal_module
from worker.tool_calls import idempotency_key
from worker.tools.registry import Tool, ToolContext, ToolRegistry

CALL = "toolu_s00000_1"  # the scripted id of the tool_use after a text block in turn 1
DONE = reply(text("All done."))


class Crash(BaseException):
    """Stands for kill -9 at a chosen point: nothing in the loop catches it."""


def size_tokens(messages: list[dict[str, Any]]) -> int:
    """What the scripted model reports as ``input_tokens`` for ``messages`` when its
    response has no ``usage``: the characters of the request over 4, rounded up."""
    return math.ceil(len(json.dumps(messages, ensure_ascii=False)) / 4)


def run(task: TaskDir, **kwargs: Any) -> tuple[Outcome, AgentLoop]:
    loop = make_loop(task, **kwargs)
    try:
        return loop.run(), loop
    finally:
        loop.close()


def requests(loop: AgentLoop) -> list[list[dict[str, Any]]]:
    assert isinstance(loop.model, RecordingModel)
    return loop.model.requests


def check_transcripts(loop: AgentLoop, *, alternating: bool = True) -> None:
    """Invariant 3 for every transcript the model was sent, and for the final state."""
    for sent in requests(loop):
        assert_paired(sent, alternating=alternating)
    assert_paired(loop.state.messages, alternating=alternating)


def replayed(task: TaskDir) -> TaskState:
    return fold(task.load_spec().prompt, journal_records(task))


def events(task: TaskDir) -> list[str]:
    return [e["event"] for e in read_events(task.events)]


# -- stop reasons ---------------------------------------------------------------------


def test_end_turn_after_a_tool_call(spool: Spool) -> None:
    task = scripted_task(
        spool,
        [reply(text("Writing."), tool_use("write_file", path="a/b.txt", content="hi")), DONE],
        name="basic",
    )
    outcome, loop = run(task)
    assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
    assert (task.path / "workspace" / "a" / "b.txt").read_text() == "hi"
    kinds = [r["k"] for r in journal_records(task)]
    assert kinds == ["header", "turn", "intent", "result", "turn", "end"]
    assert len(requests(loop)) == 2
    assert requests(loop)[1][-1]["content"][0]["tool_use_id"] == CALL
    check_transcripts(loop)
    assert scene(loop.state) == scene(replayed(task))
    # without a scripted usage, each request's size over 4
    assert loop.state.usage_total.input_tokens == sum(map(size_tokens, requests(loop)))


def test_a_finished_task_stays_finished(spool: Spool) -> None:
    task = scripted_task(spool, [DONE], name="finished")
    assert run(task)[0].exit_code == ExitCode.DONE
    before = journal_records(task)
    outcome, loop = run(task)
    assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
    assert requests(loop) == []
    assert journal_records(task) == before


@pytest.mark.parametrize(
    ("stop_reason", "state", "reason"),
    [
        ("end_turn", "done", "end_turn"),
        ("stop_sequence", "done", "stop_sequence"),
        ("refusal", "failed", "refusal: the model declined to continue this task"),
        ("brand_new_reason", "failed", "unknown stop_reason 'brand_new_reason' from the model"),
    ],
)
def test_final_stop_reasons(spool: Spool, stop_reason: str, state: str, reason: str) -> None:
    task = scripted_task(spool, [reply(text("..."), stop_reason=stop_reason), DONE], name="stop")
    outcome, loop = run(task)
    assert outcome == Outcome(state, reason, ExitCode.DONE if state == "done" else ExitCode.FAILED)
    assert len(requests(loop)) == 1
    (end,) = of_kind(journal_records(task), "end")
    assert (end["state"], end["reason"]) == (state, reason)


def test_max_tokens_without_tool_use_asks_to_continue(spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(text("The answer is"), stop_reason="max_tokens"), DONE], name="cut"
    )
    outcome, loop = run(task)
    assert outcome.state == "done"
    second = requests(loop)[1]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[-1]["content"] == [{"type": "text", "text": CONTINUE_PROMPT}]
    check_transcripts(loop)


def test_max_tokens_with_tool_use_never_runs_the_cut_call(spool: Spool) -> None:
    task = scripted_task(
        spool,
        [
            reply(
                text("Writing"),
                tool_use("write_file", path="cut.txt", content="partial"),
                stop_reason="max_tokens",
            ),
            DONE,
        ],
        name="cut-tool",
    )
    outcome, loop = run(task)
    assert outcome.state == "done"
    assert not (task.path / "workspace" / "cut.txt").exists()
    records = journal_records(task)
    assert of_kind(records, "intent") == []
    (result,) = of_kind(records, "result")
    assert result["outcome"] == "not_run"
    block = requests(loop)[1][-1]["content"][0]
    assert block["tool_use_id"] == CALL
    assert block["is_error"] is True
    assert "max_tokens" in block["content"]
    check_transcripts(loop)


def test_pause_turn_sends_the_paused_reply_back(spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(text("Searching..."), stop_reason="pause_turn"), DONE], name="pause"
    )
    outcome, loop = run(task)
    assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
    second = requests(loop)[1]
    assert [m["role"] for m in second] == ["user", "assistant"]
    assert second[-1]["content"] == [text("Searching...")]
    assert loop.state.turn == 2
    check_transcripts(loop, alternating=False)


def test_tool_use_runs_every_call_in_order(spool: Spool) -> None:
    task = scripted_task(
        spool,
        [
            reply(
                tool_use("write_file", path="f.txt", content="1"),
                tool_use("append_file", path="f.txt", content="2"),
                tool_use("read_file", path="f.txt"),
            ),
            DONE,
        ],
        name="many",
    )
    outcome, loop = run(task)
    assert outcome.state == "done"
    results = tool_results(loop.state.messages)
    assert results["toolu_s00000_2"]["content"] == "12"
    assert [r["call_id"] for r in of_kind(journal_records(task), "intent")] == [
        "toolu_s00000_0",
        "toolu_s00000_1",
        "toolu_s00000_2",
    ]
    check_transcripts(loop)


# -- limits and failures ----------------------------------------------------------------


def test_max_turns(spool: Spool) -> None:
    loops = [reply(tool_use("list_dir")) for _ in range(5)]
    task = scripted_task(spool, loops, name="turns", max_turns=2)
    outcome, loop = run(task)
    assert outcome == Outcome("done", "max_turns", ExitCode.DONE)
    assert loop.state.turn == 2
    assert len(requests(loop)) == 2
    assert loop.state.pending_calls() == []  # the last turn's calls still got results
    check_transcripts(loop)


def test_script_past_its_end_fails_with_a_reason(spool: Spool) -> None:
    task = scripted_task(spool, [reply(tool_use("list_dir"))], name="short")
    outcome, _ = run(task)
    assert outcome.state == "failed"
    assert outcome.exit_code == ExitCode.FAILED
    assert "the script has 1 responses and model call 2 has none" in outcome.reason
    (end,) = of_kind(journal_records(task), "end")
    assert end["reason"] == outcome.reason


def test_unknown_tool_gets_an_error_result_and_the_task_goes_on(spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(text("hm"), tool_use("teleport", to="mars")), DONE], name="unknown"
    )
    outcome, loop = run(task)
    assert outcome.state == "done"
    result = tool_results(loop.state.messages)[CALL]
    assert result["is_error"] is True
    assert "unknown tool 'teleport'" in result["content"]
    assert of_kind(journal_records(task), "intent") == []
    check_transcripts(loop)


def test_bad_tool_input_gets_an_error_result(spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(text("hm"), tool_use("write_file", path="x")), DONE], name="badinput"
    )
    outcome, loop = run(task)
    assert outcome.state == "done"
    result = tool_results(loop.state.messages)[CALL]
    assert result["is_error"] is True
    assert "missing required input 'content'" in result["content"]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (tool_use("explode", message="kaboom"), "explode failed: RuntimeError: kaboom"),
        (tool_use("fixture_refuse", why="policy"), "refused: policy"),
    ],
)
def test_a_failing_tool_gives_an_error_result(
    spool: Spool, call: dict[str, Any], expected: str
) -> None:
    config = Config(tools=ToolsConfig(modules=("tests.tools_fixture",)))
    task = scripted_task(spool, [reply(text("go"), call), DONE], name="fails", config=config)
    outcome, loop = run(task, config=config)
    assert outcome.state == "done"
    result = tool_results(loop.state.messages)[CALL]
    assert result == {
        "type": "tool_result",
        "tool_use_id": CALL,
        "content": expected,
        "is_error": True,
    }
    check_transcripts(loop)


class Flaky:
    """Fails ``failures`` times with a retryable error, then answers from the script."""

    def __init__(self, inner: ScriptedModel, failures: int) -> None:
        self.inner, self.failures, self.calls = inner, failures, 0

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise RetryableModelError("529 overloaded")
        return self.inner.complete(request, turn_index=turn_index)

    def close(self) -> None:
        pass


def test_retried_model_calls_record_one_turn(spool: Spool) -> None:
    task = scripted_task(spool, [DONE], name="flaky")
    model = Flaky(ScriptedModel.from_file(task.script), failures=2)
    sleeps: list[float] = []
    outcome, loop = run(task, model=model, sleep=sleeps.append)
    assert outcome.state == "done"
    assert model.calls == 3
    assert len(sleeps) == 2
    assert len(of_kind(journal_records(task), "turn")) == 1
    assert loop.state.usage_total.input_tokens == size_tokens(loop.state.messages[:1])


def test_a_model_error_fails_the_task(spool: Spool) -> None:
    class Broken:
        def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
            raise ModelError("401: invalid x-api-key; check ANTHROPIC_API_KEY.")

        def close(self) -> None:
            pass

    task = scripted_task(spool, [DONE], name="broken")
    outcome, _ = run(task, model=Broken())
    assert outcome == Outcome(
        "failed", "401: invalid x-api-key; check ANTHROPIC_API_KEY.", ExitCode.FAILED
    )


def test_a_retry_reopens_a_failed_journal_once_per_retry(spool: Spool) -> None:
    class Broken:
        def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
            raise ModelError("401: invalid x-api-key")

        def close(self) -> None:
            pass

    task = scripted_task(spool, [DONE], name="reopened")
    assert run(task, model=Broken())[0].state == "failed"
    # started again with no retry since (a crash after the end was written): the same end
    assert run(task, model=Broken())[0].state == "failed"
    assert of_kind(journal_records(task), "retry") == []
    # retried (the daemon says so: AGENTD_RETRIES), still failing: reopened once, ends again
    assert run(task, model=Broken(), retries=1)[0].state == "failed"
    assert run(task, model=Broken(), retries=1)[0].state == "failed"  # no second reopen
    assert [r["n"] for r in of_kind(journal_records(task), "retry")] == [1]
    # retried again, the model fixed: it goes on from where it failed
    outcome, _ = run(task, retries=2)
    assert outcome.state == "done"
    kinds = [r["k"] for r in journal_records(task)]
    assert kinds == ["header", "end", "retry", "end", "retry", "turn", "end"]


def test_a_stop_request_records_nothing(spool: Spool) -> None:
    task = scripted_task(spool, [DONE], name="stop-early")
    loop = make_loop(task)
    loop.open()
    loop.stop_requested = True
    try:
        assert loop.run() == Outcome("stopped", "stopped at a safe point", ExitCode.STOPPED)
    finally:
        loop.close()
    assert [r["k"] for r in journal_records(task)] == ["header"]


# -- dangling calls -------------------------------------------------------------------


def crashing(tools: ToolRegistry, name: str, *, after_effect: bool) -> ToolRegistry:
    """``tools`` with ``name`` replaced by a version that dies mid-call (before or after
    its side effect): the intent is durable and no result ever will be."""

    def wrap(original: Tool) -> Tool:
        def func(ctx: ToolContext, **data: Any) -> str:
            if after_effect:
                original.func(ctx, **data)
            raise Crash

        return dataclasses.replace(original, func=func)

    return ToolRegistry(wrap(t) if t.name == name else t for t in tools)


def crash_in(
    task: TaskDir, tool: str, *, after_effect: bool = True, config: Config | None = None
) -> None:
    config = config or Config()
    standard = ToolRegistry.standard(config.tools.modules)
    loop = make_loop(task, config=config, tools=crashing(standard, tool, after_effect=after_effect))
    with pytest.raises(Crash):
        loop.run()
    loop.close()
    state = replayed(task)
    assert [c.call_id for c in state.dangling()] == [CALL]


def one_call_task(spool: Spool, call: dict[str, Any], name: str, **kwargs: Any) -> TaskDir:
    return scripted_task(spool, [reply(text("Working."), call), DONE], name=name, **kwargs)


def intents(task: TaskDir) -> list[dict[str, Any]]:
    return [r for r in of_kind(journal_records(task), "intent") if r["call_id"] == CALL]


def result_of(task: TaskDir) -> dict[str, Any]:
    (found,) = [r for r in of_kind(journal_records(task), "result") if r["call_id"] == CALL]
    return found


@pytest.mark.parametrize(
    ("call", "check"),
    [
        (tool_use("read_file", path="seed.txt"), lambda ws: True),
        (
            tool_use("write_file", path="out.txt", content="v"),
            lambda ws: (ws / "out.txt").read_text() == "v",
        ),
    ],
    ids=["read_only", "idempotent"],
)
def test_dangling_rerun_safe_calls_are_rerun(
    spool: Spool, call: dict[str, Any], check: Callable[[Path], bool]
) -> None:
    task = one_call_task(spool, call, "safe")
    (task.path / "workspace").mkdir(exist_ok=True)
    (task.path / "workspace" / "seed.txt").write_text("seed")
    crash_in(task, call["name"])
    outcome, loop = run(task)
    assert outcome == Outcome("done", "end_turn", ExitCode.DONE)
    assert [i["attempt"] for i in intents(task)] == [1, 2]
    assert result_of(task)["outcome"] == "rerun"
    assert result_of(task)["is_error"] is False
    assert check(task.path / "workspace")
    assert "dangling_rerun" in events(task)
    assert "task_resumed" in events(task)
    check_transcripts(loop)
    assert scene(loop.state) == scene(replayed(task))


def test_dangling_keyed_call_is_rerun_with_the_same_key(spool: Spool) -> None:
    task = one_call_task(spool, tool_use("outbox_send", to="ops", body="hi"), "keyed")
    crash_in(task, "outbox_send", after_effect=False)  # died before the delivery
    outcome, loop = run(task)
    assert outcome.state == "done"
    first, second = intents(task)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["key"] == second["key"] == idempotency_key(task.id, 0, CALL)
    assert result_of(task)["outcome"] == "rerun"
    assert f"key {first['key']})" in result_of(task)["content"]
    assert sorted(p.name for p in (task.path / "workspace" / "outbox").iterdir()) == [
        f"{first['key']}.json"
    ]
    check_transcripts(loop)


def test_dangling_keyed_call_that_took_effect_is_reconciled(spool: Spool) -> None:
    task = one_call_task(spool, tool_use("outbox_send", to="ops", body="hi"), "reconciled")
    crash_in(task, "outbox_send", after_effect=True)  # delivered, result never recorded
    outcome, loop = run(task)
    assert outcome.state == "done"
    assert [i["attempt"] for i in intents(task)] == [1]  # not run again
    result = result_of(task)
    assert result["outcome"] == "reconciled"
    assert "already recorded" in result["content"]
    assert len(list((task.path / "workspace" / "outbox").iterdir())) == 1
    assert "dangling_reconciled" in events(task)
    check_transcripts(loop)


def held_task(spool: Spool, name: str) -> TaskDir:
    """A task whose unsafe append_file call died after appending: it must hold."""
    task = one_call_task(spool, tool_use("append_file", path="log.txt", content="x\n"), name)
    crash_in(task, "append_file")
    for _ in range(2):  # and it holds on every resume until someone decides
        outcome, loop = run(task)
        assert outcome.exit_code == ExitCode.HELD
        assert outcome.state == "held"
        assert CALL in outcome.reason
        assert requests(loop) == []
    assert (task.path / "workspace" / "log.txt").read_text() == "x\n"
    assert [i["attempt"] for i in intents(task)] == [1]
    hold = of_kind(journal_records(task), "hold")[-1]
    assert hold["calls"][0]["call_id"] == CALL
    assert hold["calls"][0]["attempt"] == 1
    assert "dangling_held" in events(task)
    (row,) = held_calls(task)
    assert (row["call_id"], row["tool"], row["effect"]) == (CALL, "append_file", "unsafe")
    return task


@pytest.mark.parametrize(
    ("action", "fields", "log", "outcome", "content"),
    [
        ("rerun", {}, "x\nx\n", "rerun", "appended 2 bytes to log.txt"),
        ("skip", {"reason": "checked by hand"}, "x\n", "skipped", "checked by hand"),
        ("result", {"result": "appended, verified"}, "x\n", "operator", "appended, verified"),
    ],
)
def test_held_call_resumes_with_the_operators_decision(
    spool: Spool, action: str, fields: dict[str, str], log: str, outcome: str, content: str
) -> None:
    task = held_task(spool, f"decide-{action}")
    decide(task, CALL, action=action, reason=fields.get("reason"), result=fields.get("result"))
    done, loop = run(task)
    assert done == Outcome("done", "end_turn", ExitCode.DONE)
    assert (task.path / "workspace" / "log.txt").read_text() == log
    (decision,) = of_kind(journal_records(task), "decision")
    assert (decision["call_id"], decision["attempt"], decision["action"]) == (CALL, 1, action)
    result = result_of(task)
    assert result["outcome"] == outcome
    assert content in result["content"]
    assert result["is_error"] is (action == "skip")
    expected_attempts = [1, 2] if action == "rerun" else [1]
    assert [i["attempt"] for i in intents(task)] == expected_attempts
    assert loop.state.held == []
    assert held_calls(task) == []
    check_transcripts(loop)
    assert tool_results(requests(loop)[0])[CALL]["content"] == result["content"]


def test_decision_for_another_attempt_is_ignored(spool: Spool) -> None:
    task = held_task(spool, "wrong-attempt")
    task.decisions.mkdir(exist_ok=True)
    key = intents(task)[0]["key"]
    task.decision_file(key, 2).write_text(json.dumps({"action": "rerun"}))
    outcome, _ = run(task)
    assert outcome.exit_code == ExitCode.HELD
    assert of_kind(journal_records(task), "decision") == []
    assert [i["attempt"] for i in intents(task)] == [1]


def test_a_decision_is_spent_by_its_attempt(spool: Spool) -> None:
    """Re-run was approved for attempt 1; attempt 2 died too: it holds again."""
    task = held_task(spool, "spent")
    decide(task, CALL, action="rerun")
    crash_in(task, "append_file")
    assert [i["attempt"] for i in intents(task)] == [1, 2]
    outcome, _ = run(task)
    assert outcome.exit_code == ExitCode.HELD
    assert of_kind(journal_records(task), "hold")[-1]["calls"][0]["attempt"] == 2
    assert [i["attempt"] for i in intents(task)] == [1, 2]
    (row,) = held_calls(task)
    assert row["attempt"] == 2
    decide(task, CALL, action="skip")
    outcome, loop = run(task)
    assert outcome.state == "done"
    assert (task.path / "workspace" / "log.txt").read_text() == "x\nx\n"
    check_transcripts(loop)


def test_invalid_decision_file_is_ignored(spool: Spool) -> None:
    task = held_task(spool, "bad-decision")
    task.decisions.mkdir(exist_ok=True)
    path = task.decision_file(intents(task)[0]["key"], 1)
    path.write_text(json.dumps({"action": "launch"}))
    assert run(task)[0].exit_code == ExitCode.HELD
    path.write_text("{not json")
    assert run(task)[0].exit_code == ExitCode.HELD
    assert of_kind(journal_records(task), "decision") == []
    assert "decision_invalid" in events(task)


def test_dangling_call_of_a_tool_that_is_gone_holds(spool: Spool) -> None:
    config = Config(tools=ToolsConfig(modules=("tests.tools_fixture",)))
    task = one_call_task(spool, tool_use("shout", text="hi"), "gone", config=config)
    crash_in(task, "shout", config=config)
    outcome, _ = run(task, tools=ToolRegistry.standard())  # the module was removed
    assert outcome.exit_code == ExitCode.HELD
    assert "no longer available" in outcome.reason


@pytest.mark.parametrize(
    ("call", "policy", "expected"),
    [
        (tool_use("append_file", path="log.txt", content="x"), "rerun", "done"),
        (tool_use("write_file", path="f.txt", content="x"), "hold", "held"),
        (tool_use("read_file", path="f.txt"), "hold", "held"),
    ],
)
def test_tools_policy_overrides_the_effect_class(
    spool: Spool, call: dict[str, Any], policy: str, expected: str
) -> None:
    task = one_call_task(spool, call, f"policy-{policy}")
    (task.path / "workspace").mkdir(exist_ok=True)
    (task.path / "workspace" / "f.txt").write_text("seed")
    crash_in(task, call["name"])
    without, _ = run(task, config=Config())
    assert without.state == ("held" if expected == "done" else "done")  # the class decides
    task = one_call_task(spool, call, f"policy-{policy}-2")
    (task.path / "workspace").mkdir(exist_ok=True)
    (task.path / "workspace" / "f.txt").write_text("seed")
    crash_in(task, call["name"])
    config = Config(tools=ToolsConfig(policy={call["name"]: policy}))
    outcome, loop = run(task, config=config)
    assert outcome.state == expected
    if expected == "done":
        assert [i["attempt"] for i in intents(task)] == [1, 2]
        check_transcripts(loop)
    else:
        assert "tools.policy says hold" in outcome.reason


def test_idempotency_keys() -> None:
    key = idempotency_key("t1", 0, "toolu_1")
    assert key == idempotency_key("t1", 0, "toolu_1")
    others = {
        idempotency_key("t2", 0, "toolu_1"),
        idempotency_key("t1", 1, "toolu_1"),
        idempotency_key("t1", 0, "toolu_2"),
    }
    assert key not in others
    assert len(others) == 3


def test_journal_built_by_hand_resumes(spool: Spool) -> None:
    """A dangling intent appended with Journal directly is settled the same way."""
    task = one_call_task(spool, tool_use("write_file", path="h.txt", content="hand"), "hand")
    message = {
        "role": "assistant",
        "content": [
            text("Working."),
            {"type": "tool_use", "id": CALL, "name": "write_file",
             "input": {"path": "h.txt", "content": "hand"}},
        ],
    }  # fmt: skip
    journal, _ = journal_module.Journal.open(task.journal, task=task.id)
    with journal:
        journal.append(
            [
                {"k": "turn", "turn": 1, "message": message, "stop_reason": "tool_use",
                 "usage": {"input_tokens": 3, "output_tokens": 4}, "model": "m"},
                {"k": "intent", "call_id": CALL, "tool": "write_file", "effect": "idempotent",
                 "key": "agentd-handmade", "attempt": 1},
            ]
        )  # fmt: skip
    outcome, loop = run(task)
    assert outcome.state == "done"
    assert intents(task)[-1] == {**intents(task)[-1], "attempt": 2, "key": "agentd-handmade"}
    assert (task.path / "workspace" / "h.txt").read_text() == "hand"
    assert loop.state.usage_total.input_tokens == 3 + size_tokens(loop.state.messages[:-1])
    check_transcripts(loop)


# -- snapshots --------------------------------------------------------------------------


def long_task(spool: Spool, name: str, turns: int = 6) -> TaskDir:
    responses = [
        reply(text(f"step {i}"), tool_use("write_file", path=f"f{i}.txt", content=str(i)))
        for i in range(turns)
    ]
    return scripted_task(spool, [*responses, DONE], name=name)


def test_resume_from_a_snapshot_equals_a_full_replay(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = long_task(spool, "snap")
    standard = ToolRegistry.standard()
    calls = {"n": 0}

    def crash_on_the_fifth(ctx: ToolContext, **data: Any) -> str:
        calls["n"] += 1
        if calls["n"] == 5:
            raise Crash
        return str(standard.get("write_file").func(ctx, **data))  # type: ignore[union-attr]

    tools = ToolRegistry(
        dataclasses.replace(t, func=crash_on_the_fifth) if t.name == "write_file" else t
        for t in standard
    )
    loop = make_loop(task, tools=tools, snapshot_every=2)
    with pytest.raises(Crash):
        loop.run()
    loop.close()
    snapshot = open_snapshot(task.snapshot.read_bytes())
    assert snapshot["turn"] == 4
    assert 0 < snapshot["offset"] < task.journal.stat().st_size

    starts: list[int] = []
    real_open = journal_module.Journal.open.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def spy(cls: type[journal_module.Journal], /, path: Path, start: int = 0, **header: Any) -> Any:
        starts.append(start)
        return real_open(cls, path, start, **header)

    monkeypatch.setattr(journal_module.Journal, "open", classmethod(spy))
    resumed = make_loop(task, snapshot_every=2)
    state = resumed.open()
    assert starts == [snapshot["offset"]]  # the snapshot was used
    assert scene(state.compact()) == scene(replayed(task).compact())  # what the next step needs
    assert [c.call_id for c in state.dangling()] == ["toolu_s00004_1"]
    outcome = resumed.run()
    resumed.close()
    assert outcome.state == "done"
    assert scene(resumed.state.compact()) == scene(replayed(task).compact())
    check_transcripts(resumed)

    fresh = long_task(spool, "nosnap")  # the same script, never interrupted
    monkeypatch.undo()
    plain, plain_loop = run(fresh)
    assert plain.state == "done"
    assert plain_loop.state.messages == resumed.state.messages


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "truncated",
        "wrong_version",
        "missing_key",
        "past_the_end",
        "mid_record",
        "negative_offset",
        "at_the_start",
        "flipped_bit",
    ],
)
def test_a_bad_snapshot_is_ignored(spool: Spool, damage: str) -> None:
    task = long_task(spool, f"bad-{damage.replace('_', '-')}", turns=4)
    outcome, done_loop = run(task, snapshot_every=2)
    assert outcome.state == "done"
    good = task.snapshot.read_bytes()
    data = open_snapshot(good)
    size = task.journal.stat().st_size
    assert 0 < data["offset"] <= size
    middle = len(good) // 2
    damaged = {  # sealed: damage the checksum does not catch
        "garbage": b"\x00\xffnot json",
        "truncated": good[:middle],
        "wrong_version": seal_snapshot({**data, "v": 99}),
        "missing_key": seal_snapshot({k: v for k, v in data.items() if k != "turns"}),
        "past_the_end": seal_snapshot({**data, "offset": size + 100}),
        "mid_record": seal_snapshot({**data, "offset": size - 7}),
        "negative_offset": seal_snapshot({**data, "offset": -5}),
        # found by the full fuzz campaign: from offset 0 the whole journal was folded
        # again onto a state that already held it
        "at_the_start": seal_snapshot({**data, "offset": 0}),
        "flipped_bit": good[:middle] + bytes([good[middle] ^ 4]) + good[middle + 1 :],
    }[damage]
    assert damaged != good
    task.snapshot.write_bytes(damaged)
    journal_before = task.journal.read_bytes()
    loop = make_loop(task)
    try:
        state = loop.open()
        assert scene(state) == scene(replayed(task))  # the whole fold: the snapshot was not used
        assert state.messages == done_loop.state.messages
        assert loop.run() == Outcome("done", "end_turn", ExitCode.DONE)
    finally:
        loop.close()
    assert task.journal.read_bytes() == journal_before, "recorded work was changed"


def test_snapshots_come_further_apart_as_the_transcript_grows(spool: Spool) -> None:
    # Every turn at most, and only once the journal has grown by a third of the last
    # snapshot's size: a snapshot's cost grows with the transcript, its cadence with it.
    responses = [  # random content: a snapshot grows with the transcript, compressed or not
        reply(tool_use("write_file", path=f"f{i}.txt", content=os.urandom(500).hex()))
        for i in range(40)
    ]
    task = scripted_task(spool, [*responses, DONE], name="cadence")
    writes: list[tuple[int, int, int]] = []  # (turn, journal size, snapshot size)
    loop = make_loop(task, snapshot_every=1)
    real = files_module.atomic_write  # type: ignore[attr-defined]  # patched where it is used

    def spy(path: Path, data: bytes, **kw: Any) -> None:
        if path == task.snapshot:  # on the snapshot thread: the loop may be past it
            scene = open_snapshot(data)
            writes.append((scene["turn"], scene["offset"], len(data)))
        real(path, data, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(files_module, "atomic_write", spy)
        assert loop.run().state == "done"
    loop.close()
    gaps = [later[0] - first[0] for first, later in itertools.pairwise(writes)]
    assert gaps[0] == 1 and max(gaps) > 1, gaps  # the size rule took over as it grew
    for (_, size, snap), (_, next_size, _) in itertools.pairwise(writes):
        assert next_size - size >= snap // SNAPSHOT_GROWTH


def test_a_call_asked_before_it_runs_is_held_on_every_resume_until_decided(
    spool: Spool,
) -> None:
    # docs/guides/tools.md: asked of a safe tool (write_file is idempotent), recorded
    # as asked and held; every resume holds it again, even under a config that no longer
    # asks: the intent says so, and only a decision runs it, once
    write = tool_use("write_file", CALL, path="a.txt", content="hi")
    task = scripted_task(spool, [reply(write), DONE], name="asked")
    asking = Config(tools=ToolsConfig(ask_effects=("idempotent",)))
    for config in (asking, asking, Config()):
        outcome, _ = run(task, config=config)
        assert outcome == Outcome("held", "approval: write_file", ExitCode.HELD)
        assert not (task.path / "workspace" / "a.txt").exists()
    intents = of_kind(journal_records(task), "intent")
    assert [(i["attempt"], i.get("asked")) for i in intents] == [(1, True)]
    (row,) = held_calls(task)
    assert (row["stage"], row["attempt"]) == ("before", 1)
    decide(task, CALL, action="rerun", attempt=1)
    outcome, _ = run(task)
    assert outcome.state == "done"
    assert (task.path / "workspace" / "a.txt").read_text() == "hi"
    result = next(r for r in journal_records(task) if r["k"] == "result")
    assert result["outcome"] == "ran"  # its first run
    intents = of_kind(journal_records(task), "intent")
    assert [(i["attempt"], i.get("asked")) for i in intents] == [(1, True), (2, None)]
