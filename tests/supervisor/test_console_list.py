"""The console's list among many tasks, and its forms (docs/design.md sections 19 and 20),
in a real browser (Debian's chromium through Playwright) against a real daemon: the list
filters by state and text, sorts, pages with More and shows each task's age; New task
submits as `agentd submit` does; a done task's page continues it; a live task's page says
something to it. Each form is offered only where the task's state allows it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.daemon import Daemon
from tests.supervisor.test_console_page import console, opened  # noqa: F401  (the fixture)
from tests.support import journal_records, reply, text, tool_use


@pytest.fixture(scope="module")
def many(console: tuple[Daemon, int, Any]) -> Iterator[tuple[Daemon, int, Any]]:  # noqa: F811
    """Sixty tasks at rest: 58 done, one held on a call waiting for approval, one failed."""
    daemon = console[0]
    for n in range(58):
        daemon.submit([reply(text("Done."))], name=f"bulk-{n:02d}")
    daemon.submit(
        [reply(tool_use("append_file", path="a", content="x"))],
        name="wants-ok",
        ask=["append_file"],
    )
    daemon.submit([], name="runs-out")
    for n in range(58):
        daemon.wait_state(f"bulk-{n:02d}", "done")
    daemon.wait_state("wants-ok", "held")
    daemon.wait_state("runs-out", "failed")
    yield console


def shown_ids(page: Any) -> list[str]:
    ids: list[str] = page.eval_on_selector_all(
        "#tasks-body tr", "rows => rows.map(r => r.dataset.task)"
    )
    return ids


def test_the_list_filters_sorts_and_pages(many: tuple[Daemon, int, Any]) -> None:
    with opened(many) as page:
        expect(page.locator("#tasks-body tr").first).to_be_visible()
        # what needs a person first: the held task, then the failed one
        assert shown_ids(page)[:2] == ["wants-ok", "runs-out"]
        assert page.locator("th", has_text="Age").count() == 1
        assert len(shown_ids(page)) == 50
        page.click("#tasks-more")
        expect(page.locator("#tasks-body tr")).to_have_count(60)
        ids = shown_ids(page)
        assert len(set(ids)) == len(ids)  # no repeat
        page.select_option("select[aria-label=state]", "held")
        expect(page.locator("#tasks-body tr")).to_have_count(1)
        assert shown_ids(page) == ["wants-ok"]
        page.select_option("select[aria-label=state]", "")
        page.fill("input[aria-label=find]", "bulk-4")
        expect(page.locator("#tasks-body tr")).to_have_count(10)
        page.select_option("select[aria-label=sort]", "name")
        expect(page.locator("#tasks-body tr").first).to_have_attribute("data-task", "bulk-40")


def test_new_task_continue_and_say_in_the_page(many: tuple[Daemon, int, Any]) -> None:
    daemon = many[0]
    script = {"responses": [reply(text("One.")), reply(text("Two."))]}
    with opened(many) as page:
        page.click("text=New task")
        page.fill("textarea[name=prompt]", "From the page.")
        page.fill("input[name=name]", "from-page")
        page.fill("input[name=tools]", "read_file,list_dir")
        # (a script is no field of the form: the daemon's config has none, so the task uses
        # the scripted model only through the API; here the page's refusal is checked too)
        page.fill("input[name=budget_usd]", "lots")
        page.click("form.submit button[type=submit]")
        expect(page.locator("#flash")).to_contain_text("budget_usd")
        assert not daemon.spool.task("from-page").path.exists()
    # a done task's page offers Continue, not Say
    daemon.submit(script["responses"], name="chat")
    daemon.wait_state("chat", "done")
    with opened(many) as page:
        page.goto(page.url + "#/tasks/chat")
        expect(page.locator("span.continue")).to_be_visible()
        expect(page.locator("span.say")).to_be_hidden()
        page.fill("input[aria-label='continue with']", "Go on, please.")
        page.click("span.continue button")
        expect(page.locator("#flash")).to_contain_text("continued")
    daemon.wait_row("chat", lambda r: r["turn"] == 2 and r["state"] == "done", what="turn 2")
    users = [r for r in journal_records(daemon.task("chat")) if r["k"] == "user"]
    assert users[-1]["via"] == "console" and users[-1]["content"][0]["text"] == "Go on, please."
    # a held task's page offers Say, not Continue; the message waits with the task
    with opened(many) as page:
        page.goto(page.url + "#/tasks/wants-ok")
        expect(page.locator("span.say")).to_be_visible()
        expect(page.locator("span.continue")).to_be_hidden()
        page.fill("input[aria-label=say]", "Use the other ledger.")
        page.click("span.say button")
        expect(page.locator("#flash")).to_contain_text("message added")
    said = json.loads((daemon.task("wants-ok").decisions / "message.1.json").read_text())
    assert said["text"] == "Use the other ledger." and said["via"] == "console"
