"""Compaction against the local Messages API server on the real SDK: a window enforced
as the API enforces it, proactive and reactive compaction, and kill -9 of a real worker
in the summary call and after its record."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.submit import submit
from tests.support import (
    assert_paired,
    finish,
    journal_records,
    kill_group,
    make_loop,
    of_kind,
    poll_for,
    reap,
    start_worker,
)
from worker.compaction import SUMMARY_INSTRUCTION
from worker.config import Config, ContextConfig, ModelConfig
from worker.models.messages_api import MessagesAPIModel
from worker.protocol import ExitCode
from worker.spool import Spool, TaskDir
from worker.state import fold
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply

TURNS = 30  # write_file calls before the last reply
LIMIT = 3000  # the server's window, in its tokens (a request's JSON size over 4)
PAYLOAD = "x" * 800  # what each write carries: about 200 tokens a turn
CONFIG = Config(
    model=ModelConfig(name="claude-test", max_tokens=100),
    context=ContextConfig(window=LIMIT, compact_at=0.6, keep_turns=3),
)
_PATH = re.compile(r"f(\d+)\.txt")
JSON = dict[str, Any]


def file_number(name: str) -> int:
    match = _PATH.fullmatch(name)
    assert match is not None, name
    return int(match.group(1))


def is_summary_call(body: JSON) -> bool:
    last = body["messages"][-1]["content"]
    return isinstance(last, list) and any(
        b.get("type") == "text" and b.get("text", "").startswith(SUMMARY_INSTRUCTION[:40])
        for b in last
    )


def next_file(body: JSON) -> int:
    """The file this request's reply writes: one after the latest assistant message's
    (which every compacted transcript keeps, keep_turns being at least 1)."""
    for message in reversed(body["messages"]):
        if message["role"] == "assistant":
            for block in message["content"]:
                if block.get("type") == "tool_use":
                    return file_number(block["input"]["path"]) + 1
    return 1


class Agent:
    """The server's side of a long task: ``TURNS`` writes, then done; summaries name
    the files written so far. ``hang_summary`` hangs the next summary call,
    ``hang_after_summary`` the first request after a summary was served."""

    def __init__(self) -> None:
        self.summaries = 0
        self.hang_summary = False
        self.hang_after_summary = False

    def respond(self, body: JSON) -> Reply | Fault:
        if is_summary_call(body):
            if self.hang_summary:
                self.hang_summary = False
                return Fault.hang(seconds=30)
            self.summaries += 1
            return Reply.text(f"Files f1 to f{next_file(body) - 1} are written.\nGo on.")
        if self.hang_after_summary and self.summaries:
            self.hang_after_summary = False
            return Fault.hang(seconds=30)
        k = next_file(body)
        if k > TURNS:
            return Reply.text("All files are written.")
        return Reply.tool_use("write_file", {"path": f"f{k}.txt", "content": PAYLOAD})


@pytest.fixture
def agent() -> Agent:
    return Agent()


@pytest.fixture
def server(agent: Agent) -> Iterator[MessagesAPIServer]:
    with MessagesAPIServer(responder=agent.respond, context_limit=LIMIT) as srv:
        yield srv
        assert srv.errors == []


def too_long(server: MessagesAPIServer) -> int:
    return sum("prompt is too long" in r.message for r in server.rejected)


def long_task(spool: Spool, config: Config = CONFIG) -> TaskDir:
    return submit(spool, config, prompt="Write the files.", name="long", model="claude-test")


def run_in_process(task: TaskDir, server: MessagesAPIServer, config: Config) -> Any:
    model = MessagesAPIModel(api_key=DEFAULT_API_KEY, base_url=server.base_url, timeout=10)
    loop = make_loop(task, config=config, model=model)
    try:
        return loop.run(), loop
    finally:
        loop.close()


def check_finished(task: TaskDir, server: MessagesAPIServer) -> list[JSON]:
    """The task wrote every file once, and every request had a paired transcript."""
    records = journal_records(task)
    (end,) = of_kind(records, "end")
    assert (end["state"], end["reason"]) == ("done", "end_turn")
    assert [r for r in server.rejected if "prompt is too long" not in r.message] == []
    for body in server.requests:
        assert_paired(body["messages"])
    written = sorted(file_number(p.name) for p in task.path.glob("workspace/f*.txt"))
    assert written == list(range(1, TURNS + 1))
    assert len(of_kind(records, "intent")) == TURNS  # no write ran twice
    return records


def test_a_task_past_the_window_compacts_before_the_api_refuses(
    spool: Spool, server: MessagesAPIServer, agent: Agent
) -> None:
    task = long_task(spool)
    outcome, loop = run_in_process(task, server, CONFIG)

    assert outcome.state == "done"
    records = check_finished(task, server)
    made = of_kind(records, "compaction")
    assert len(made) >= 2 and {c["trigger"] for c in made} == {"threshold"}
    assert too_long(server) == 0
    assert agent.summaries == len(made)
    assert len(loop.state.live_compactions()) == len(made)


def test_a_prompt_the_api_calls_too_long_is_compacted_and_retried(
    spool: Spool, server: MessagesAPIServer
) -> None:
    config = Config(
        model=CONFIG.model, context=ContextConfig(window=10 * LIMIT, keep_turns=3)
    )  # the worker thinks the window is larger than the server's
    task = long_task(spool, config)
    outcome, _ = run_in_process(task, server, config)

    assert outcome.state == "done"
    records = check_finished(task, server)
    made = of_kind(records, "compaction")
    assert len(made) >= 2 and {c["trigger"] for c in made} == {"too_long"}
    assert too_long(server) == len(made)  # one refusal each, none after its compaction


def test_a_window_too_small_for_the_kept_turns_fails_naming_the_setting(
    spool: Spool, server: MessagesAPIServer
) -> None:
    config = Config(model=CONFIG.model, context=ContextConfig(window=10 * LIMIT, keep_turns=12))
    task = long_task(spool, config)
    outcome, _ = run_in_process(task, server, config)

    assert outcome.state == "failed"
    assert "[context] keep_turns (now 12)" in outcome.reason


# -- kill -9 of a real worker -----------------------------------------------------------

WORKER_CONFIG = """\
[model]
name = "claude-test"
max_tokens = 100

[context]
window = 3000
compact_at = 0.6
keep_turns = 3
"""


def run_worker_until(
    task: TaskDir, server: MessagesAPIServer, config: Path, until: Any, what: str
) -> None:
    """Start ``python -m worker`` on the local server, kill -9 its group once ``until()``."""
    proc = start_worker(task, env=api_env(server), args=["--config", str(config)])
    try:
        poll_for(until, timeout=30, what=what)
        kill_group(proc)
    finally:
        reap(proc)


def api_env(server: MessagesAPIServer) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY}


def resume_to_the_end(task: TaskDir, server: MessagesAPIServer, config: Path) -> None:
    proc = start_worker(task, env=api_env(server), args=["--config", str(config)])
    code, err = finish(proc, timeout=60)
    assert code == ExitCode.DONE, err


@pytest.fixture
def worker_config(tmp_path: Path) -> Path:
    path = tmp_path / "agentd.toml"
    path.write_text(WORKER_CONFIG)
    return path


def test_kill_9_in_the_summary_call_makes_it_again_on_resume(
    spool: Spool, server: MessagesAPIServer, agent: Agent, worker_config: Path
) -> None:
    task = long_task(spool)
    agent.hang_summary = True
    run_worker_until(
        task,
        server,
        worker_config,
        lambda: any(is_summary_call(b) for b in server.requests),
        "a summary call",
    )
    assert of_kind(journal_records(task), "compaction") == []
    hung = len(server.requests)

    resume_to_the_end(task, server, worker_config)
    records = check_finished(task, server)
    made = of_kind(records, "compaction")
    assert agent.summaries == len(made)  # the hung call was made again, once
    assert is_summary_call(server.requests[hung])  # first thing on resume
    state = fold(task.load_spec().prompt, records)
    counted = sum(r["usage"]["input_tokens"] for r in [*of_kind(records, "turn"), *made])
    assert state.usage_total.input_tokens == counted  # the lost call counts nothing


def test_kill_9_after_the_record_resumes_compacted_with_no_second_summary(
    spool: Spool, server: MessagesAPIServer, agent: Agent, worker_config: Path
) -> None:
    task = long_task(spool)
    agent.hang_after_summary = True

    def hung_after_the_record() -> bool:
        served = agent.summaries and not agent.hang_after_summary
        return bool(served and of_kind(journal_records(task), "compaction"))

    run_worker_until(task, server, worker_config, hung_after_the_record, "the compaction record")
    (first,) = of_kind(journal_records(task), "compaction")
    resumed_at = len(server.requests)

    resume_to_the_end(task, server, worker_config)
    records = check_finished(task, server)
    made = of_kind(records, "compaction")
    assert agent.summaries == len(made)
    ranges = [(c["first"], c["last"]) for c in made]
    assert ranges == sorted(set(ranges)) and ranges[0] == (first["first"], first["last"])
    resumed = server.requests[resumed_at]
    assert not is_summary_call(resumed)  # resumed from the compacted transcript
    assert "Files f1 to" in resumed["messages"][0]["content"][1]["text"]


# -- content blocks agentd does not interpret -------------------------------------------


def opaque_blocks(k: int) -> list[JSON]:
    """Blocks of every kind agentd passes through without reading them, with their opaque
    fields (a null one included), for turn k."""
    return [
        {"type": "thinking", "thinking": f"Turn {k}: next file.", "signature": f"sig{k}=="},
        {"type": "redacted_thinking", "data": f"cmVkYWN0ZWQ{k}"},
        {"type": "server_tool_use", "id": f"srvtoolu_{k:04d}", "name": "web_search"}
        | {"input": {"query": f"file {k}"}},
        {
            "type": "web_search_tool_result",
            "tool_use_id": f"srvtoolu_{k:04d}",
            "content": [
                {"type": "web_search_result", "url": "https://example.com/", "title": "x"}
                | {"encrypted_content": f"ZW5j{k}", "page_age": None}
            ],
        },
        {"type": "compaction", "content": None, "encrypted_content": f"b3BhcXVl{k}"},
    ]


class OpaqueAgent(Agent):
    """``Agent``'s task with the opaque blocks in front of every turn's reply; ``served``
    holds what turn k's reply said (the same on every retry: its ids are fixed)."""

    def __init__(self) -> None:
        super().__init__()
        self.served: dict[int, list[JSON]] = {}
        self.hang_at: int | None = None

    def respond(self, body: JSON) -> Reply | Fault:
        if is_summary_call(body):
            return super().respond(body)
        k = next_file(body)
        if k == self.hang_at:
            self.hang_at = None
            return Fault.hang(seconds=30)
        reply = super().respond(body)
        assert isinstance(reply, Reply)
        for block in reply.content:
            if block["type"] == "tool_use":
                block["id"] = f"toolu_{k:04d}"
        reply.content = [*opaque_blocks(k), *reply.content]
        self.served[k] = reply.content
        return reply


def turn_of(message: JSON) -> int:
    """The turn of an assistant message: the file its write_file call writes (the end: 0)."""
    paths = [b["input"]["path"] for b in message["content"] if b["type"] == "tool_use"]
    return file_number(paths[0]) if paths else TURNS + 1


def test_blocks_agentd_does_not_interpret_go_back_verbatim_across_a_kill_and_compactions(
    spool: Spool, worker_config: Path
) -> None:
    agent = OpaqueAgent()
    agent.hang_at = 8  # the first worker is killed in the call of turn 8
    with MessagesAPIServer(responder=agent.respond, context_limit=2 * LIMIT) as server:
        task = long_task(spool)
        run_worker_until(
            task, server, worker_config, lambda: agent.hang_at is None, "the call of turn 8"
        )
        resume_to_the_end(task, server, worker_config)
        assert server.rejected == [] and server.errors == []

    records = journal_records(task)
    assert of_kind(records, "compaction"), "the task never compacted"
    recorded = [r["message"] for r in of_kind(records, "turn")]
    assert [m["content"] for m in recorded] == [agent.served[turn_of(m)] for m in recorded]
    sent = [m for body in server.requests for m in body["messages"] if m["role"] == "assistant"]
    assert len(sent) > TURNS  # requests and summary calls send earlier turns back
    for message in sent:
        assert message["content"] == agent.served[turn_of(message)], turn_of(message)
