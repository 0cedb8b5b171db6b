"""The console's JSON API and its defences, against a real daemon (docs/design.md section 12).

One daemon serves the console for the module; each test speaks to it over HTTP the way a
browser or a script does, and each defence has a test that fails without it: the login
URL (one time, redirected without its token, a cookie that scripts cannot read), the
session, the Host and Origin checks, the CSRF token, API tokens (hashed, revocable),
the limits, the refusals and their codes, and no secret in any answer. The page itself
is driven by a real browser in ``test_console_browser.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.console.http import BODY_LIMIT
from supervisor.console.server import MAX_CONNECTIONS
from supervisor.console.tokens import LoginTickets
from tests.console import (
    Client,
    api_token,
    console_table,
    free_port,
    logged_in,
    login_url,
)
from tests.daemon import Daemon, config_text, subreaper
from tests.supervisor.test_daemon import CHARGE, Held
from tests.support import journal_records, of_kind, poll_for, reply, text, tool_use
from worker.budget import Budget

USER = "carol-ops"
#: The daemon's API key: it appears in no answer of the console.
API_KEY = "sk-ant-api03-console-test-key-0123456789abcdef"
#: A name a reverse proxy serves the console by (``[console] hostnames``).
PROXIED = "agentd.example.test"


class Console:
    def __init__(self, daemon: Daemon, port: int) -> None:
        self.daemon = daemon
        self.port = port
        self.env = {"LOGNAME": USER}

    def client(self) -> Client:
        return logged_in(self.daemon, self.port, self.env)

    def token(self) -> Client:
        return Client(self.port, bearer=api_token(self.daemon, self.env))

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.daemon.log_events() if e.get("event") == event]


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    port = free_port()
    extra = console_table(port, f'hostnames = ["{PROXIED}"]\n')
    with subreaper():
        daemon = Daemon(tmp_path_factory.mktemp("console"), config_text(extra=extra))
        try:
            daemon.start(env={"ANTHROPIC_API_KEY": API_KEY})
            yield Console(daemon, port)
        finally:
            daemon.cleanup()


# -- logging in -------------------------------------------------------------------------


def test_the_login_url_opens_once_sets_a_session_cookie_and_drops_its_token(
    console: Console,
) -> None:
    url = login_url(console.daemon, console.env)
    assert url.startswith(f"http://127.0.0.1:{console.port}/?token=")
    browser = Client(console.port)
    answer = browser.login(url)
    assert answer.status == 303
    assert answer.header("Location") == "/"  # the same page, without the token
    cookie = answer.header("Set-Cookie") or ""
    name = f"agentd-session-{console.port}"
    assert cookie.startswith(f"{name}=")
    attributes = {a.strip() for a in cookie.split(";")[1:]}
    assert {"HttpOnly", "SameSite=Lax", "Path=/"} <= attributes
    assert "Secure" not in attributes  # (plain HTTP: a Secure cookie would never come back)
    # the login lasts [console] session_timeout (the cookie's Max-Age: what is left of it)
    max_age = next(int(a.split("=", 1)[1]) for a in attributes if a.startswith("Max-Age="))
    configured = console.daemon.config.console.session_timeout
    assert configured - 60 <= max_age <= configured, (max_age, configured)
    page = browser.get("/")
    assert page.status == 200
    # the page carries its session's CSRF token (a meta tag and the logout form's field)
    assert f'<meta name="csrf-token" content="{browser.csrf}">' in page.body.decode()
    session = browser.get("/api/session").json()
    assert session["by"] == USER and session["via"] == "console" and session["csrf"]
    # the same URL again: refused, and said in the daemon's log as a warning
    again = Client(console.port)
    refused = again.login(url)
    assert refused.status == 401 and "used already or has expired" in refused.body.decode()
    assert not again.cookies
    logins = poll_for(lambda: console.logged("console_login"), 10, what="console_login")
    assert logins[-1]["by"] == USER and logins[-1]["via"] == "console"
    failed = poll_for(lambda: console.logged("console_login_failed"), 10, what="failed login")
    assert failed[-1]["level"] == "warning"


def test_an_expired_login_url_is_refused(console: Console) -> None:
    secret = LoginTickets(console.daemon.spool).issue(USER, ttl=-1.0)
    client = Client(console.port)
    assert client.login(f"/?token={secret}").status == 401
    assert not client.cookies


def test_without_credentials_the_page_and_the_api_are_refused(console: Console) -> None:
    nobody = Client(console.port)
    page = nobody.get("/")
    assert page.status == 401 and page.header(
        "Content-Type",
    ).startswith("text/html")  # type: ignore[union-attr]
    assert "agentd console" in page.body.decode()
    for path in ("/api/tasks", "/api/held", "/api/stream", "/api/session"):
        answer = nobody.get(path)
        assert answer.status == 401, path
        assert "not logged in" in answer.json()["error"]
    assert nobody.post("/api/tasks/x/cancel").status == 401
    # a made-up session cookie is no session
    nobody.cookies[f"agentd-session-{console.port}"] = "forged"
    assert nobody.get("/api/tasks").status == 401
    # the page's script and style are no secret: served to anyone
    assert nobody.get("/static/console.js").status == 200


def test_logout_ends_the_session(console: Console) -> None:
    browser = console.client()
    cookie = dict(browser.cookies)
    csrf, browser.csrf = browser.csrf, ""  # the page's form sends it as a field
    assert browser.post("/logout").status == 403
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert browser.request("POST", "/logout", raw=b"csrf=wrong", headers=form).status == 403
    done = browser.request("POST", "/logout", raw=f"csrf={csrf}".encode(), headers=form)
    assert done.status == 200, done
    assert "Max-Age=0" in (done.header("Set-Cookie") or "")
    replay = Client(console.port, cookies=cookie)
    assert replay.get("/api/tasks").status == 401


# -- API tokens ----------------------------------------------------------------------------


def test_api_tokens_are_kept_hashed_listed_and_revoked(console: Console) -> None:
    daemon = console.daemon
    script = console.token()
    assert script.bearer.startswith("agentd_")
    assert script.get("/api/tasks").status == 200
    assert script.get("/api/session").json() == {"by": USER, "via": "api"}
    stored = (daemon.spool.root / "console" / "tokens.json").read_text()
    assert script.bearer not in stored  # only its digest is kept
    assert (daemon.spool.root / "console" / "tokens.json").stat().st_mode & 0o777 == 0o600
    listed = daemon.run_cli("console", "--list-tokens")
    assert listed.returncode == 0 and script.bearer not in listed.stdout
    (line,) = [x for x in listed.stdout.splitlines() if USER in x][-1:]
    token_id = line.split()[0]
    assert daemon.run_cli("console", "--revoke", token_id).returncode == 0
    assert script.get("/api/tasks").status == 401
    again = daemon.run_cli("console", "--revoke", token_id)
    assert again.returncode == 3 and "no API token" in again.stderr
    assert daemon.run_cli("console", "--revoke", "../x").returncode == 2
    wrong = Client(console.port, bearer="agentd_" + "x" * 43)
    answer = wrong.get("/api/tasks")
    assert answer.status == 401 and "unknown or revoked" in answer.json()["error"]


# -- Host, Origin, CSRF ---------------------------------------------------------------------


def test_a_host_that_is_not_the_consoles_is_refused(console: Console) -> None:
    browser = console.client()
    for host, status in (
        ("evil.example", 403),  # DNS rebinding: a name of the attacker's that resolves here
        (f"evil.example:{console.port}", 403),
        (f"127.0.0.1:{console.port + 1}", 403),
        ("", 403),
        (f"localhost:{console.port}", 200),
        (PROXIED, 200),  # [console] hostnames: a reverse proxy's name
        (f"{PROXIED}:443", 200),
    ):
        browser.host = host
        answer = browser.get("/api/tasks")
        assert answer.status == status, (host, answer)
        if status == 403:
            assert "hostnames" in answer.json()["error"]
    browser.host = None


def test_a_post_from_another_origin_is_refused(console: Console) -> None:
    browser = console.client()
    console.daemon.submit([reply(text("hi"))], name="origin-check")
    console.daemon.wait_state("origin-check", "done")
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": f"http://127.0.0.1:{console.port + 1}"},  # same site, another origin
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        answer = browser.post("/api/tasks/origin-check/retry", headers=headers)
        assert answer.status == 403, (headers, answer)
    # its own origin passes the check (and the retry is refused by the task's state: 409)
    same = browser.post(
        "/api/tasks/origin-check/retry", headers={"Origin": f"http://127.0.0.1:{console.port}"}
    )
    assert same.status == 409, same


def test_a_browser_post_without_its_csrf_token_is_refused(console: Console) -> None:
    browser = console.client()
    csrf = browser.csrf
    for sent in ("", "wrong-token"):
        browser.csrf = sent
        answer = browser.post("/api/tasks/none/cancel")
        assert answer.status == 403 and "CSRF" in answer.json()["error"], sent
    browser.csrf = csrf
    assert browser.post("/api/tasks/none/cancel").status == 404  # past the check: no such task
    # a token is no cookie: a script's POST needs no CSRF token
    assert console.token().post("/api/tasks/none/cancel").status == 404


# -- limits and malformed requests ----------------------------------------------------------


def test_a_body_over_the_limit_is_refused_before_it_is_read(console: Console) -> None:
    script = console.token()
    with socket.create_connection(("127.0.0.1", console.port), timeout=10) as conn:
        conn.sendall(
            f"POST /api/tasks/x/decisions HTTP/1.1\r\nHost: 127.0.0.1:{console.port}\r\n"
            f"Authorization: Bearer {script.bearer}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n".encode()
        )
        answer = conn.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 413 "), answer
    assert '"error"' in answer


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /api/tasks HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /api/tasks HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /api/tasks HTTP/1.1\r\n\r\n", 400),
        (b"DELETE /api/tasks HTTP/1.1\r\nHost: h\r\n\r\n", 405),
        (b"GET http://x/api HTTP/1.1\r\nHost: h\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", 505),
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: h\r\n\r\n", 431),
    ],
)
def test_requests_of_another_shape_are_refused(console: Console, raw: bytes, status: int) -> None:
    with socket.create_connection(("127.0.0.1", console.port), timeout=10) as conn:
        conn.sendall(raw)
        answer = conn.recv(65536).decode(errors="replace")
    assert answer.startswith(f"HTTP/1.1 {status} "), answer


def test_a_silent_connection_is_cut_off(console: Console) -> None:
    """A client that sends part of a request and waits (slowloris) is closed by the
    console within its head timeout, with 408."""
    with socket.create_connection(("127.0.0.1", console.port), timeout=30) as conn:
        conn.sendall(b"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        answer = conn.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 408 "), answer
        assert conn.recv(1) == b""  # closed
    assert time.monotonic() - started < 25


# -- reads and actions ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def held(console: Console) -> Held:
    held = Held(console.daemon)
    held.hold(["h-skip", "h-rerun", "h-result", "h-cancel", "h-stale"])
    return held


def test_the_inbox_lists_every_held_call_and_decisions_resume_the_tasks(
    console: Console, held: Held
) -> None:
    browser, script = console.client(), console.token()
    inbox = browser.get("/api/held").json()
    assert set(inbox) == {"calls", "tasks"} and inbox["tasks"] == []
    by_task = {c["task"]: c for c in inbox["calls"]}
    assert set(held.calls) <= set(by_task)
    dangling = json.loads(console.daemon.cli("dangling", "--json")[1])
    assert inbox["calls"] == dangling  # the rows of `agentd dangling --json`, as they are
    call = by_task["h-skip"]
    answer = browser.post(
        "/api/tasks/h-skip/decisions",
        {"call_id": call["call_id"], "action": "skip", "reason": "charged by hand"},
    )
    assert answer.status == 200, answer
    assert answer.json()["task"]["id"] == "h-skip"
    answer = script.post("/api/tasks/h-rerun/decisions", {"call_id": "*", "action": "rerun"})
    assert answer.status == 200, answer
    answer = browser.post(
        "/api/tasks/h-result/decisions",
        {"call_id": held.calls["h-result"], "action": "result", "result": "charged once: ok"},
    )
    assert answer.status == 200, answer
    for name in ("h-skip", "h-rerun", "h-result"):
        console.daemon.wait_state(name, "done")
    # who decided, as the journal and the events say (docs/design.md section 15)
    lines = browser.get("/api/tasks/h-skip/messages").json()
    (decision,) = [line for line in lines if line["kind"] == "decision"]
    assert (decision["by"], decision["via"], decision["reason"]) == (
        USER,
        "console",
        "charged by hand",
    )
    rerun = console.daemon.events("h-rerun", "dangling_decided")[0]
    assert (rerun["by"], rerun["via"]) == (USER, "api")
    result = next(line for line in browser.get("/api/tasks/h-result/messages").json()
                  if line["kind"] == "tool_result")  # fmt: skip
    assert result["content"] == "charged once: ok" and result["outcome"] == "operator"


def test_a_decision_answers_one_attempt_and_another_attempts_is_409(
    console: Console, held: Held
) -> None:
    # docs/guides/tools.md: a stale inbox, a retried request or a second click
    script = console.token()
    call_id = held.calls["h-stale"]
    (row,) = [c for c in script.get("/api/held").json()["calls"] if c["task"] == "h-stale"]
    assert (row["attempt"], row["stage"]) == (1, "unknown") and len(row["input_sha256"]) == 64
    path = "/api/tasks/h-stale/decisions"
    stale = script.post(path, {"call_id": call_id, "action": "skip", "attempt": 2})
    assert stale.status == 409, stale
    assert "attempt 1" in stale.json()["error"]
    bad = script.post(path, {"call_id": call_id, "action": "skip", "attempt": "first"})
    assert bad.status == 400 and '"attempt"' in bad.json()["error"]
    answer = script.post(path, {"call_id": call_id, "action": "skip", "attempt": 1})
    assert answer.status == 200, answer
    assert answer.json()["decided"] == [{"call_id": call_id, "attempt": 1, "action": "skip"}]
    again = script.post(path, {"call_id": call_id, "action": "skip", "attempt": 1})
    assert again.status in (404, 409), again  # decided already, or no longer held
    console.daemon.wait_state("h-stale", "done")
    decisions = of_kind(journal_records(console.daemon.task("h-stale")), "decision")
    assert [(d["attempt"], d["action"]) for d in decisions] == [(1, "skip")]


def test_a_task_held_on_its_budget_is_in_the_inbox_and_the_consoles_raise_resumes_it(
    console: Console,
) -> None:
    """``/api/held``'s ``tasks`` and ``POST /budget`` (docs/design.md sections 12, 13): a
    raise below the spend is the CLI's refusal (409); one above it resumes the task."""
    browser = console.client()
    usage = {"input_tokens": 1000, "output_tokens": 100}
    steps = [
        reply(text("one"), tool_use("list_dir"), usage=usage),
        reply(text("Done."), usage=usage),
    ]
    console.daemon.submit(steps, "b-held", budget=Budget(tokens=1000))
    row = console.daemon.wait_state("b-held", "held")
    assert row["reason"] == "budget: 1100 of 1000 tokens" and row["dangling"] == []
    inbox = browser.get("/api/held").json()
    assert {"task": "b-held", "reason": row["reason"]} in inbox["tasks"]
    decided = browser.post("/api/tasks/b-held/decisions", {"call_id": "*", "action": "rerun"})
    assert decided.status == 409 and "agentd budget" in decided.json()["error"], decided
    below = browser.post("/api/tasks/b-held/budget", {"tokens": 500})
    assert below.status == 409 and "below" in below.json()["error"], below
    raised = browser.post("/api/tasks/b-held/budget", {"tokens": 5000, "usd": None})
    assert raised.status == 200 and raised.json()["task"]["budget"]["tokens"] == 5000, raised
    assert console.daemon.wait_state("b-held", "done")["cost_usd"] is not None
    (changed,) = console.daemon.events("b-held", "budget_changed")
    assert (changed["by"], changed["via"]) == (USER, "console")


def test_refusals_carry_the_clis_line_and_their_code(console: Console, held: Held) -> None:
    browser = console.client()
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/api/tasks/no-such/cancel", {}, 404, "no task 'no-such'"),
        ("/api/tasks/h-cancel/decisions", {"call_id": "toolu_none", "action": "rerun"}, 404,
         "no held call"),
        ("/api/tasks/h-cancel/decisions", {"call_id": "x", "action": "explode"}, 400,
         "no decision"),
        ("/api/tasks/h-cancel/decisions", {"action": "rerun"}, 400, '"call_id"'),
        ("/api/tasks/h-cancel/decisions", {"call_id": "x", "action": "rerun", "reason": "r"},
         400, "--reason goes with --skip"),
        ("/api/tasks/h-cancel/decisions", {"call_id": "../x", "action": "rerun"}, 400,
         "invalid call id"),
        ("/api/tasks/h-cancel/retry", {}, 409, "only a failed task can be retried"),
        ("/api/tasks/h-cancel/rewind", {"to": "soon"}, 400, "a turn number"),
        ("/api/tasks/h-cancel/rewind", {"to": 99, "yes": True}, 400, "turns 0 to 1"),
        ("/api/tasks/h-cancel/fork", {"at": 5}, 400, "cannot fork at turn 5"),
        ("/api/tasks/BAD!/cancel", {}, 400, "invalid task id"),
    ]  # fmt: skip
    for path, body, status, words in cases:
        answer = browser.post(path, body)
        assert answer.status == status, (path, body, answer)
        error = answer.json()["error"]
        assert words in error and "\n" not in error, (path, error)
    assert browser.request("POST", "/api/tasks/h-cancel/cancel", raw=b"[1]",
                           headers={"Content-Type": "application/json"}).status == 400  # fmt: skip
    assert browser.get("/api/nothing").status == 404
    assert browser.get("/api/tasks/h-cancel/messages?turn=9").status == 404
    assert browser.get("/api/tasks/h-cancel/messages?turn=x").status == 400
    # the cancel itself, and a cancel of a cancelled task: 409 as the CLI's exit 3
    assert browser.post("/api/tasks/h-cancel/cancel").json()["task"]["state"] == "cancelled"
    again = browser.post("/api/tasks/h-cancel/cancel")
    assert again.status == 409 and "already cancelled" in again.json()["error"]
    cancelled = console.daemon.events("h-cancel", "task_cancelled")
    assert cancelled and cancelled[-1]["via"] == "console" and cancelled[-1]["by"] == USER


def test_a_rewind_that_would_undo_calls_needs_yes_and_lists_them(console: Console) -> None:
    daemon = console.daemon
    daemon.submit(
        [reply(text("Writing."), tool_use("write_file", path="a.txt", content="a")),
         reply(text("Done."))], name="rw",
    )  # fmt: skip
    daemon.wait_state("rw", "done")
    browser = console.client()
    answer = browser.post("/api/tasks/rw/rewind", {"to": 0})
    assert answer.status == 400, answer
    body = answer.json()
    assert "--yes" in body["error"]
    (call,) = body["calls"]
    assert (call["turn"], call["tool"], call["effect"]) == (1, "write_file", "idempotent")
    assert browser.get("/api/tasks/rw").json()["task"]["turn"] == 2  # nothing was changed
    done = browser.post("/api/tasks/rw/rewind", {"to": 0, "yes": True})
    assert done.status == 200, done
    assert done.json()["rewind"]["not_undone"] == body["calls"]
    detail = browser.get("/api/tasks/rw").json()
    assert set(detail) == {"task", "history", "events"}
    rewound = [e for e in detail["events"] if e["event"] == "task_rewound"]
    assert rewound and rewound[0]["via"] == "console"
    fork = browser.post("/api/tasks/rw/fork", {"at": 0, "name": "rw-fork", "prompt": "again"})
    assert fork.status == 201, fork
    assert fork.json()["task"]["id"] == "rw-fork"
    assert fork.json()["task"]["forked_from"] == {"task": "rw", "turn": 0}


def test_reads_are_the_clis_json(console: Console, held: Held) -> None:
    script = console.token()
    daemon = console.daemon
    tasks = script.get("/api/tasks").json()
    status = json.loads(daemon.cli("status", "--json")[1])["tasks"]
    shown = {t["id"]: (t["state"], t["turn"]) for t in tasks}
    assert shown == {t["id"]: (t["state"], t["turn"]) for t in status}
    name = next(iter(held.calls))
    detail = script.get(f"/api/tasks/{name}").json()
    assert detail["history"] == json.loads(daemon.cli("history", name, "--json")[1])
    lines = script.get(f"/api/tasks/{name}/messages").json()
    out = daemon.cli("show", name, "--json")[1]
    assert lines == [json.loads(line) for line in out.splitlines()]
    one = script.get(f"/api/tasks/{name}/messages?turn=1").json()
    assert one and {line["turn"] for line in one} == {1}


def test_no_answer_carries_a_secret(console: Console) -> None:
    """A key the model wrote in its text (``show``'s lines redact it) and one in a held
    call's input (the inbox, the task's row and its page: only the console's own pass
    redacts those), the API key, an API token and the session cookie: in no answer."""
    daemon = console.daemon
    leaked = "sk-ant-api03-leaked-by-the-model-0123456789"
    daemon.submit(
        [reply(text(f"I will use {leaked}."), tool_use("list_dir", path=".")),
         reply(text("Done."))], name="secretive",
    )  # fmt: skip
    held_input = "sk-ant-api03-leaked-in-a-held-call-98765"
    daemon.submit(
        [reply(text("Charging."),
               tool_use("run_command", command=f"{CHARGE} # {held_input}", timeout=60)),
         reply(text("Charged."))], name="secret-held",
    )  # fmt: skip
    charged = daemon.task("secret-held").path / "workspace" / "charged"
    row = daemon.wait_row(
        "secret-held",
        lambda r: r["phase"] == "tool:run_command" and charged.exists(),
        what="the charge under way",
    )
    os.kill(row["pid"], signal.SIGKILL)  # its unsafe call dangling: held
    daemon.wait_state("secretive", "done")
    daemon.wait_state("secret-held", "held")
    browser = console.client()
    token = api_token(daemon, console.env)
    seen = b""
    for path in ("/", "/api/tasks", "/api/held", "/api/session", "/api/tasks/secretive",
                 "/api/tasks/secretive/messages", "/api/tasks/secret-held",
                 "/static/console.js"):  # fmt: skip
        answer = browser.get(path)
        assert answer.status == 200, path
        seen += answer.body + str(answer.headers).encode()
    cookie = browser.cookies[f"agentd-session-{console.port}"]
    for secret in (API_KEY, leaked, held_input, token, cookie):
        assert secret.encode() not in seen, secret
    assert b"[redacted]" in seen


def test_the_stream_sends_a_row_per_change(console: Console) -> None:
    browser = console.client()
    with socket.create_connection(("127.0.0.1", console.port), timeout=30) as conn:
        cookie = "; ".join(f"{k}={v}" for k, v in browser.cookies.items())
        conn.sendall(
            f"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1:{console.port}\r\n"
            f"Cookie: {cookie}\r\n\r\n".encode()
        )
        reader = conn.makefile("rb")
        head = []
        while (line := reader.readline()) not in (b"\r\n", b""):
            head.append(line.decode())
        assert head[0].startswith("HTTP/1.1 200 ") and any("text/event-stream" in h for h in head)

        def rows() -> Iterator[dict[str, Any]]:
            event = None
            while line := reader.readline():
                if line.startswith(b"event: "):
                    event = line[7:].strip()
                elif line.startswith(b"data: ") and event == b"task":
                    yield json.loads(line[6:])

        stream = rows()
        first = next(stream)  # every row first
        assert "id" in first and "state" in first
        console.daemon.submit([reply(text("streamed"), delay=0.5)], name="streamed")
        states = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "done" not in states:
            row = next(stream)
            if row["id"] == "streamed":
                states.append(row["state"])
        assert states[-1] == "done" and len(states) == len(set(states)), states


def test_the_console_process_is_restarted_when_it_dies(console: Console) -> None:
    info = json.loads((console.daemon.spool.root / "supervisor.json").read_text())
    assert info["console"] == f"http://127.0.0.1:{console.port}/"
    daemon_pid = info["pid"]
    (child,) = [p for p in _children(daemon_pid) if "supervisor.console" in " ".join(p.cmdline())]
    os.kill(child.pid, signal.SIGKILL)
    poll_for(lambda: console.logged("console_exited"), 15, what="console_exited")

    def serving_again() -> bool:
        try:
            return (
                Client(console.port, bearer=api_token(console.daemon)).get("/api/tasks").status
                == 200
            )
        except OSError:
            return False

    poll_for(serving_again, 30, interval=0.2, what="the console to serve again")
    assert console.daemon.proc is not None and console.daemon.proc.poll() is None


def _children(pid: int) -> list[Any]:
    import psutil

    return list(psutil.Process(pid).children())


def test_the_console_keeps_its_state_files_private(console: Console) -> None:
    folder = console.daemon.spool.root / "console"
    assert folder.stat().st_mode & 0o777 == 0o700
    login_url(console.daemon)
    for ticket in (folder / "logins").iterdir():
        assert ticket.stat().st_mode & 0o777 == 0o600
        assert len(ticket.name) == 64 + len(".json")  # a digest, never the ticket
    assert Path(folder / "logins").stat().st_mode & 0o777 == 0o700


def test_connections_past_the_limit_are_closed_at_once(console: Console) -> None:
    """At most ``MAX_CONNECTIONS`` connections are held: one more is closed as it comes,
    and once the crowd is gone a request is answered."""
    crowd = []
    try:
        for _ in range(MAX_CONNECTIONS):
            crowd.append(socket.create_connection(("127.0.0.1", console.port), timeout=10))
        poll_for(lambda: _closed_at_once(console.port), 10, interval=0.1, what="a refusal")
    finally:
        for conn in crowd:
            conn.close()
    script = console.token()
    poll_for(lambda: _answered(script), 30, interval=0.1, what="an answer after the crowd")


def _closed_at_once(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
        extra.sendall(f"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        try:
            return extra.recv(1024) == b""
        except ConnectionResetError:
            return True


def _answered(client: Client) -> bool:
    try:
        return client.get("/api/tasks").status == 200
    except OSError:
        return False
