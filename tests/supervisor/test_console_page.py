"""The console's page keeping up with the tasks it shows (docs/guides/console.md), in a
real browser (Debian's chromium, headless, driven by Playwright) against a real daemon:
leaving a running task's page asks for no other task; Rewind and Fork follow a task's
turn; every action is offered only where the task's state allows it (the CLI's checks);
a skipped call says skipped; the inbox badge counts a task held on its budget; a task
shows its age and how long it ran."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.console import console_table, free_port, login_url
from tests.daemon import Daemon, config_text, subreaper
from tests.supervisor.test_console_browser import CHROMIUM, CHROMIUM_ARGS
from tests.supervisor.test_daemon import CHARGE
from tests.support import missing_system_tool, poll_for, reply, text, tool_use
from worker.budget import Budget

#: Two turns of $0.45 on the Sonnet 4 family: a $0.50 budget holds the task at the second.
PAID = {"input_tokens": 100_000, "output_tokens": 10_000}


@pytest.fixture(scope="module")
def console() -> Iterator[tuple[Daemon, int, Any]]:
    """A daemon serving the console, and a headless chromium to open it with."""
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        missing_system_tool("the console's browser test drives chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="agentd-console-page-"))
    with subreaper(), sync_playwright() as playwright:
        daemon = Daemon(root, config_text(extra=console_table(port)))
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            daemon.start()
            yield daemon, port, browser
        finally:
            browser.close()
            daemon.cleanup()
            shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def opened(console: tuple[Daemon, int, Any]) -> Iterator[Any]:
    """A logged-in page of the console, on its tasks, closed after; every request it
    makes is kept in its ``asked`` list."""
    daemon, port, browser = console
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.asked = []
        page.on("request", lambda request: page.asked.append(request.url))
        page.goto(login_url(daemon))
        assert page.url == f"http://127.0.0.1:{port}/"
        yield page
    finally:
        context.close()


@contextlib.contextmanager
def ticking(console: tuple[Daemon, int, Any], name: str) -> Iterator[tuple[Daemon, Any]]:
    """A task ``name`` that moves on a turn every 0.3 s, for a minute or so (cancelled
    after), and a page of the console opened on the tasks."""
    daemon = console[0]
    steps = [reply(text(f"step {n}"), tool_use("list_dir"), delay=0.3) for n in range(200)]
    daemon.submit([*steps, reply(text("Done."))], name=name)
    daemon.wait_row(name, lambda r: r["state"] == "running" and r["turn"] >= 1, what="turns")
    try:
        with opened(console) as page:
            yield daemon, page
    finally:
        daemon.cli("cancel", name)


def more_turns(daemon: Daemon, name: str, count: int) -> None:
    """Wait until task ``name`` has made ``count`` turns more than it has now."""
    start = daemon.row(name)["turn"]
    daemon.wait_row(name, lambda r: r["turn"] >= start + count, what=f"{count} more turns")


def test_leaving_a_running_tasks_page_asks_for_no_other_task(
    console: tuple[Daemon, int, Any],
) -> None:
    with ticking(console, "ticker") as (daemon, page):
        for _ in range(3):
            page.click('a[href="#/tasks/ticker"]')
            turn = page.locator("dl.facts dt:text-is('turn') + dd")
            first = turn.inner_text()
            expect(turn).not_to_have_text(first)  # the page follows the task
            # leave while a reload of the task's page is due (the page's timer), as a
            # person leaves a page that changes every second
            poll_for(lambda: page.evaluate("() => state.timer"), 10, what="a reload due")
            page.click('nav a[href="#/"]')
            # five more turns of the task, 0.3 s each or more: any reload the task's page
            # had asked for (1 s after a change) is past by then
            more_turns(daemon, "ticker", 5)
            expect(page.locator("#flash")).to_be_hidden()
            expect(page.locator("h1")).to_have_text("Tasks")
        assert not [url for url in page.asked if url.endswith("/api/tasks/undefined")]


def test_rewind_and_fork_follow_the_turn_of_a_running_task(
    console: tuple[Daemon, int, Any],
) -> None:
    with ticking(console, "follower") as (_, page):
        page.click('a[href="#/tasks/follower"]')
        fork_at = page.locator('input[aria-label="fork at turn"]')
        rewind_to = page.locator('input[aria-label="rewind to turn"]')
        loaded = int(fork_at.input_value())
        turn = page.locator("dl.facts dt:text-is('turn') + dd")
        expect(turn).not_to_have_text(str(loaded))
        poll_for(lambda: int(turn.inner_text()) >= loaded + 3, 30, what="three turns more")
        shown = int(turn.inner_text())
        # the inputs follow the turn the page shows, not the one it loaded with
        poll_for(lambda: int(fork_at.input_value()) >= shown, 10, what="fork at the turn")
        assert int(fork_at.get_attribute("max") or 0) >= shown
        assert int(rewind_to.input_value()) >= shown - 1
        # what a person types stays, though the task moves on
        fork_at.fill("1")
        now = turn.inner_text()
        expect(turn).not_to_have_text(now)
        assert fork_at.input_value() == "1"


def offered(page: Any) -> dict[str, bool]:
    """Which of the task page's actions are offered (visible)."""
    bar = page.locator("section.actions")
    return {
        "cancel": bar.get_by_role("button", name="Cancel", exact=True).is_visible(),
        "retry": bar.get_by_role("button", name="Retry", exact=True).is_visible(),
        "rewind": bar.get_by_role("button", name="Rewind", exact=True).is_visible(),
        "fork": bar.get_by_role("button", name="Fork", exact=True).is_visible(),
    }


def test_the_page_offers_only_the_actions_a_tasks_state_allows(
    console: tuple[Daemon, int, Any],
) -> None:
    """Each action hidden is one the CLI refuses (exit 3) in that state, and the page's
    buttons change with the state while it is open."""
    daemon, _, _ = console
    daemon.submit([reply(text("Reading."), tool_use("list_dir", path=".")), reply(text("Done."))],
                  name="finished")  # fmt: skip
    daemon.submit([reply(text("Fetching."), tool_use("list_dir", path="."))], name="broken")
    daemon.submit([reply(text("Waiting."), delay=120)], name="stopped")
    daemon.wait_state("finished", "done")
    daemon.wait_state("broken", "failed")
    daemon.wait_state("stopped", "running")
    with opened(console) as page:
        page.click('a[href="#/tasks/stopped"]')
        expect(page.locator("h1 .badge")).to_have_text("running")
        expect(page.get_by_role("button", name="Cancel", exact=True)).to_be_visible()
        assert offered(page) == {"cancel": True, "retry": False, "rewind": False, "fork": True}
        assert daemon.cli("cancel", "stopped")[0] == 0  # elsewhere: the open page follows
        expect(page.locator("h1 .badge")).to_have_text("cancelled")
        expect(page.get_by_role("button", name="Cancel", exact=True)).to_be_hidden()
        expect_offered = {
            "stopped": {"cancel": False, "retry": False, "rewind": False, "fork": True},
            "finished": {"cancel": False, "retry": False, "rewind": True, "fork": True},
            "broken": {"cancel": False, "retry": True, "rewind": True, "fork": True},
        }
        for name, expected in expect_offered.items():
            page.goto(f"{page.url.split('#')[0]}#/tasks/{name}")
            expect(page.locator("h1")).to_contain_text(name)
            expect(page.get_by_role("button", name="Fork", exact=True)).to_be_visible()
            assert offered(page) == expected, name
            refused = {
                "cancel": ("cancel", name),
                "retry": ("retry", name),
                "rewind": ("rewind", name, "--to", "0", "--yes"),
            }
            for action, argv in refused.items():
                if not expected[action]:
                    code, _, err = daemon.cli(*argv)
                    assert code == 3, (name, action, err)


def test_a_skipped_call_says_skipped_and_the_inbox_counts_a_budget_hold(
    console: tuple[Daemon, int, Any],
) -> None:
    daemon, _, _ = console
    daemon.submit(
        [reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
         reply(text("Paid."))],
        name="charge",
    )  # fmt: skip
    daemon.submit(
        [reply(text(f"step {n}"), tool_use("list_dir", path="."), usage=PAID) for n in (1, 2)]
        + [reply(text("Done."), usage=PAID)],
        name="paid",
        model="claude-sonnet-4-6",
        budget=Budget(usd=0.5),
    )
    charged = daemon.task("charge").path / "workspace" / "charged"
    row = daemon.wait_row("charge", lambda r: r["phase"] == "tool:run_command" and charged.exists())
    os.kill(row["pid"], signal.SIGKILL)  # its outcome unknown: held for a person
    daemon.wait_state("charge", "held")
    daemon.wait_state("paid", "held")
    with opened(console) as page:
        # one held call and one task held on its budget: two things wait in the inbox
        expect(page.locator("#inbox-count")).to_have_text("2")
        page.click('nav a[href="#/inbox"]')
        card = page.locator('article.held[data-call]:has(h3:has-text("charge"))')
        # where to look before deciding: the task's workspace
        expect(card.locator(".workspace")).to_have_text(
            f"look in: {daemon.task('charge').path / 'workspace'}"
        )
        expect(page.locator('article.held.budget:has(h3:has-text("paid"))')).to_be_visible()
        card.locator('input[aria-label="reason"]').fill("Charged by hand.")
        card.get_by_role("button", name="Skip").click()
        daemon.wait_state("charge", "done")
        expect(page.locator("#inbox-count")).to_have_text("1")  # the budget hold waits on

        page.click('nav a[href="#/"]')
        page.click('a[href="#/tasks/charge"]')
        call = page.locator("table.timeline .call").filter(has_text="run_command")
        expect(call.locator(".badge")).to_have_text("skipped")
        code, out, _ = daemon.cli("history", "charge")
        assert code == 0 and "run_command(unsafe: skipped;" in out, out
        (turn,) = [r for r in json.loads(daemon.cli("history", "charge", "--json")[1])
                   if r["tool_calls"]]  # fmt: skip
        assert turn["tool_calls"][0]["outcome"] == "skipped"  # (the JSON as it was)


def test_a_task_shows_its_age_and_how_long_it_ran(console: tuple[Daemon, int, Any]) -> None:
    daemon, _, _ = console
    daemon.submit([reply(text("Quick."), delay=1.5)], name="quick")
    done = daemon.wait_state("quick", "done")
    with opened(console) as page:
        expect(page.locator("thead th").nth(2)).to_have_text("Age")
        expect(page.locator('tr[data-task="quick"] .age')).to_have_text(re.compile(r"^\d+s$"))
        page.click('a[href="#/tasks/quick"]')
        facts = page.locator("dl.facts")
        expect(facts.locator("dt:text-is('age') + dd")).to_have_text(re.compile(r"^\d+s$"))
        duration = facts.locator("dt:text-is('duration') + dd")
        expect(duration).to_have_text(re.compile(r"^\d+s \(ended .+\)$"))
        took = int(duration.inner_text().split("s", 1)[0])
        assert 1 <= took < 60, duration.inner_text()
        assert done["updated_at"] in duration.inner_text()
