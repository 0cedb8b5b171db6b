"""A worker's MCP servers (``worker.mcp.servers``), driven for real: ``mcp-server-time``
from PyPI, the npm servers, and ``tests/mcp/fault_server.py`` for the faults a real server
will not do on cue. Each server runs as a worker runs it: in the sandbox, cwd the
workspace, a scrubbed environment plus its ``env`` (docs/design.md section 11)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.mcp.servers import fault_server, mcp_config, npm_server, time_server
from tests.support import poll_for
from worker.mcp.results import tool_result
from worker.mcp.servers import Backoff, Placement, ServerFailed, ToolServers
from worker.mcp.session import IDEMPOTENCY_META
from worker.tools.sandbox import Sandbox, SandboxMode
from worker.tools.tool import OutcomeUnknown, ToolError

Events = list[tuple[str, str, dict[str, Any]]]


class Servers:
    """``ToolServers`` on a workspace of a test's own, with the events they reported."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.workspace = tmp_path / "workspace"
        self.workspace.mkdir()
        self.hidden = tmp_path / "spool"
        self.hidden.mkdir()
        (self.hidden / "secret.txt").write_text("spool secret")
        self.events: Events = []
        self.made: list[ToolServers] = []

    def __call__(self, servers: dict[str, dict[str, Any]], **options: Any) -> ToolServers:
        config = mcp_config(self.tmp_path, servers)
        env = {"PATH": os.environ["PATH"], "HOME": str(self.workspace)}
        sandbox = Sandbox(options.pop("mode", SandboxMode.AUTO), hidden=(self.hidden,))
        made = ToolServers(
            config.mcp.servers,
            Placement(self.workspace, env, sandbox, grace=options.pop("grace", 2.0)),
            on_event=lambda event, level, fields: self.events.append((event, level, fields)),
            **options,
        )
        self.made.append(made)
        return made

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, _, fields in self.events if name == event]

    def close(self) -> None:
        for made in self.made:
            made.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    made = Servers(tmp_path)
    try:
        yield made
    finally:
        made.close()


def text_of(result: Any) -> str:
    content = tool_result(result.model_dump(by_alias=True, mode="json", exclude_none=True)).content
    assert isinstance(content, str)
    return content


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- real servers -------------------------------------------------------------------------


def test_mcp_server_time_lists_and_answers(servers: Servers) -> None:
    pool = servers({"time": {"command": time_server(), "trust": True}})
    listed = {tool["name"]: tool for tool in pool.listing("time")}
    assert listed["get_current_time"]["annotations"]["readOnlyHint"] is True
    answer = json.loads(
        text_of(pool.call("time", "get_current_time", {"timezone": "UTC"}, "k", 30))
    )
    assert answer["timezone"] == "UTC"


def test_the_idempotency_key_reaches_the_server_in_meta(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server()}})
    seen = json.loads(text_of(pool.call("f", "echo", {"text": "hi"}, "agentd-key-1", 30)))
    assert seen == {"text": "hi", "meta": {IDEMPOTENCY_META: "agentd-key-1"}}


def test_the_everything_server_from_npm(servers: Servers) -> None:
    pool = servers({"everything": {"command": npm_server("everything")}})
    names = {tool["name"] for tool in pool.listing("everything")}
    assert "echo" in names
    assert "hi there" in text_of(pool.call("everything", "echo", {"message": "hi there"}, "k", 60))


def test_roots_answer_the_workspace_and_requests_are_declined(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server()}})
    roots = json.loads(text_of(pool.call("f", "ask_client", {"method": "roots/list"}, "k", 30)))
    assert roots["result"]["roots"] == [{"uri": servers.workspace.as_uri(), "name": "workspace"}]
    for method in ("sampling/createMessage", "elicitation/create"):
        answer = json.loads(text_of(pool.call("f", "ask_client", {"method": method}, "k", 30)))
        assert "error" in answer and "result" not in answer, answer


# -- faults ---------------------------------------------------------------------------------


def test_garbage_and_answers_out_of_order_are_absorbed(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server()}})
    assert text_of(pool.call("f", "garbage", {}, "k", 30)) == "after garbage"
    assert text_of(pool.call("f", "out_of_order", {}, "k", 30)) == "in order after all"
    assert text_of(pool.call("f", "echo", {"text": "still"}, "k", 30)).startswith(
        '{"text": "still"'
    )


def test_a_death_mid_call_is_an_unknown_outcome_and_the_next_call_restarts(
    servers: Servers,
) -> None:
    pool = servers({"f": {"command": fault_server("--log-start", "starts")}})
    pool.listing("f")
    (first,) = pool.pids().values()
    with pytest.raises(OutcomeUnknown, match="ended"):
        pool.call("f", "die", {}, "k", 30)
    poll_for(lambda: gone(first), what="the dead server reaped")
    assert text_of(pool.call("f", "echo", {"text": "again"}, "k", 30)).startswith(
        '{"text": "again"'
    )
    assert len((servers.workspace / "starts").read_text().splitlines()) == 2


def test_a_call_past_its_timeout_is_cancelled_and_its_server_killed(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server(), "timeout": 1.5}})
    pool.listing("f")
    (pid,) = pool.pids().values()
    with pytest.raises(OutcomeUnknown, match=r"no answer within 1\.5 s"):
        pool.call("f", "hang", {}, "k", 1.5)
    poll_for(lambda: gone(pid), what="the hung server killed")
    cancelled = (servers.workspace / "cancelled.log").read_text().splitlines()
    assert len(cancelled) == 1 and "timed out" in json.loads(cancelled[0])["reason"]


def test_a_server_that_cannot_start_fails_its_calls_with_backoff(servers: Servers) -> None:
    pool = servers(
        {"f": {"command": fault_server("--fail-start")}}, backoff=Backoff(initial=60, maximum=60)
    )
    with pytest.raises(ServerFailed, match="mcp: f: echo: not called: cannot start"):
        pool.call("f", "echo", {}, "k", 30)
    with pytest.raises(ServerFailed, match="starting it again in"):
        pool.call("f", "echo", {}, "k", 30)  # in backoff: refused, not started
    (failed,) = servers.named("mcp_server_failed")  # reported once per failure
    assert failed["server"] == "f" and "cannot start" in failed["error"]


def test_a_call_while_its_server_waits_to_start_again_names_the_tool_called(
    servers: Servers,
) -> None:
    """A real server dies in a call of ``die``, is started again, and runs past its timeout
    in a call of ``hang``: it waits out its backoff, and each call made meanwhile is
    refused naming the tool called, then the failure it waits on."""
    pool = servers(
        {"f": {"command": fault_server(), "timeout": 1}}, backoff=Backoff(initial=60, maximum=60)
    )
    with pytest.raises(OutcomeUnknown, match=r"^mcp: f: die: "):
        pool.call("f", "die", {}, "k", 30)
    with pytest.raises(OutcomeUnknown, match=r"^mcp: f: hang: "):
        pool.call("f", "hang", {}, "k", 1)
    for tool in ("echo", "die"):
        with pytest.raises(ServerFailed) as refused:
            pool.call("f", tool, {"text": "x"}, "k", 30)
        said = str(refused.value)
        assert said.startswith(f"mcp: f: {tool}: not called: "), said
        assert "a call of hang ran past its timeout; starting it again in" in said, said
        assert refused.value.tool == tool


def test_a_server_that_cannot_list_its_tools(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server("--no-list")}})
    with pytest.raises(ServerFailed, match=r"cannot list its tools: .*no list today"):
        pool.listing("f")


def test_a_server_that_never_answers_tools_list_is_given_up(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server("--hang-list"), "timeout": 1}})
    with pytest.raises(ServerFailed, match=r"no answer to tools/list within 1 s"):
        pool.listing("f")


def test_a_changed_list_is_reported_and_a_vanished_tool_refused(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server()}})
    first = {tool["name"] for tool in pool.listing("f")}
    pool.expect("f", first)
    assert text_of(pool.call("f", "change_tools", {}, "k", 30)) == "changed"
    with pytest.raises(ToolError, match="no longer offers the tool 'vanishing'"):
        pool.call("f", "vanishing", {}, "k", 30)
    (changed,) = servers.named("mcp_tools_changed")
    assert changed == {"server": "f", "added": ["newcomer"], "removed": ["vanishing"]}


@pytest.mark.parametrize("mode", [SandboxMode.AUTO, SandboxMode.OFF])
def test_close_stops_a_server_that_ignores_stdin_and_term(
    servers: Servers, mode: SandboxMode
) -> None:
    """Under bwrap, TERM ends the sandbox and the server with it; bare, the server ignores
    TERM and the KILL after the grace ends it. Either way nothing is left."""
    pool = servers({"f": {"command": fault_server("--stubborn")}}, grace=0.5, mode=mode)
    pool.listing("f")
    (pid,) = pool.pids().values()
    inner = [p.pid for p in psutil.Process(pid).children(recursive=True)]
    pool.close()
    assert gone(pid)
    # (the sandbox's own processes die with it, a moment later)
    poll_for(lambda: all(gone(each) for each in inner), timeout=10, what="the sandbox gone")


def test_the_sandbox_hides_the_spool_from_a_server(servers: Servers) -> None:
    pool = servers({"f": {"command": fault_server()}})
    result = pool.call("f", "read", {"path": str(servers.hidden / "secret.txt")}, "k", 30)
    assert result.is_error
    assert "spool secret" not in text_of(result)


def test_credentials_reach_the_server_by_reference(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file = servers.tmp_path / "token"
    secret_file.write_text("s3cr3t-token-value\n")
    monkeypatch.setenv("AGENTD_CRED_GIT_TOKEN_FILE", str(secret_file))
    pool = servers({"f": {"command": fault_server(), "env": {"TOKEN": "${cred:git_token}"}}})
    assert text_of(pool.call("f", "env", {"variable": "TOKEN"}, "k", 30)) == "s3cr3t-token-value"
    assert text_of(pool.call("f", "env", {"variable": "PATH"}, "k", 30)) == os.environ["PATH"]
    assert text_of(pool.call("f", "env", {"variable": "HOSTNAME_NOT_PASSED"}, "k", 30)) == "unset"


# -- results ---------------------------------------------------------------------------------


def test_results_become_tool_result_content() -> None:
    image = {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}
    made = tool_result({"content": [{"type": "text", "text": "a pixel"}, image]})
    assert made.content == [
        {"type": "text", "text": "a pixel"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
    ]
    assert tool_result({"content": [], "structuredContent": {"b": 2, "a": [1]}}).content == (
        '{"a": [1], "b": 2}'
    )
    failed = tool_result({"content": [{"type": "text", "text": "no"}], "isError": True})
    assert failed.is_error and failed.content == "no"
    long = tool_result({"content": [{"type": "text", "text": "x" * 200_000}]}).content
    assert isinstance(long, str) and len(long) < 70_000 and "more bytes" in long
    odd = tool_result({"content": [{"type": "audio", "data": "AAAA", "mimeType": "audio/wav"}]})
    assert odd.content == "[audio (audio/wav), 3 bytes, not shown]"


# -- Streamable HTTP ------------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[str]:
    """``tests/mcp/http_server.py`` on a free port of 127.0.0.1: its URL."""
    import socket
    import subprocess
    import sys

    from tests.mcp.servers import HERE

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "http_server.py"), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        poll_for(listening, timeout=60, what="the HTTP server listening")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


def test_a_streamable_http_server_gets_its_headers_with_credentials(
    servers: Servers, http_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = servers.tmp_path / "http-token"
    token.write_text("http-secret-0123456789\n")
    monkeypatch.setenv("AGENTD_CRED_HTTP_TOKEN_FILE", str(token))
    pool = servers(
        {"web": {"url": http_server, "headers": {"Authorization": "Bearer ${cred:http_token}"}}}
    )
    assert [tool["name"] for tool in pool.listing("web")] == ["authorization"]
    answer = text_of(pool.call("web", "authorization", {}, "k", 30))
    assert answer == "Bearer http-secret-0123456789"
    from worker import credentials

    assert "http-secret-0123456789" in credentials.held().secrets()  # redacted from now on
