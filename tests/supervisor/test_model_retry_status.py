"""A task whose model call is being retried says so in its REASON: what failed, the
attempt, the next try; and once a call goes through, the reason is gone. A real daemon
and worker, the official SDK, against the local Messages API server answering 529.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.control import ring
from supervisor.submit import submit
from tests.daemon import Daemon, subreaper
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply

MODEL = "claude-retry-status"
CONFIG = f"""\
[heartbeat]
interval = 0.2
[model]
name = "{MODEL}"
max_tokens = 256
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with subreaper():
        daemon = Daemon(tmp_path, CONFIG)
        try:
            yield daemon
        finally:
            daemon.cleanup()


def test_reason_shows_the_model_call_being_retried_until_it_goes_through(
    daemon: Daemon,
) -> None:
    overloaded = threading.Event()
    overloaded.set()

    def respond(_: dict[str, Any]) -> Reply | Fault:
        return Fault.overloaded() if overloaded.is_set() else Reply.text("Done.")

    with MessagesAPIServer(responder=respond) as server:
        env = {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY}
        env |= {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        daemon.start(env)
        task = submit(daemon.spool, daemon.config, prompt="Say done.", name="retried")
        ring(daemon.spool, task.id)
        row = daemon.wait_row(
            task.id, lambda r: "attempt 2 failed" in (r["reason"] or ""), what="a second retry"
        )
        assert row["state"] == "running" and row["phase"] == "model", row
        reason = row["reason"]
        assert reason.startswith("retrying the model call: attempt 2 failed (")
        assert "overloaded" in reason.lower() and "; next try " in reason, reason
        code, out, _ = daemon.cli("status")
        assert code == 0
        (line,) = [line for line in out.splitlines() if line.startswith("retried")]
        assert "retrying the model call: attempt" in line
        overloaded.clear()
        row = daemon.wait_state(task.id, "done", "failed")
    assert row["state"] == "done" and "retrying" not in (row["reason"] or ""), row
