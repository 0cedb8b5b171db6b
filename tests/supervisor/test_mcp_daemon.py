"""A real daemon with an MCP server (docs/design.md section 11): a server that cannot list
its tools at a task's first start leaves the task in ``backoff`` with reason ``mcp: NAME:
WHY`` (never failed, never a crash), retried until the server, mended by a reload, lists
them; then the task runs its MCP calls to the end."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon, subreaper
from tests.mcp.servers import fault_server, write_config
from tests.support import poll_for, reply, text, tool_use
from worker.config import load_config


@pytest.fixture(autouse=True)
def _subreaper() -> Iterator[None]:
    with subreaper():
        yield


def test_a_server_that_cannot_list_leaves_the_task_waiting_until_it_can(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d", "")
    restart = {"backoff_initial": 0.2, "backoff_max": 1.0}
    write_config(daemon.config_path, {"f": {"command": fault_server("--no-list")}}, restart=restart)
    daemon.config = daemon.config.__class__()  # (submit reads the file: see below)

    daemon.config = load_config(daemon.config_path)
    try:
        proc = daemon.start()
        task_id = daemon.submit(
            [reply(tool_use("mcp__f__echo", "c1", text="hi")), reply(text("Done."))],
            "waits",
            tools=["mcp__f__*"],
        )
        row = daemon.wait_row(
            task_id,
            lambda r: r["state"] == "backoff" and str(r["reason"]).startswith("mcp: f: "),
            what="backoff for the server",
        )
        assert "cannot list its tools" in row["reason"] and row["restarts"] == 0
        assert daemon.events(task_id, "mcp_server_failed")
        write_config(daemon.config_path, {"f": {"command": fault_server()}}, restart=restart)
        proc.send_signal(signal.SIGHUP)  # the mended server, for the workers from now on
        poll_for(lambda: any(e.get("event") == "config_reloaded" for e in daemon.log_events()))
        row = daemon.wait_state(task_id, "done", timeout=120)
        assert row["restarts"] == 0 and row["reason"] == "end_turn"
        assert not daemon.events(task_id, "crash_loop")
        # the fork server preloads the MCP SDK ([mcp.servers] is configured), and serves
        log = daemon.spool.root / "forkserver.log"
        poll_for(lambda: "the mcp SDK preloaded" in log.read_text(), 60, what="the preload")
    finally:
        daemon.cleanup()


def test_agentd_run_waits_for_a_server_that_cannot_list_its_tools(tmp_path: Path) -> None:
    """``agentd run`` does as the daemon does: the task waits in backoff, said on stderr,
    and goes on once the server (mended in the config its workers read) lists its tools."""
    import json
    import subprocess

    from tests.support import REPO, worker_env

    here = Daemon(tmp_path / "run", "")
    restart = {"backoff_initial": 0.2, "backoff_max": 1.0}
    write_config(here.config_path, {"f": {"command": fault_server("--no-list")}}, restart=restart)
    script = tmp_path / "script.json"
    responses = [reply(tool_use("mcp__f__echo", "c1", text="hi")), reply(text("Done."))]
    script.write_text(json.dumps({"responses": responses}))
    err = tmp_path / "run.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            here.command(
                "run",
                "--name",
                "w",
                "--prompt",
                "go",
                "--script",
                str(script),
                "--tools",
                "mcp__f__*",
            ),
            cwd=REPO,
            env=worker_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    here.procs.append(proc)
    try:
        poll_for(lambda: "mcp: f: cannot list its tools" in err.read_text(), 90, what="the wait")
        assert here.row("w")["state"] == "backoff"
        write_config(here.config_path, {"f": {"command": fault_server()}}, restart=restart)
        assert proc.wait(timeout=120) == 0, err.read_text()
        assert here.row("w")["state"] == "done"
    finally:
        here.cleanup()
