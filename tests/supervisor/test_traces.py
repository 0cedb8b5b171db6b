"""Traces against a real OTLP receiver (docs/design.md section 14): a real daemon, real
workers on the real SDK against the local Messages API, a kill -9 in the middle, and a
collector on 127.0.0.1 that decodes what it gets with ``opentelemetry-proto`` (over HTTP,
and over gRPC). One task is one trace across its worker runs; the killed run's span is
still exported, ended at its exit with status ERROR; the attribute names are the GenAI
conventions'; nothing of the prompt or the tools leaks without ``capture_content``; the
exporter's headers reach the collector and nothing else; a fork is a trace of its own
with a link; a collector that is away or hangs changes nothing in a task's outcome."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import structlog
from structlog.testing import capture_logs

from supervisor.relay import DAEMON_MARK, EventRelay
from supervisor.traces import ExportSettings, Finished, TraceAssembler, export_settings
from tests.daemon import Daemon, subreaper
from tests.otlp import OTLPReceiver, Received, unreachable_endpoint
from tests.support import journal_records, of_kind, poll_for
from tests.waterfall import render
from worker import credentials
from worker.config import TelemetryConfig
from worker.errors import ConfigError
from worker.events import Event, event_line, record_event
from worker.spans import SCHEMA_URL, identity, span_line, trace_id
from worker.spool import TaskSpec
from worker.store.memory import MemoryStore
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply, by_turn

MODEL = "claude-sonnet-4-6"
PROMPT_MARK = "prompt-marker-7f3a"  # in the prompt: never in a span without capture
TOOL_MARK = "tool-text-marker-91c2"  # in a tool's input and its result
SECRET = "s3cret-otlp-token-5e9d"  # noqa: S105  (the test's own, to find where it leaks)
HEADERS = f"authorization=Bearer%20{SECRET},x-tenant=acme"
LOCAL = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def config(endpoint: str, *, protocol: str = "http/protobuf", capture: bool = False) -> str:
    return (
        "[heartbeat]\ninterval = 0.2\ntimeout = 10.0\n"
        "[restart]\nbackoff_initial = 0.05\nbackoff_max = 0.2\nstop_grace = 5.0\n"
        '[tools]\nmodules = ["tests.crash_tools"]\n'
        f'[model]\nname = "{MODEL}"\nmax_tokens = 256\n'
        f'[telemetry]\notlp_endpoint = "{endpoint}"\notlp_protocol = "{protocol}"\n'
        f"capture_content = {'true' if capture else 'false'}\n"
    )


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("ANTHROPIC_", "OTEL_")) or name == "CREDENTIALS_DIRECTORY":
            monkeypatch.delenv(name)
    with subreaper():
        yield


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for daemon in daemons:
        daemon.cleanup()


def replies() -> list[Reply | Fault | dict[str, Any]]:
    """Four turns: a write with a marked text, a stall (the kill -9 lands in it), a read
    of a file that is not there (an error result), then the end."""
    return [
        Reply.tool_use("write_file", {"path": "a.txt", "content": TOOL_MARK}, text="Writing."),
        Reply.tool_use("stall", {"seconds": 60, "once": "stalled"}),
        Reply.tool_use("read_file", {"path": f"missing-{TOOL_MARK}.txt"}),
        Reply.text("Done."),
    ]


def start(
    made: list[Daemon], root: Path, receiver_endpoint: str, api: MessagesAPIServer, **kw: Any
) -> Daemon:
    daemon = Daemon(root, config(receiver_endpoint, **kw))
    made.append(daemon)
    env = {
        "ANTHROPIC_BASE_URL": api.base_url,
        "ANTHROPIC_API_KEY": DEFAULT_API_KEY,
        "OTEL_EXPORTER_OTLP_HEADERS": HEADERS,
        **LOCAL,
    }
    daemon.start(env)
    return daemon


def submit(daemon: Daemon, name: str) -> str:
    code, out, err = daemon.cli(
        "submit", "--name", name, "--prompt", f"Write, wait, read. {PROMPT_MARK}"
    )
    assert code == 0, err
    return out.strip()


def spans_of(receiver: OTLPReceiver, trace: str, count: int, what: str) -> list[Received]:
    def enough() -> list[Received] | None:
        mine = [s for s in receiver.received() if s.trace_id == trace]
        return mine if len(mine) >= count else None

    found = poll_for(enough, 60, what=what)
    assert found is not None
    return found


def every_value(spans: list[Received]) -> str:
    """Everything the collector got, as text: attributes, events, names, the resource."""
    return json.dumps(
        [[s.name, s.attributes, s.events, s.resource, s.description] for s in spans], default=str
    )


def test_one_task_is_one_trace_across_a_kill_9_with_the_killed_run_ended_in_error(
    made: list[Daemon], tmp_path: Path
) -> None:
    with OTLPReceiver() as receiver, MessagesAPIServer(responder=by_turn(replies())) as api:
        daemon = start(made, tmp_path / "d", receiver.endpoint, api)
        task = submit(daemon, "traced")
        row = daemon.wait_row(task, lambda r: r["phase"] == "tool:stall", what="the stall")
        killed = row["pid"]
        # the exporter's headers are the daemon's alone: not in a worker's environment
        assert SECRET.encode() not in Path(f"/proc/{killed}/environ").read_bytes()
        os.kill(killed, signal.SIGKILL)
        daemon.wait_state(task, "done", timeout=60)
        spec = daemon.task(task).load_spec()
        trace = trace_id(identity(task, spec.created_at))
        # two runs, four model calls, three tool calls that ended
        spans = spans_of(receiver, trace, 2 + 4 + 3, "every span of the task")
        headers = receiver.headers[-1]
        daemon.stop()

    runs = [s for s in spans if s.name == f"invoke_agent {task}"]
    assert len(runs) == 2 and len({r.span_id for r in runs}) == 2
    first, second = sorted(runs, key=lambda r: r.start)
    assert first.attributes["process.pid"] == killed
    assert first.status == 2 and "SIGKILL" in first.description  # ERROR, ended at its exit
    assert first.start < first.end <= second.start
    assert second.status == 1 and second.attributes["agentd.outcome"] == "done"
    assert {e[0] for e in second.events} >= {"task_resumed", "restart_scheduled"}
    assert "worker_exited" in {e[0] for e in first.events}
    for run in runs:
        assert run.parent == "" and run.kind == 1  # roots of the trace, INTERNAL
        assert run.attributes["gen_ai.operation.name"] == "invoke_agent"
        assert run.attributes["gen_ai.provider.name"] == "anthropic"
        assert run.attributes["gen_ai.conversation.id"] == task

    chats = [s for s in spans if s.name == f"chat {MODEL}"]
    assert len(chats) == 4
    for chat in chats:
        assert chat.parent in {first.span_id, second.span_id} and chat.kind == 3  # CLIENT
        attributes = chat.attributes
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "anthropic"
        assert attributes["gen_ai.request.model"] == MODEL
        assert attributes["gen_ai.usage.input_tokens"] > 0
        assert attributes["gen_ai.usage.output_tokens"] > 0
        assert attributes["gen_ai.response.finish_reasons"] in (["tool_use"], ["end_turn"])
        assert attributes["gen_ai.response.id"].startswith("msg_")

    tools = {s.attributes["gen_ai.tool.name"]: s for s in spans if s.name.startswith("execute")}
    assert set(tools) == {"write_file", "stall", "read_file"}
    for name, span in tools.items():
        assert span.name == f"execute_tool {name}"
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.attributes["gen_ai.tool.call.id"].startswith("toolu_")
        assert span.attributes["agentd.effect"] in ("idempotent", "read_only")
    assert tools["stall"].parent == second.span_id  # re-run after the kill
    assert tools["stall"].attributes["agentd.outcome"] == "rerun"
    assert tools["read_file"].attributes["error.type"] == "tool_error"
    assert tools["read_file"].status == 2
    assert "error.type" not in tools["write_file"].attributes

    assert {s.scope for s in spans} == {("agentd", spans[0].scope[1], SCHEMA_URL)}
    assert spans[0].resource["service.name"] == "agentd"
    # nothing of the prompt or the tools' text without capture_content
    shown = every_value(spans)
    assert PROMPT_MARK not in shown and TOOL_MARK not in shown
    assert "gen_ai.input.messages" not in shown and "gen_ai.tool.call.arguments" not in shown
    # the exporter's headers reach the collector, and no file of the spool, no event line
    assert headers["authorization"] == f"Bearer {SECRET}" and headers["x-tenant"] == "acme"
    assert SECRET not in shown
    for path in daemon.spool.root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in daemon.log_path.read_text()
    # the docs' waterfall is drawn from such spans: one bar a span, the run in error marked
    picture = ElementTree.fromstring(render(spans, "a task"))  # noqa: S314  (our own SVG)
    bars = picture.findall("{http://www.w3.org/2000/svg}rect")[1:]  # (the first: the ground)
    assert len(bars) == len(spans)
    assert sum(bar.get("stroke") == "#d62728" for bar in bars) == 2  # the killed run, read_file
    turns = of_kind(journal_records(daemon.task(task)), "turn")
    assert [t["id"] for t in turns] == [c.attributes["gen_ai.response.id"] for c in
                                        sorted(chats, key=lambda c: c.start)]  # fmt: skip


def test_traces_over_grpc_a_fork_with_a_link_and_captured_content(
    made: list[Daemon], tmp_path: Path
) -> None:
    done: list[Reply | Fault | dict[str, Any]] = [
        Reply.tool_use("write_file", {"path": "a.txt", "content": TOOL_MARK}),
        Reply.text("Ok."),
    ]
    with (
        OTLPReceiver(protocol="grpc") as receiver,
        MessagesAPIServer(responder=by_turn(done)) as api,
    ):
        daemon = start(made, tmp_path / "g", receiver.endpoint, api, protocol="grpc", capture=True)
        task = submit(daemon, "parent")
        daemon.wait_state(task, "done", timeout=60)
        code, _, err = daemon.cli("fork", task, "--at", "1", "--name", "child")
        assert code == 0, err
        daemon.wait_state("child", "done", timeout=60)
        parent_trace = trace_id(identity(task, daemon.task(task).load_spec().created_at))
        child_trace = trace_id(identity("child", daemon.task("child").load_spec().created_at))
        parent_spans = spans_of(receiver, parent_trace, 1 + 2 + 1, "the parent's spans")
        child_spans = spans_of(receiver, child_trace, 1 + 1, "the fork's spans")
        headers = receiver.headers[-1]
        daemon.stop()
    assert parent_trace != child_trace
    (child_run,) = [s for s in child_spans if s.name == "invoke_agent child"]
    assert [link[0] for link in child_run.links] == [parent_trace]
    # captured: the prompt's message, the reply, the tool's arguments and result
    shown = every_value(parent_spans)
    assert PROMPT_MARK in shown and TOOL_MARK in shown
    chats = [s for s in parent_spans if s.name.startswith("chat ")]
    assert any(PROMPT_MARK in c.attributes["gen_ai.input.messages"] for c in chats)
    assert all("gen_ai.output.messages" in c.attributes for c in chats)
    (write,) = [s for s in parent_spans if s.name == "execute_tool write_file"]
    assert TOOL_MARK in write.attributes["gen_ai.tool.call.arguments"]
    assert "gen_ai.tool.call.result" in write.attributes
    assert headers["authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize("collector", ["unreachable", "hanging"])
def test_a_collector_away_or_hanging_changes_nothing_in_the_outcome(
    made: list[Daemon], tmp_path: Path, collector: str
) -> None:
    with (
        OTLPReceiver(hang=True) as hanging,
        MessagesAPIServer(responder=by_turn(replies())) as api,
    ):
        endpoint = unreachable_endpoint() if collector == "unreachable" else hanging.endpoint
        daemon = start(made, tmp_path / collector, endpoint, api)
        task = submit(daemon, "untraced")
        row = daemon.wait_row(task, lambda r: r["phase"] == "tool:stall", what="the stall")
        os.kill(row["pid"], signal.SIGKILL)
        done = daemon.wait_state(task, "done", timeout=60)
        began = time.monotonic()
        code, _, err = daemon.stop()
        stopping = time.monotonic() - began
    assert code == 0, err
    assert done["reason"] == "end_turn" and done["turn"] == 4 and done["restarts"] == 1
    assert stopping < 30  # the flush at the stop is bounded (a few seconds at most)
    assert collector == "unreachable" or hanging.received() == []


def test_agentd_run_exports_its_task_trace_itself(made: list[Daemon], tmp_path: Path) -> None:
    done: list[Reply | Fault | dict[str, Any]] = [
        Reply.tool_use("list_dir", {}),
        Reply.text("Ok."),
    ]
    with OTLPReceiver() as receiver, MessagesAPIServer(responder=by_turn(done)) as api:
        daemon = Daemon(tmp_path / "r", config(receiver.endpoint))
        made.append(daemon)
        env = {"ANTHROPIC_BASE_URL": api.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY}
        run = daemon.run_cli(
            "run", "--name", "fg", "--prompt", "List.", env={**env, **LOCAL}, timeout=60
        )
        assert run.returncode == 0, run.stderr
        trace = trace_id(identity("fg", daemon.task("fg").load_spec().created_at))
        spans = spans_of(receiver, trace, 1 + 2 + 1, "the run's spans")
    names = sorted(s.name for s in spans)
    assert names == ["chat claude-sonnet-4-6"] * 2 + ["execute_tool list_dir", "invoke_agent fg"]
    (run_span,) = [s for s in spans if s.name == "invoke_agent fg"]
    assert run_span.status == 1 and run_span.attributes["agentd.outcome"] == "done"


# -- the pieces, without a daemon ---------------------------------------------------------


def _span(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "parent": None,
        "name": "invoke_agent t",
        "kind": "internal",
        "start": 1_000,
        "end": None,
        "attributes": {},
        "status": "unset",
        "links": [],
        "pid": 10,
        "run": "b" * 16,
    }
    return base | fields


def _event(name: Event, at: str, **fields: Any) -> dict[str, Any]:
    line = event_line(name, "info", **fields)
    line["timestamp"] = at
    return line


def test_the_assembler_closes_runs_at_their_exit_and_puts_events_on_their_run() -> None:
    out: list[Finished] = []
    assembler = TraceAssembler(out.append)
    take = assembler.take
    take("t", span_line(_span()))  # run 1 opens
    take("t", _event(Event.TASK_RESUMED, "2026-12-01T00:00:01.000Z", pid=10))
    take("t", span_line(_span(span_id="c" * 16, parent="b" * 16, name="chat m", end=2_000)))
    take("t", _event(Event.WORKER_EXITED, "2026-12-01T00:00:02.000Z", pid=10, signal="SIGKILL"))
    take("t", _event(Event.RESTART_SCHEDULED, "2026-12-01T00:00:02.100Z", delay=0))
    take("t", span_line(_span(span_id="d" * 16, run="d" * 16, pid=11, start=5_000)))
    take("t", span_line(_span(span_id="d" * 16, run="d" * 16, pid=11, start=5_000, end=9_000,
                              status="ok")))  # fmt: skip
    take("t", {"event": "span", "span": {"trace_id": "zz"}})  # not a span: dropped
    take("t", _event(Event.TASK_SUBMITTED, "2026-12-01T00:00:00.000Z"))  # not a span event
    assert [s.name for s in out] == ["chat m", "invoke_agent t", "invoke_agent t"]
    chat, killed, second = out
    assert chat.parent == "b" * 16 and chat.end == 2_000
    assert killed.status == "error" and "SIGKILL" in (killed.description or "")
    exited = datetime(2026, 12, 1, 0, 0, 2, tzinfo=UTC)
    assert killed.end == int(exited.timestamp()) * 10**9  # the exit's time
    assert [e[0] for e in killed.events] == ["task_resumed", "worker_exited"]
    assert [e[0] for e in second.events] == ["restart_scheduled"]  # between runs: the next
    assert second.status == "ok" and second.end == 9_000
    # a run whose exit was never seen ends when the next one starts, at its last sign
    take("u", span_line(_span(trace_id="e" * 32, start=100)))
    take("u", span_line(_span(trace_id="e" * 32, span_id="f" * 16, parent="b" * 16,
                              name="chat m", start=150, end=300)))  # fmt: skip
    take("u", span_line(_span(trace_id="e" * 32, span_id="9" * 16, run="9" * 16, start=400)))
    assert out[-1].name == "invoke_agent t" and out[-1].end == 300 and out[-1].status == "error"


def test_the_relay_hands_every_line_to_the_trace_and_logs_no_span() -> None:
    store = MemoryStore()
    store.create(TaskSpec(id="t1", prompt="p"), {"state": "queued"})
    taken: list[str] = []

    class Sink:
        def take(self, task: str, event: Mapping[str, Any]) -> None:
            taken.append(str(event["event"]))

        def forget(self, task: str) -> None:
            taken.append("forgotten")

    relay = EventRelay(structlog.get_logger(), store)
    relay.spans = Sink()
    relay.track("t1", from_end=False)
    store.append_event("t1", span_line(_span()))
    mark, value = DAEMON_MARK
    record_event(store, "t1", Event.WORKER_EXITED, pid=10, **{mark: value})
    record_event(store, "t1", Event.TASK_RESUMED, pid=11)
    with capture_logs() as seen:
        relay.pull("t1")
    assert taken == ["span", "worker_exited", "task_resumed"]
    assert [e["event"] for e in seen] == ["task_resumed"]  # no span, and not the daemon's own
    relay.forget("t1")
    assert taken[-1] == "forgotten"


def test_export_settings_follow_the_otlp_environment_over_the_config() -> None:
    config = TelemetryConfig(otlp_endpoint="http://collector:4318/")
    held = credentials.Credentials({credentials.OTLP_HEADERS: "api-key=k%3D1,bad"})
    assert export_settings(TelemetryConfig(), {}, held) is None
    settings = export_settings(config, {}, held)
    assert settings == ExportSettings(
        "http://collector:4318/v1/traces", "http/protobuf", {"api-key": "k=1"}
    )
    assert "k=1" not in repr(settings)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    assert export_settings(config, env, held) == ExportSettings(
        "http://other:4317", "grpc", {"api-key": "k=1"}
    )
    full = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:1/custom"}
    assert export_settings(config, full, held).endpoint == "http://x:1/custom"  # type: ignore[union-attr]
    assert export_settings(config, {"OTEL_SDK_DISABLED": "true"}, held) is None
    assert export_settings(TelemetryConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1"}, held)
    with pytest.raises(ConfigError, match="http/json"):
        export_settings(config, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, held)
    # the headers are a secret: redacted wherever a held secret is
    assert "k=1" in held.secrets() and "k%3D1" in held.secrets()
    assert held.for_workers().get(credentials.OTLP_HEADERS) is None
