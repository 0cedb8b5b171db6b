"""The console on a cluster (docs/design.md sections 10 and 12): any node's console shows
and acts on the whole cluster through the shared store; an API token minted on one node
is accepted by another's console (it is kept in the store); and the store going away is
a 503 with ``Retry-After``, the console serving on once it is back. Real daemons on a
real PostgreSQL, the link to it cut by a real proxy."""

from __future__ import annotations

import os
import pwd
import signal
from pathlib import Path

from tests.console import Client, console_table, free_port, login_url
from tests.daemon import subreaper
from tests.postgres import SeverableProxy
from tests.supervisor.test_cluster import CONFIG, Node
from tests.supervisor.test_daemon import CHARGE
from tests.support import poll_for, reply, text, tool_use


def test_a_nodes_console_acts_on_the_whole_cluster(tmp_path: Path, postgres_schema: str) -> None:
    port = free_port()
    with SeverableProxy.in_front_of(postgres_schema) as proxy, subreaper():
        # b runs the task; a, whose console is asked, reaches the store through the proxy
        b = Node(tmp_path, "b", postgres_schema, CONFIG.replace('"rerun"', '"hold"'))
        a = Node(tmp_path, "a", proxy.url_for(postgres_schema), CONFIG + console_table(port))
        try:
            b.start()
            b.submit(
                "on-b",
                [reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
                 reply(text("Charged."))],
            )  # fmt: skip
            b.agentd("status")
            row = poll_for(
                lambda: (
                    (r := b.row("on-b"))["state"] == "running"
                    and r["phase"] == "tool:run_command"
                    and r
                ),
                60,
                interval=0.1,
                what="on-b's charge under way on b",
            )
            assert row["node"] == "b"
            os.kill(int(row["pid"]), signal.SIGKILL)  # its outcome unknown: held
            poll_for(lambda: b.row("on-b")["state"] == "held", 60, interval=0.2, what="held")
            a.start()
            # a token minted on b's spool, kept in the store: a's console accepts it
            minted = b.agentd("console", "--token")
            assert minted.returncode == 0, minted
            assert not (b.daemon.spool.root / "console" / "tokens.json").exists()
            script = Client(port, bearer=minted.stdout.strip())
            assert script.get("/api/session").json()["via"] == "api"
            # a's console sees b's task and its held call, and decides it
            browser = Client(port)
            done = a.daemon.run_cli("console", env={**a.env, "LOGNAME": "dana-ops"})
            assert done.returncode == 0, done
            assert browser.login(done.stdout.strip()).status == 303
            tasks = {t["id"]: t for t in browser.get("/api/tasks").json()}
            assert tasks["on-b"]["state"] == "held"
            (call,) = browser.get("/api/held").json()["calls"]
            assert call["task"] == "on-b"
            decided = browser.post(
                "/api/tasks/on-b/decisions",
                {"call_id": call["call_id"], "action": "result", "result": "charged: ok"},
            )
            assert decided.status == 200, decided
            poll_for(lambda: b.row("on-b")["state"] == "done", 60, interval=0.2, what="done")
            events = b.events_json("on-b")
            decided_events = [e for e in events if e["event"] == "dangling_decided"]
            assert decided_events, events
            who = (pwd.getpwuid(os.getuid()).pw_name, "console")  # the real user: not $LOGNAME
            assert all((e["by"], e["via"]) == who for e in decided_events)
            # the store away: a wait, said as 503 with Retry-After; then served again
            proxy.sever()
            away = script.get("/api/tasks")
            assert away.status == 503, away
            assert away.header("Retry-After") == "5"
            assert "error" in away.json()
            proxy.restore()
            poll_for(lambda: script.get("/api/tasks").status == 200, 60, interval=0.5,
                     what="the console once the store is back")  # fmt: skip
            assert login_url(a.daemon, a.env).startswith(f"http://127.0.0.1:{port}/")
        finally:
            a.daemon.cleanup()
            b.daemon.cleanup()
