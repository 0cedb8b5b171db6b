"""The console's API starts, continues and steers tasks (docs/design.md sections 12 and
19): ``POST /api/tasks`` with ``agentd submit``'s fields, checks and refusals,
``POST /api/tasks/ID/continue`` and ``POST /api/tasks/ID/messages``, each recording who
did it. A real daemon, its console process and HTTP."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.console import Client, api_token, console_table, free_port
from tests.daemon import Daemon, config_text, subreaper
from tests.support import journal_records, poll_for, reply, text

SCRIPT = {"responses": [reply(text("First answer.")), reply(text("Second answer."))]}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Client]]:
    port = free_port()
    with subreaper():
        daemon = Daemon(tmp_path_factory.mktemp("api"), config_text(extra=console_table(port)))
        try:
            daemon.start()
            yield daemon, Client(port, bearer=api_token(daemon))
        finally:
            daemon.cleanup()


def state(daemon: Daemon, name: str) -> dict[str, Any]:
    return daemon.row(name)


def test_submit_runs_a_task_with_submits_fields_and_records_who(
    api: tuple[Daemon, Client],
) -> None:
    daemon, client = api
    answer = client.post(
        "/api/tasks",
        {
            "prompt": "Say hello.",
            "name": "api-1",
            "script": SCRIPT,
            "max_turns": 5,
            "budget_tokens": 100000,
            "tools": ["read_file", "list_dir"],
        },
    )
    assert answer.status == 201, answer.json()
    row = answer.json()["task"]
    assert row["id"] == "api-1" and row["state"] in ("queued", "running", "done")
    assert row["budget"]["tokens"] == 100000
    done = daemon.wait_state("api-1", "done", "failed")
    assert done["state"] == "done"
    spec = daemon.task("api-1").load_spec()
    assert spec.max_turns == 5 and list(spec.tools or ()) == ["read_file", "list_dir"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({}, 400, '"prompt"'),
        ({"prompt": " "}, 400, "empty"),
        ({"prompt": "x", "name": "../etc"}, 400, ""),
        ({"prompt": "x", "max_turns": 0}, 400, "max-turns"),
        ({"prompt": "x", "script": {"responses": "no"}}, 400, ""),
        ({"prompt": "x", "tools": ["no_such_tool"]}, 400, "no_such_tool"),
        ({"prompt": "x", "budget_usd": "lots"}, 400, "budget_usd"),
        ({"prompt": "x", "harness": "claude"}, 400, "harness"),
        ({"prompt": "x", "workspace": f"/var/tmp/agentd-no-such-{uuid.uuid4().hex}"}, 400, "exist"),
    ],
)
def test_submit_refuses_what_submit_refuses_and_writes_nothing(
    api: tuple[Daemon, Client], body: dict[str, Any], status: int, words: str
) -> None:
    daemon, client = api
    before = sorted(p.name for p in daemon.spool.tasks_dir.iterdir())
    answer = client.post("/api/tasks", body)
    assert answer.status == status, answer.json()
    assert words in answer.json()["error"]
    assert sorted(p.name for p in daemon.spool.tasks_dir.iterdir()) == before


def test_a_name_in_use_is_409(api: tuple[Daemon, Client]) -> None:
    _, client = api
    assert (
        client.post("/api/tasks", {"prompt": "x", "name": "twice", "script": SCRIPT}).status == 201
    )
    again = client.post("/api/tasks", {"prompt": "x", "name": "twice", "script": SCRIPT})
    assert again.status == 409 and "twice" in again.json()["error"]


def test_continue_and_messages_through_the_api(api: tuple[Daemon, Client]) -> None:
    daemon, client = api
    script = {
        "responses": [reply(text("One.")), reply(text("Two."), delay=1.0), reply(text("Three."))]
    }
    assert (
        client.post("/api/tasks", {"prompt": "Go.", "name": "conv", "script": script}).status == 201
    )
    daemon.wait_state("conv", "done")
    said = client.post("/api/tasks/conv/messages", {"text": "late"})
    assert said.status == 409 and "agentd continue conv" in said.json()["error"]
    going = client.post("/api/tasks/conv/continue", {"prompt": "Carry on."})
    assert going.status == 200, going.json()
    assert going.json()["after_turn"] == 1
    poll_for(lambda: state(daemon, "conv")["turn"] == 2 or None, 60, what="turn 2")
    daemon.wait_state("conv", "done")
    assert client.post("/api/tasks/conv/continue", {}).status == 400
    assert client.post("/api/tasks/nope/continue", {"prompt": "x"}).status == 404
    users = [r for r in journal_records(daemon.task("conv")) if r["k"] == "user"]
    assert users[-1]["via"] == "api" and users[-1]["content"][0]["text"] == "Carry on."


def test_the_task_list_filters_sorts_and_pages(api: tuple[Daemon, Client]) -> None:
    daemon, client = api
    for name in ("pg-1", "pg-2", "pg-3"):
        assert (
            client.post("/api/tasks", {"prompt": "x", "name": name, "script": SCRIPT}).status == 201
        )
    for name in ("pg-1", "pg-2", "pg-3"):
        daemon.wait_state(name, "done")
    whole = client.get("/api/tasks").json()
    assert isinstance(whole, list)  # no selection: status --json's list, as before
    seen, after = [], ""
    while True:
        answer = client.get(f"/api/tasks?q=pg-&sort=-age&limit=2{after}")
        assert answer.status == 200, answer.json()
        page = answer.json()
        seen += [row["id"] for row in page["tasks"]]
        if page["next"] is None:
            break
        after = f"&after={page['next']}"
    assert seen == ["pg-1", "pg-2", "pg-3"]
    held = client.get("/api/tasks?state=held").json()
    assert held["tasks"] == [] and held["next"] is None
    assert client.get("/api/tasks?sort=size").status == 400
