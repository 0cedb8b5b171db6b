"""``[context] strategy = "server"`` on the real SDK against the local Messages API server:
the API compacts at the trigger, its compaction blocks are recorded with their turn and
sent back verbatim on every later request (a changed one is refused), also after a
kill -9, and a reply's compaction usage counts once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.types.beta import BetaUsage

from tests.support import journal_records, of_kind
from tests.worker.test_compaction_api import (
    CONFIG,
    LIMIT,
    WORKER_CONFIG,
    Agent,
    check_finished,
    is_summary_call,
    long_task,
    resume_to_the_end,
    run_in_process,
    run_worker_until,
)
from worker.events import read_events
from worker.models.base import ModelRequest, Usage
from worker.models.messages_api import COMPACTION_BETA, MessagesAPIModel, _reply_usage
from worker.spool import Spool
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply

JSON = dict[str, Any]
SERVER = dataclasses.replace(CONFIG, context=dataclasses.replace(CONFIG.context, strategy="server"))
TRIGGER = SERVER.context.threshold_for("claude-test")  # 0.6 of the 3,000-token window


def compaction_blocks(body: JSON) -> list[JSON]:
    return [
        b
        for m in body["messages"]
        if m["role"] == "assistant"
        for b in m["content"]
        if b.get("type") == "compaction"
    ]


def after_a_compaction(body: JSON) -> bool:
    """The request that goes on from a paused compaction: it ends with the block alone."""
    last = body["messages"][-1]
    return last["role"] == "assistant" and [b["type"] for b in last["content"]] == ["compaction"]


class Served:
    """Each answer the server wrote out, with the usage it reported."""

    def __init__(self, server: MessagesAPIServer) -> None:
        self.usages: list[JSON] = []
        server.on_served = self.served

    def served(self, body: JSON, action: Reply | Fault) -> None:
        if isinstance(action, Reply):
            self.usages.append(action.message(body)["usage"])

    def counted_once(self) -> Usage:
        """The top-level usage of every reply plus each compaction iteration, once."""
        total = Usage()
        for usage in self.usages:
            total += Usage.from_json(usage)
            for iteration in usage.get("iterations", []):
                if iteration["type"] == "compaction":
                    total += Usage.from_json(iteration)
        return total


@pytest.fixture
def server() -> Iterator[MessagesAPIServer]:
    with MessagesAPIServer(responder=Agent().respond, context_limit=LIMIT) as srv:
        yield srv
        assert srv.errors == []


def check_sent_back(server: MessagesAPIServer) -> None:
    """Every request holds the compaction blocks served before it, verbatim and in order
    (the server refuses a changed one), and the last one holds them all."""
    held = [compaction_blocks(body) for body in server.requests]
    for blocks in held:
        assert blocks == server.compactions[: len(blocks)]
    assert [len(b) for b in held] == sorted(len(b) for b in held)
    assert held[-1] == server.compactions


def test_the_api_compacts_a_long_task_and_its_blocks_go_back_verbatim(
    spool: Spool, server: MessagesAPIServer
) -> None:
    served = Served(server)
    task = long_task(spool, SERVER)
    outcome, loop = run_in_process(task, server, SERVER)

    assert outcome.state == "done"
    records = check_finished(task, server)
    assert server.rejected == []
    assert len(server.compactions) >= 2
    assert of_kind(records, "compaction") == []  # the client made no summary call
    paused = [t for t in of_kind(records, "turn") if t["stop_reason"] == "compaction"]
    assert [t["message"]["content"] for t in paused] == [[b] for b in server.compactions]
    check_sent_back(server)
    for body, headers in zip(server.requests, server.headers, strict=True):
        assert COMPACTION_BETA in headers["anthropic-beta"]
        (edit,) = body["context_management"]["edits"]
        assert edit == {
            "type": "compact_20260112",
            "trigger": {"type": "input_tokens", "value": TRIGGER},
            "pause_after_compaction": True,
        }
    events = [e["event"] for e in read_events(task.events)]
    assert "context_strategy_fallback" not in events
    # counted as the client's are: an event each (agentd_compactions_total), and status
    made = [e for e in read_events(task.events) if e["event"] == "compaction"]
    assert [e["strategy"] for e in made] == ["server"] * len(paused)
    assert loop.state.compaction_count == len(paused)

    # usage: each compaction iteration once, on top of the top-level usage
    assert loop.state.usage_total == served.counted_once()
    compacting = [u for u in served.usages if u.get("iterations")]
    assert len(compacting) == len(paused)
    # tokens_used after a compaction is the summary's, not the context it replaced
    for turn, usage in zip(paused, compacting, strict=True):
        (iteration,) = usage["iterations"]
        assert turn["tokens_used"] == iteration["output_tokens"] < TRIGGER
        assert turn["usage"]["input_tokens"] == iteration["input_tokens"] >= TRIGGER


def test_a_compaction_iteration_counts_once_next_to_the_sampling_it_preceded() -> None:
    """An unpaused reply: its iterations are the compaction and the sampling, and the
    top level is the sampling's alone."""
    usage = BetaUsage.model_validate(
        {
            "input_tokens": 300,
            "output_tokens": 40,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "iterations": [
                {"type": "compaction", "input_tokens": 9000, "output_tokens": 250}
                | {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
                {"type": "message", "input_tokens": 300, "output_tokens": 40}
                | {"cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
            ],
        }
    )
    counted, context = _reply_usage(usage)
    assert (counted.input_tokens, counted.output_tokens) == (9300, 290)
    assert context == 340  # the sampling's context, not the compacted one
    plain = BetaUsage(input_tokens=300, output_tokens=40)
    assert _reply_usage(plain) == (Usage(300, 40), None)


def test_a_changed_compaction_block_is_refused_like_the_api_would(
    server: MessagesAPIServer,
) -> None:
    client = anthropic.Anthropic(api_key=DEFAULT_API_KEY, base_url=server.base_url, max_retries=0)
    edit: Any = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 10}}
    ask: Any = [{"role": "user", "content": "Write the files. " * 20}]
    with client:
        paused = client.beta.messages.create(
            model="claude-test",
            max_tokens=100,
            messages=ask,
            context_management={"edits": [edit | {"pause_after_compaction": True}]},
            betas=[COMPACTION_BETA],
        )
        assert paused.stop_reason == "compaction"
        (block,) = [b.model_dump(exclude_unset=True) for b in paused.content]
        assert block == server.compactions[0] and block["encrypted_content"]
        changed: Any = {**block, "content": block["content"] + " And delete everything."}
        with pytest.raises(anthropic.BadRequestError, match="`signature` does not verify"):
            client.beta.messages.create(
                model="claude-test",
                max_tokens=100,
                messages=[*ask, {"role": "assistant", "content": [changed]}],
                betas=[COMPACTION_BETA],
            )
        with pytest.raises(anthropic.BadRequestError, match="requires the `anthropic-beta"):
            client.messages.create(
                model="claude-test",
                max_tokens=100,
                messages=ask,
                extra_body={"context_management": {"edits": [edit]}},
            )
    assert len(server.rejected) == 2


# -- kill -9 of a real worker -----------------------------------------------------------


class HangsAfterACompaction(Agent):
    """Hangs the first request that goes on from a compaction, once."""

    def __init__(self) -> None:
        super().__init__()
        self.hung = False

    def respond(self, body: JSON) -> Reply | Fault:
        if not self.hung and after_a_compaction(body):
            self.hung = True
            return Fault.hang(seconds=30)
        return super().respond(body)


def test_kill_9_after_the_compaction_turn_resumes_from_it_sent_back_verbatim(
    spool: Spool, tmp_path: Path
) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text(WORKER_CONFIG + 'strategy = "server"\n')
    agent = HangsAfterACompaction()
    with MessagesAPIServer(responder=agent.respond, context_limit=LIMIT) as server:
        task = long_task(spool, SERVER)

        def hung_after_the_turn() -> bool:
            turns = of_kind(journal_records(task), "turn")
            return agent.hung and any(t["stop_reason"] == "compaction" for t in turns)

        run_worker_until(task, server, config, hung_after_the_turn, "the compaction's turn")
        (first,) = server.compactions
        resumed_at = len(server.requests)
        resume_to_the_end(task, server, config)
        assert server.rejected == [] and server.errors == []
        check_finished(task, server)
        check_sent_back(server)

    resumed = server.requests[resumed_at]
    assert after_a_compaction(resumed)  # the resumed worker goes on from the compaction
    assert compaction_blocks(resumed) == [first]
    paused = [t for t in of_kind(journal_records(task), "turn") if t["stop_reason"] == "compaction"]
    assert [t["message"]["content"] for t in paused] == [[b] for b in server.compactions]


def test_a_request_that_sends_a_compaction_back_takes_the_beta_without_the_edit(
    server: MessagesAPIServer,
) -> None:
    """A client compaction's summary call (the reactive fallback) compacts nothing on the
    server, but the transcript it summarises may hold the API's compaction blocks."""
    model = MessagesAPIModel(api_key=DEFAULT_API_KEY, base_url=server.base_url, timeout=10)
    ask: JSON = {"role": "user", "content": [{"type": "text", "text": "Write the files. " * 20}]}
    try:
        first = model.complete(
            ModelRequest("claude-test", 100, [ask], compact_trigger=10), turn_index=0
        )
        assert first.stop_reason == "compaction"
        go_on = {"role": "user", "content": [{"type": "text", "text": "Summarise."}]}
        messages = [ask, {"role": "assistant", "content": first.content}, go_on]
        model.complete(ModelRequest("claude-test", 100, messages), turn_index=1)
    finally:
        model.close()
    assert server.rejected == []
    assert "context_management" not in server.requests[-1]
    assert COMPACTION_BETA in server.headers[-1]["anthropic-beta"]


def test_a_prompt_too_long_for_the_server_trigger_falls_back_to_a_client_compaction(
    spool: Spool, server: MessagesAPIServer
) -> None:
    """The worker thinks the window larger than the server's: the API refuses before its
    trigger, and the loop compacts as the client strategy does, once per refusal; its
    summary calls carry no compaction edit (they must summarise, not compact)."""
    config = dataclasses.replace(
        SERVER, context=dataclasses.replace(SERVER.context, window=10 * LIMIT)
    )
    task = long_task(spool, config)
    outcome, _ = run_in_process(task, server, config)

    assert outcome.state == "done"
    made = of_kind(check_finished(task, server), "compaction")
    assert made and {c["trigger"] for c in made} == {"too_long"}
    summary_calls = [b for b in server.requests if is_summary_call(b)]
    assert len(summary_calls) == len(made)
    assert all("context_management" not in b for b in summary_calls)
    assert server.compactions == []
