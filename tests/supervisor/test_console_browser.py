"""The console's page in a real browser (docs/design.md section 12): Debian's chromium,
headless, driven by Playwright, against a real daemon.

An operator logs in through the URL ``agentd console`` prints, sees the tasks, opens one
and reads what a tool returned, skips a held call from the inbox, and sees that task
finish without reloading the page (the stream). A page opened without logging in is
refused, and so is a form that another site's page posts to the console.

Screenshots of the three views are taken on the way; with ``AGENTD_CONSOLE_SCREENSHOTS``
naming a folder (``docs``) they are kept there, as the guide shows them.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.views import human_cost
from tests.console import console_table, free_port, login_url
from tests.daemon import Daemon, config_text, subreaper
from tests.supervisor.test_daemon import CHARGE
from tests.support import missing_system_tool, poll_for, reply, text, tool_use

CHROMIUM = "/usr/bin/chromium"
#: How Debian's chromium runs here: headless, no sandbox of its own (the test may run as
#: root), and nothing that reaches the network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: What each of the report task's model calls uses: its row's Cost is $0.18 in all, at
#: the default model's price.
USAGE = {"input_tokens": 20_000, "output_tokens": 2_000}
REPORT = "Q3 revenue: 4.2M EUR, up 12% on Q2 (ACME-REPORT-OUTPUT)"


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        missing_system_tool("the console's browser test drives chromium: apt-get install chromium")
    port = free_port()
    # (a folder of a neutral name: its path shows in a task's facts, in the screenshots)
    root = Path(tempfile.mkdtemp(prefix="agentd-console-"))
    with subreaper():
        daemon = Daemon(root, config_text(extra=console_table(port)))
        try:
            daemon.start()
            yield daemon, port
        finally:
            daemon.cleanup()
            shutil.rmtree(root, ignore_errors=True)


def seed(daemon: Daemon) -> None:
    """Tasks in the states an operator meets: done (with a tool's output to read), held on
    an unsafe call, running, failed."""
    daemon.submit(
        [
            reply(text("Writing the quarterly report."),
                  tool_use("write_file", path="report.txt", content=REPORT), usage=USAGE),
            reply(text("Reading it back to check it."), tool_use("read_file", path="report.txt"),
                  usage=USAGE),
            reply(text("The report is written and checked."), usage=USAGE),
        ],
        name="nightly-report",
        prompt="Write the quarterly revenue report to report.txt and check it.",
    )  # fmt: skip
    daemon.submit(
        [reply(text("Charging the card."), tool_use("run_command", command=CHARGE, timeout=60)),
         reply(text("The invoice is paid."))],
        name="invoice-run",
        prompt="Charge invoice 2024-117 to the customer's card on file.",
    )  # fmt: skip
    daemon.submit(
        [reply(text("Reading the module."), tool_use("list_dir", path="."), delay=0.2)]
        + [reply(text(f"Step {i} of the refactor."), delay=120) for i in range(2)],
        name="refactor-api",
        prompt="Refactor the API module into smaller functions.",
    )
    daemon.submit(
        [reply(text("Fetching the page."), tool_use("list_dir", path="."))],
        name="flaky-scraper",
        prompt="Scrape the price list and summarise it.",
    )
    charged = daemon.task("invoice-run").path / "workspace" / "charged"
    row = daemon.wait_row(
        "invoice-run",
        lambda r: r["phase"] == "tool:run_command" and charged.exists(),
        what="the charge under way",
    )
    os.kill(row["pid"], signal.SIGKILL)  # its outcome unknown: held for a person
    daemon.wait_state("invoice-run", "held")
    daemon.wait_state("nightly-report", "done")
    daemon.wait_state("flaky-scraper", "failed")
    daemon.wait_row("refactor-api", lambda r: r["state"] == "running" and r["turn"] >= 1)


def task_decisions(daemon: Daemon, name: str) -> list[Path]:
    folder = daemon.task(name).decisions
    return list(folder.iterdir()) if folder.exists() else []


class AttackerSite:
    """Another origin (another port of 127.0.0.1: the same site, so the session cookie
    goes with its form) serving a page that posts a cancel to the console."""

    def __init__(self, console_port: int) -> None:
        page = (
            "<!doctype html><html><body>"
            f'<form id="f" method="post" action="http://127.0.0.1:{console_port}'
            '/api/tasks/nightly-report/cancel"><input name="x" value="1"></form>'
            "<script>document.getElementById('f').submit()</script></body></html>"
        ).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_operator_reads_a_tool_output_and_skips_a_held_call_in_the_browser(
    console: tuple[Daemon, int], tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    daemon, port = console
    seed(daemon)
    shots = Path(os.environ.get("AGENTD_CONSOLE_SCREENSHOTS") or tmp_path)
    url = login_url(daemon, {"LOGNAME": "alice"})
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 760})
            page = context.new_page()
            page.set_default_timeout(30_000)
            # log in: the URL's token is gone from the address once the cookie is set
            page.goto(url)
            assert page.url == f"http://127.0.0.1:{port}/"
            rows = page.locator("#tasks-body tr")
            expect(rows).to_have_count(4)
            expect(page.locator('tr[data-task="invoice-run"] .badge')).to_have_text("held")
            expect(page.locator("#live")).to_have_text("live")
            expect(page.locator("#inbox-count")).to_have_text("1")
            done = daemon.wait_state("nightly-report", "done")  # its cost, as status says
            assert isinstance(done["cost_usd"], float) and done["cost_usd"] > 0.01
            cost = page.locator('tr[data-task="nightly-report"] td.cost')
            expect(cost).to_have_text(human_cost(done["cost_usd"], None))
            page.screenshot(path=str(shots / "console-tasks.png"))

            # a task's timeline: what the tool returned, as recorded
            page.click('a[href="#/tasks/nightly-report"]')
            expect(page.locator("h1")).to_contain_text("nightly-report")
            result = page.locator(".msg.result").filter(has_text="read_file")
            expect(result.locator("pre")).to_have_text(REPORT)
            expect(page.locator("table.timeline tbody tr")).to_have_count(3)
            page.screenshot(path=str(shots / "console-timeline.png"), full_page=True)
            # a rewind past a call it cannot undo: the CLI's line, and the calls listed
            page.fill('input[aria-label="rewind to turn"]', "0")
            page.get_by_role("button", name="Rewind", exact=True).click()
            expect(page.locator("#flash")).to_contain_text("Run again with --yes")
            expect(page.locator(".undo")).to_contain_text("turn 1: write_file (idempotent)")
            assert daemon.row("nightly-report")["turn"] == 3  # nothing was rewound

            # the inbox: skip the held charge, with a reason
            page.click('nav a[href="#/inbox"]')
            card = page.locator('article.held:has(h3:has-text("invoice-run"))')
            expect(card).to_be_visible()
            expect(card.locator("pre")).to_contain_text("charged")
            card.locator('input[aria-label="reason"]').fill("Charged by hand in the billing tool.")
            page.screenshot(path=str(shots / "console-inbox.png"))
            (held,) = json.loads(daemon.cli("dangling", "invoice-run", "--json")[1])
            # a re-run of an unsafe call of unknown outcome asks first, showing its input;
            # dismissed, nothing is decided
            asked: list[str] = []

            def dismiss(dialog: Any) -> None:
                asked.append(dialog.message)
                dialog.dismiss()

            page.once("dialog", dismiss)
            card.get_by_role("button", name="Re-run").click()
            poll_for(lambda: asked, 10, what="the re-run's confirmation")
            assert "outcome is unknown" in asked[0] and CHARGE.split(";")[0][:20] in asked[0]
            assert not task_decisions(daemon, "invoice-run")
            # every decision names the attempt it was made on
            with page.expect_request(lambda r: "/decisions" in r.url) as decision:
                card.get_by_role("button", name="Skip").click()
            assert json.loads(decision.value.post_data or "{}")["attempt"] == held["attempt"]
            expect(page.locator("#flash")).to_have_text(f"invoice-run {held['call_id']}: skipped")

            # the task finishes, and the open page shows it without a reload
            page.click('nav a[href="#/"]')
            expect(page.locator('tr[data-task="invoice-run"] .badge')).to_have_text("done")
            expect(page.locator("#inbox-count")).to_be_hidden()
            decided = daemon.events("invoice-run", "dangling_decided")[0]
            assert (decided["by"], decided["via"]) == ("alice", "console")

            # another site's page posts to the console with the operator's cookie: refused
            attacker = AttackerSite(port)
            try:
                with page.expect_response(lambda r: "/cancel" in r.url) as posted:
                    page.goto(attacker.url)
                assert posted.value.status == 403
            finally:
                attacker.close()
            assert daemon.row("nightly-report")["state"] == "done"

            # a page opened without logging in: refused
            stranger = browser.new_context().new_page()
            response = stranger.goto(f"http://127.0.0.1:{port}/")
            assert response is not None and response.status == 401
            expect(stranger.locator("body")).to_contain_text("agentd console")
        finally:
            browser.close()
