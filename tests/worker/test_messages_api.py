"""The ``anthropic`` backend on the real SDK, against the local Messages API server.

Every fault the API can produce is injected in turn: the retryable ones must surface as
``RetryableModelError`` and then succeed through ``call_with_retries`` with the usage of
the successful reply only; the final ones must end in a ``ModelError`` that tells the
operator what to fix and never shows the API key. The server's validator is tested too,
since other tests lean on ``srv.rejected == []`` to prove a transcript is API-valid.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.errors import ModelError, RetryableModelError
from worker.models.base import ModelRequest, Usage
from worker.models.messages_api import MessagesAPIModel
from worker.models.retry import call_with_retries
from worker.testing.messages_api import (
    DEFAULT_API_KEY,
    Fault,
    MessagesAPIServer,
    Reply,
    validate_request,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0  # the model's silence timeout
HANG_TIMEOUT = 0.25  # ... in the hang tests, which wait it out
USAGE = {
    "input_tokens": 120,
    "output_tokens": 17,
    "cache_creation_input_tokens": 30,
    "cache_read_input_tokens": 900,
}
HELLO: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
TOOLS = [{"name": "write_file", "description": "w", "input_schema": {"type": "object"}}]


def request(messages: list[dict[str, Any]] = HELLO, **kw: Any) -> ModelRequest:
    return ModelRequest(model="claude-test", max_tokens=256, messages=messages, **kw)


@pytest.fixture
def server() -> Iterator[MessagesAPIServer]:
    with MessagesAPIServer() as srv:
        yield srv
        assert srv.errors == []


@pytest.fixture
def model(server: MessagesAPIServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MessagesAPIModel]:
    """The backend as a worker builds it: key and URL from the environment only."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", server.api_key or "")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.base_url)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    backend = MessagesAPIModel(timeout=TIMEOUT)
    yield backend
    backend.close()


@pytest.fixture
def quick_model(model: MessagesAPIModel) -> Iterator[MessagesAPIModel]:
    """The same, with a short silence timeout, for the hang tests."""
    backend = MessagesAPIModel(timeout=HANG_TIMEOUT)
    yield backend
    backend.close()


def retry(model: MessagesAPIModel, req: ModelRequest, errors: list[Exception]) -> Any:
    return call_with_retries(
        model,
        req,
        turn_index=0,
        attempts=5,
        backoff_initial=0.0,
        sleep=lambda _: None,
        on_retry=lambda error, attempt, delay: errors.append(error),
    )


def test_module_does_not_import_the_sdk() -> None:
    code = "import sys, worker.models.messages_api; sys.exit('anthropic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


def test_text_reply(server: MessagesAPIServer, model: MessagesAPIModel) -> None:
    server.replies.append(Reply.text("Hello there, how can I help today?", usage=USAGE))
    reply = model.complete(request(system="Be brief.", tools=TOOLS), turn_index=0)
    assert reply.content == [{"type": "text", "text": "Hello there, how can I help today?"}]
    assert reply.stop_reason == "end_turn"
    assert reply.model == "claude-test"
    assert reply.usage == Usage(120, 17, 30, 900)  # message_delta's totals, cache included
    sent = server.requests[0]
    assert sent["stream"] is True
    assert sent["system"] == "Be brief."
    assert sent["tools"] == TOOLS
    assert sent["messages"] == HELLO
    assert server.headers[0]["authorization"] == f"Bearer {DEFAULT_API_KEY}"
    assert server.rejected == []


def test_tool_use_reply_goes_back_to_the_api_as_it_came(
    server: MessagesAPIServer, model: MessagesAPIModel
) -> None:
    tool_input = {"path": "notes/a.txt", "content": "x" * 50, "mode": None, "n": [1, {"k": 2}]}
    server.replies.append(Reply.tool_use("write_file", tool_input, text="Writing.", id="toolu_1"))
    reply = model.complete(request(tools=TOOLS), turn_index=0)
    assert reply.stop_reason == "tool_use"
    assert reply.content == [
        {"type": "text", "text": "Writing."},
        {"type": "tool_use", "id": "toolu_1", "name": "write_file", "input": tool_input},
    ]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    history = [*HELLO, {"role": "assistant", "content": reply.content}]
    server.replies.append(Reply.text("Done."))
    model.complete(request([*history, {"role": "user", "content": [result]}]), turn_index=1)
    assert server.rejected == []


def test_thinking_blocks_keep_their_signature(
    server: MessagesAPIServer, model: MessagesAPIModel
) -> None:
    thinking = {"type": "thinking", "thinking": "Let me see.", "signature": "sig-abc"}
    server.replies.append(Reply([thinking, {"type": "text", "text": "Yes."}]))
    reply = model.complete(request(), turn_index=0)
    assert reply.content[0] == thinking
    history = [*HELLO, {"role": "assistant", "content": reply.content}]
    server.replies.append(Reply.text("Fine."))
    model.complete(request([*history, {"role": "user", "content": "go on"}]), turn_index=1)
    assert server.rejected == []


RETRYABLE = [
    pytest.param(Fault.rate_limit(retry_after=2), "rate-limited", id="429"),
    pytest.param(Fault.server_error(), "500 api_error", id="500"),
    pytest.param(Fault.overloaded(), "is overloaded", id="529"),
    pytest.param(Fault.status_error(503, "api_error", "unavailable"), "503", id="503"),
    pytest.param(Fault.stream_error(), "overloaded_error mid-stream", id="error-event"),
    pytest.param(Fault.drop(), "connection to the Anthropic API failed", id="drop"),
    pytest.param(Fault.cut(after_events=6), "stream broke off", id="cut"),
    pytest.param(Fault.no_message_stop(), "ended before message_stop", id="no-message-stop"),
    pytest.param(Fault.bad_tool_json(), "malformed stream", id="bad-tool-json"),
    pytest.param(  # the SDK's lenient parser reads '{"path": "x", ",,}' as {"path": "x"}
        Fault.bad_tool_json(Reply.tool_use("write_file", {"path": "x", "content": ""})),
        "tool_use input that is not valid JSON",
        id="bad-tool-json-read-as-a-shorter-object",
    ),
    pytest.param(Fault.hang(seconds=5), "timed out", id="hang"),
    pytest.param(Fault.hang(seconds=5, after_events=3), "stalled", id="stall"),
]


@pytest.mark.parametrize(("fault", "says"), RETRYABLE)
def test_fault_is_retryable_and_a_retry_counts_usage_once(
    server: MessagesAPIServer,
    model: MessagesAPIModel,
    quick_model: MessagesAPIModel,
    fault: Fault,
    says: str,
) -> None:
    if fault.kind == "hang":
        model = quick_model
    server.faults.append(fault)
    with pytest.raises(RetryableModelError, match=says):
        model.complete(request(), turn_index=0)

    server.faults.append(fault)
    server.replies.append(Reply.text("Recovered.", usage=USAGE))
    errors: list[Exception] = []
    reply = retry(model, request(), errors)
    assert reply.content == [{"type": "text", "text": "Recovered."}]
    assert reply.usage == Usage(120, 17, 30, 900)  # the failed attempt's tokens are not added
    assert len(errors) == 1
    assert isinstance(errors[0], RetryableModelError)
    assert len(server.requests) == 3
    assert server.rejected == []


def test_rate_limit_passes_retry_after_to_the_backoff(
    server: MessagesAPIServer, model: MessagesAPIModel
) -> None:
    server.faults.append(Fault.rate_limit(retry_after=3))
    server.replies.append(Reply.text("ok"))
    sleeps: list[float] = []
    call_with_retries(model, request(), turn_index=0, backoff_initial=0.01, sleep=sleeps.append)
    assert sleeps == [3.0]


def test_unpaired_tool_use_is_a_final_error(
    server: MessagesAPIServer, model: MessagesAPIModel
) -> None:
    tool_use = {"type": "tool_use", "id": "toolu_9", "name": "write_file", "input": {}}
    messages = [
        *HELLO,
        {"role": "assistant", "content": [tool_use]},
        {"role": "user", "content": "?"},
    ]
    errors: list[Exception] = []
    with pytest.raises(ModelError) as info:
        retry(model, request(messages), errors)
    assert not isinstance(info.value, RetryableModelError)
    assert errors == []  # not retried
    assert "400 invalid_request_error" in str(info.value)
    assert "toolu_9" in str(info.value)
    assert "agentd retry" in str(info.value)
    assert "\n" not in str(info.value)
    assert len(server.rejected) == 1


def test_wrong_key_is_a_final_error_that_never_shows_the_key(
    server: MessagesAPIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong_key = "sk-ant-api03-not-the-right-one"
    monkeypatch.setenv("ANTHROPIC_API_KEY", wrong_key)
    backend = MessagesAPIModel(base_url=server.base_url, timeout=TIMEOUT)
    try:
        with pytest.raises(ModelError) as info:
            backend.complete(request(), turn_index=0)
    finally:
        backend.close()
    assert not isinstance(info.value, RetryableModelError)
    assert "401" in str(info.value)
    assert "ANTHROPIC_API_KEY" in str(info.value)
    assert "agentd retry" in str(info.value)
    assert wrong_key not in "".join(traceback.format_exception(info.value))
    assert server.rejected[0].error_type == "authentication_error"


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (400, "invalid_request_error", False),
        (403, "permission_error", False),
        (404, "not_found_error", False),
        (500, "api_error", True),
    ],
)
def test_an_echoed_key_is_scrubbed_from_every_message(
    server: MessagesAPIServer, model: MessagesAPIModel, status: int, kind: str, retryable: bool
) -> None:
    key = server.api_key or ""
    server.faults.append(Fault.status_error(status, kind, f"request with key {key} failed"))
    with pytest.raises(ModelError) as info:
        model.complete(request(), turn_index=0)
    assert isinstance(info.value, RetryableModelError) is retryable
    text = "".join(traceback.format_exception(info.value))
    assert key not in text
    assert "[redacted]" in str(info.value)
    assert str(status) in str(info.value)
    if status in (403, 404):
        assert "claude-test" in str(info.value)  # names the model to fix


def test_no_key_at_all_is_a_final_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: MessagesAPIServer
) -> None:
    for name in list(os.environ):
        if name.startswith("ANTHROPIC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    backend = MessagesAPIModel(base_url=server.base_url)
    with pytest.raises(ModelError, match="restart it with ANTHROPIC_API_KEY_FILE") as info:
        backend.complete(request(), turn_index=0)
    assert not isinstance(info.value, RetryableModelError)
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", str(tmp_path))  # a profile dir without profiles
    with pytest.raises(ModelError, match="restart it with ANTHROPIC_API_KEY_FILE"):
        backend.complete(request(), turn_index=0)
    backend.close()
    assert server.requests == []


def test_constructor_and_close() -> None:
    with pytest.raises(ValueError, match="timeout"):
        MessagesAPIModel(timeout=0)
    backend = MessagesAPIModel()
    backend.close()  # never used: nothing to close
    backend.close()


def test_non_streaming_sdk_calls_work_too(server: MessagesAPIServer) -> None:
    import anthropic

    client = anthropic.Anthropic(api_key=server.api_key, base_url=server.base_url, max_retries=0)
    hello: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello"}]
    try:
        server.replies.append(Reply.tool_use("write_file", {"path": "a"}, usage=USAGE))
        message = client.messages.create(model="m", max_tokens=50, messages=hello)
        assert message.stop_reason == "tool_use"
        assert message.content[0].type == "tool_use"
        assert message.usage.cache_read_input_tokens == 900
        server.faults.append(Fault.overloaded())
        with pytest.raises(anthropic.InternalServerError) as info:
            client.messages.create(model="m", max_tokens=50, messages=hello)
        assert info.value.status_code == 529
    finally:
        client.close()


def test_running_out_of_replies_is_a_rejection(
    server: MessagesAPIServer, model: MessagesAPIModel
) -> None:
    with pytest.raises(ModelError, match="no reply scripted"):
        model.complete(request(), turn_index=0)
    assert len(server.rejected) == 1
    server.wait_for_requests(1, timeout=0.1)
    with pytest.raises(AssertionError):
        server.wait_for_requests(2, timeout=0.05)


def test_closing_the_server_ends_a_hang_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    server = MessagesAPIServer().start()
    server.faults.append(Fault.hang(seconds=60))
    backend = MessagesAPIModel(api_key=server.api_key, base_url=server.base_url, timeout=30)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            backend.complete(request(), turn_index=0)
        except ModelError as error:
            outcome.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    try:
        server.wait_for_requests(1)
    finally:
        started = time.monotonic()
        server.close()
        thread.join(10)
        backend.close()
    assert not thread.is_alive()
    assert time.monotonic() - started < 5
    assert len(outcome) == 1
    assert isinstance(outcome[0], RetryableModelError)


def test_server_accepts_the_x_api_key_header(server: MessagesAPIServer) -> None:
    body = json.dumps({"model": "m", "max_tokens": 5, "messages": HELLO}).encode()

    def post(key: str) -> tuple[int, dict[str, Any]]:
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            conn.request("POST", "/v1/messages", body, headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    server.replies.append(Reply.text("hi"))
    assert post(DEFAULT_API_KEY)[0] == 200
    status, payload = post("wrong")
    assert status == 401
    assert payload["error"]["type"] == "authentication_error"


TU = {"type": "tool_use", "id": "toolu_a", "name": "t", "input": {}}
TR = {"type": "tool_result", "tool_use_id": "toolu_a", "content": "ok"}
TEXT = {"type": "text", "text": "hi"}


def body(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": r, "content": c} for r, c in messages],
    }


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"max_tokens": 5, "messages": HELLO}, "model: Field required"),
        ({"model": "m", "messages": HELLO}, "max_tokens: Field required"),
        ({"model": "m", "max_tokens": 5}, "messages: Field required"),
        ({**body(("user", "x")), "bogus": 1}, "bogus: Extra inputs"),
        (body(("assistant", "x")), 'first message must use the "user" role'),
        (body(("user", "x"), ("user", "y")), "roles must alternate"),
        (body(("user", "x"), ("assistant", [TU])), "without `tool_result`"),
        (body(("user", "x"), ("assistant", [TU]), ("user", "y")), "without `tool_result`"),
        (body(("user", [TR])), "unexpected `tool_use_id`"),
        (body(("user", "x"), ("assistant", [TU]), ("user", [TR, TR])), "duplicate"),
        (body(("user", "x"), ("assistant", [TU]), ("user", [TEXT, TR])), "must come first"),
        (body(("user", "x"), ("assistant", [{**TEXT, "parsed_output": None}])), "Extra inputs"),
        (body(("user", "x"), ("assistant", [{**TU, "input": "{}"}])), "valid dict"),
        (body(("user", "")), "non-empty content"),
        (body(("user", [{"type": "text", "text": ""}])), "must be non-empty"),
    ],
)
def test_validator_rejects_what_the_api_rejects(payload: dict[str, Any], error: str) -> None:
    message = validate_request(payload)
    assert message is not None
    assert error in message


def test_validator_accepts_a_paired_transcript() -> None:
    ok = body(("user", "x"), ("assistant", [TEXT, TU]), ("user", [TR, TEXT]), ("assistant", ""))
    assert validate_request(ok) is None


def test_standalone_server_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = {
        "responses": [
            {"fault": "overloaded"},
            {"content": [{"type": "text", "text": "From a file."}], "usage": USAGE},
        ]
    }
    (tmp_path / "script.json").write_text(json.dumps(script))
    port_file, record = tmp_path / "port", tmp_path / "requests.jsonl"
    argv = [sys.executable, "-m", "worker.testing.messages_api", "--port-file", str(port_file)]
    argv += ["--script-file", str(tmp_path / "script.json"), "--record-file", str(record)]
    with subprocess.Popen(argv, cwd=REPO) as proc:
        try:
            deadline = time.monotonic() + 10
            while not port_file.exists():
                assert proc.poll() is None, "the server process exited"
                assert time.monotonic() < deadline, "no port file within 10 s"
                time.sleep(0.02)
            monkeypatch.setenv("ANTHROPIC_API_KEY", DEFAULT_API_KEY)
            base_url = f"http://127.0.0.1:{port_file.read_text().strip()}"
            backend = MessagesAPIModel(base_url=base_url, timeout=5)
            errors: list[Exception] = []
            try:
                reply = retry(backend, request(), errors)
            finally:
                backend.close()
            assert reply.content == [{"type": "text", "text": "From a file."}]
            assert reply.usage == Usage(120, 17, 30, 900)
            assert len(errors) == 1
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    asked = [line for line in lines if "served" not in line]  # every request, as it came
    assert [line["rejected"] for line in asked] == [None, None]
    assert asked[0]["request"]["messages"] == HELLO
    # and each message the server answered whole (what a spend check sums): the retry's
    (served,) = [line["served"] for line in lines if "served" in line]
    assert served["usage"]["output_tokens"] == 17
