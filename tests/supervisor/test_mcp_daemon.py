"""A real daemon with an MCP server (docs/design.md section 11): a server that cannot list
its tools at a task's first start leaves the task in ``backoff`` with reason ``mcp: NAME:
WHY`` (never failed, never a crash), retried until the server, mended by a reload, lists
them; then the task runs its MCP calls to the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from supervisor.status import load_state
from tests.daemon import Daemon
from tests.mcp.servers import fault_server, npm_server, write_config
from tests.support import poll_for, reply, text, tool_use
from worker.config import load_config

pytestmark = pytest.mark.usefixtures("subreaper")

#: A folder a sandboxed tool sees as the host has it (unlike /tmp, which is its own).
OUTSIDE_TMP = "/var/tmp"


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


def test_a_filesystem_server_on_a_cluster_node_reaches_no_store_credential(
    tmp_path: Path, postgres_schema: str
) -> None:
    """On a node of a shared store (docs/design.md sections 10 and 11),
    ``@modelcontextprotocol/server-filesystem`` allowed ``/`` (which keeps to the roots
    agentd answers: the workspace) and the fault server's ``read`` (which checks nothing)
    ask for every file libpq could log in with (``PGPASSFILE``, ``~/.pgpass``,
    ``~/.pg_service.conf``): none of them reaches the task, and a file of its own
    workspace does (the control)."""
    canary = "canary-" + os.urandom(8).hex()
    # (outside /tmp: a sandboxed tool has a /tmp of its own, which would hide them anyway)
    home = Path(tempfile.mkdtemp(prefix="agentd-home-", dir=OUTSIDE_TMP))
    secrets = [home / "pgpass", home / ".pgpass", home / ".pg_service.conf"]
    for path in secrets:
        path.write_text(f"# {canary}\n")
        path.chmod(0o600)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "mine.txt").write_text("the task's own file")
    node = Daemon(tmp_path / "a", "")
    servers = {"fs": {"command": npm_server("filesystem", "/")}, "f": {"command": fault_server()}}
    write_config(node.config_path, servers)
    env = {
        "AGENTD_STORE": postgres_schema,
        "AGENTD_NODE": "a",
        "PGPASSFILE": str(secrets[0]),
        "HOME": str(home),
    }
    targets = [*secrets, workspace / "mine.txt"]
    reads = [
        tool_use(tool, f"{server}{i}", path=str(path))
        for server, tool in (("fs", "mcp__fs__read_text_file"), ("f", "mcp__f__read"))
        for i, path in enumerate(targets)
    ]
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"responses": [reply(*reads), reply(text("Done."))]}))
    try:
        node.start(env)
        submitted = node.run_cli(
            "submit", "--name", "peek", "--prompt", "Read.", "--script", str(script),
            "--workspace", str(workspace), "--tools", "mcp__fs__*,mcp__f__read", env=env,
            timeout=60,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr

        def done() -> bool:
            shown = node.run_cli("status", "--json", env=env, timeout=60)
            assert shown.returncode == 0, shown.stderr
            (row,) = json.loads(shown.stdout)["tasks"]
            assert row["state"] not in ("failed", "held"), row
            return bool(row["state"] == "done")

        poll_for(done, 120, what="the task done")
        shown = node.run_cli("show", "peek", "--json", env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
    finally:
        node.cleanup()
        shutil.rmtree(home, ignore_errors=True)
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    results = {line["call_id"]: line for line in lines if line["kind"] == "tool_result"}
    for server in ("fs", "f"):  # the control: the task's own file is read
        assert "the task's own file" in str(results[f"{server}3"]["content"]), results
    assert canary not in shown.stdout, results


def test_an_mcp_call_asked_before_it_runs_waits_for_approval(tmp_path: Path) -> None:
    """docs/guides/tools.md: ``[tools] ask`` names an MCP tool as ``--tools`` does; its
    call is held before the server is asked, and runs on the operator's decision."""
    daemon = Daemon(tmp_path / "d", "")
    write_config(
        daemon.config_path,
        {"f": {"command": fault_server()}},
        tools={"ask": ["mcp__f__ech?"]},
    )
    daemon.config = load_config(daemon.config_path)
    try:
        daemon.start()
        task_id = daemon.submit(
            [reply(tool_use("mcp__f__echo", "c1", text="hi")), reply(text("Done."))],
            "asks",
            tools=["mcp__f__*"],
        )
        row = daemon.wait_state(task_id, "held", "done", "failed", timeout=120)
        assert (row["state"], row["reason"]) == ("held", "approval: mcp__f__echo"), row
        (held,) = row["dangling"]
        assert (held["call_id"], held["stage"], held["attempt"]) == ("c1", "before", 1)
        assert daemon.events(task_id, "approval_requested")
        done = daemon.run_cli("approve-dangling", task_id, "c1", "--attempt", "1", "--rerun")
        assert done.returncode == 0, done
        assert daemon.wait_state(task_id, "done", "failed", timeout=120)["state"] == "done"
        result = load_state(daemon.task(task_id)).calls["c1"].result or {}
        assert result.get("outcome") == "ran" and "hi" in json.dumps(result.get("content"))
    finally:
        daemon.cleanup()
