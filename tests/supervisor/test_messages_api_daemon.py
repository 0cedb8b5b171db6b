"""A daemon whose workers call the Messages API, the way a new user meets it: a model call
being retried shows in REASON (what failed, the attempt, the next try) until a call goes
through. The API key: a daemon started without one is noticed at
``submit``; the error a task ends with says what works where the key came from; SIGHUP
reads ``ANTHROPIC_API_KEY_FILE`` (and ``AGENTD_STORE_FILE``) again, so a fixed file and
``agentd retry`` are enough. A real daemon and workers (forked from the fork server, which
is started again with the new key), the official SDK against the local Messages API.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.coordination import ring
from supervisor.submit import submit as submit_task
from tests.daemon import Daemon, subreaper
from tests.support import REPO, poll_for, reply, text, worker_env
from worker import credentials
from worker.testing.messages_api import DEFAULT_API_KEY, Fault, MessagesAPIServer, Reply

MODEL = "claude-on-the-local-api"
CONFIG = f"""\
[heartbeat]
interval = 0.2
[model]
name = "{MODEL}"
max_tokens = 256
"""
LOCAL = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    for name in os.environ:
        if name.startswith("ANTHROPIC_") or name in ("CREDENTIALS_DIRECTORY", "INVOCATION_ID"):
            monkeypatch.delenv(name)
    with subreaper():
        daemon = Daemon(tmp_path, CONFIG)
        try:
            yield daemon
        finally:
            daemon.cleanup()


def logged(daemon: Daemon, name: str) -> list[dict[str, Any]]:
    """The daemon's log events called ``name``, once there is one."""
    found = lambda: [e for e in daemon.log_events() if e.get("event") == name]  # noqa: E731
    return poll_for(found, what=f"{name} in the daemon's log")


def submit(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return daemon.run_cli("submit", "--prompt", "Say done.", *args)


def test_reason_shows_the_model_call_being_retried_until_it_goes_through(
    daemon: Daemon,
) -> None:
    overloaded = threading.Event()
    overloaded.set()

    def respond(_: dict[str, Any]) -> Reply | Fault:
        return Fault.overloaded() if overloaded.is_set() else Reply.text("Done.")

    with MessagesAPIServer(responder=respond) as server:
        daemon.start(
            {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY, **LOCAL}
        )
        task = submit_task(daemon.spool, daemon.config, prompt="Say done.", name="retried")
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


def test_submit_warns_when_the_daemon_holds_no_key_and_says_a_restart_is_what_works(
    daemon: Daemon, tmp_path: Path
) -> None:
    with MessagesAPIServer() as server:
        daemon.start({"ANTHROPIC_BASE_URL": server.base_url, **LOCAL})
        assert daemon.proc is not None
        done = submit(daemon, "--name", "keyless")
        assert (done.returncode, done.stdout) == (0, "keyless\n"), done
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"agentd: warning: the daemon (pid {daemon.proc.pid}) holds no ")
        assert (
            "the daemon reads it when it starts, so restart it with ANTHROPIC_API_KEY_FILE" in line
        )
        assert line.endswith("then `agentd retry keyless`.")
        row = daemon.wait_state("keyless", "failed", "done")
        assert row["state"] == "failed", row
        assert row["reason"].startswith("No Anthropic API key is set; the daemon reads it when")
        assert server.requests == []
        # a scripted task needs no key: no warning
        script = tmp_path / "script.json"
        script.write_text('{"responses": [{"content": [{"type": "text", "text": "ok"}]}]}')
        done = submit(daemon, "--name", "scripted", "--script", str(script))
        assert (done.returncode, done.stderr) == (0, ""), done


def test_sighup_reads_the_key_file_again_and_a_retry_then_works(
    daemon: Daemon, tmp_path: Path
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-ant-not-the-right-one\n")
    key_file.chmod(0o600)
    with MessagesAPIServer() as server:
        server.responder = lambda _: Reply.text("Done.")
        env = {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY_FILE": str(key_file)}
        daemon.start({**env, **LOCAL})
        assert daemon.proc is not None
        done = submit(daemon, "--name", "rotated")
        assert (done.returncode, done.stderr) == (0, ""), done  # it holds a key
        row = daemon.wait_state("rotated", "failed", "done")
        assert row["state"] == "failed", row
        reason = row["reason"]
        assert reason.startswith("The Anthropic API rejected the API key (401); "), reason
        assert f"put it in {key_file} (the daemon's ANTHROPIC_API_KEY_FILE)" in reason
        assert "send the daemon SIGHUP" in reason and "agentd retry TASK" in reason
        key_file.write_text(DEFAULT_API_KEY + "\n")
        os.kill(daemon.proc.pid, signal.SIGHUP)
        (event,) = logged(daemon, "config_reloaded")
        assert event["renewed"] == [credentials.API_KEY]
        assert DEFAULT_API_KEY not in daemon.log_path.read_text()
        code, _, err = daemon.cli("retry", "rotated")
        assert (code, err) == (0, "")
        poll_for(lambda: daemon.events("rotated", "task_retried"), what="the retry")
        row = daemon.wait_state("rotated", "done", "failed")
        assert row["state"] == "done", row


def test_a_key_file_that_cannot_be_read_at_sighup_keeps_the_key_in_use(
    daemon: Daemon, tmp_path: Path
) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(DEFAULT_API_KEY)
    with MessagesAPIServer() as server:
        server.responder = lambda _: Reply.text("Done.")
        env = {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY_FILE": str(key_file)}
        daemon.start({**env, **LOCAL})
        assert daemon.proc is not None
        key_file.write_text("")
        os.kill(daemon.proc.pid, signal.SIGHUP)
        (event,) = logged(daemon, "config_reload_failed")
        assert "is empty" in event["reason"]
        daemon.submit([reply(text("unused"))], name="scripted")  # the daemon still serves
        submit(daemon, "--name", "still")
        assert daemon.wait_state("still", "done", "failed")["state"] == "done"


def test_the_store_file_is_read_again_too(tmp_path: Path) -> None:
    store_file = tmp_path / "store-url"
    store_file.write_text("postgresql://agentd:old@127.0.0.1/agentd")
    held = credentials.gather({"AGENTD_STORE_FILE": str(store_file)})
    store_file.write_text("postgresql://agentd:new@127.0.0.1/agentd")
    renewed = credentials.reread(held)
    assert renewed.get(credentials.STORE) == "postgresql://agentd:new@127.0.0.1/agentd"
    assert renewed.origins == held.origins == {credentials.STORE: str(store_file)}
    # what travels to the daemon through the handover pipe keeps where each came from
    assert credentials.Credentials.decode(renewed.encode()).origins == renewed.origins


def test_under_systemd_the_hint_is_a_restart(tmp_path: Path) -> None:
    (tmp_path / "anthropic_api_key").write_text("sk-ant-from-systemd")
    credentials.hold(credentials.gather({"CREDENTIALS_DIRECTORY": str(tmp_path)}))
    how = credentials.how_to_change(credentials.API_KEY, {})
    assert "LoadCredential=anthropic_api_key:" in how and "`systemctl restart agentd`" in how
    assert credentials.reread(credentials.held()) == credentials.held()  # not re-read
    credentials.hold(credentials.Credentials())
    how = credentials.how_to_change(credentials.API_KEY, {"INVOCATION_ID": "0123"})
    assert "`systemctl restart agentd`" in how


def test_the_local_messages_api_runs_for_users_and_says_what_to_set(
    daemon: Daemon, tmp_path: Path
) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "worker.testing.messages_api", "--context-limit", "400"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=worker_env(),
    )
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline().strip() for _ in range(2)]
        names = [line.partition("=")[0] for line in lines]
        assert names == ["ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY"], lines
        env = dict(line.split("=", 1) for line in lines)
        assert env["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")
        daemon.start({**env, **LOCAL})
        assert submit(daemon, "--name", "short").returncode == 0
        assert daemon.wait_state("short", "done", "failed")["state"] == "done"
        long = daemon.run_cli("submit", "--name", "long", "--prompt", "word " * 1000)
        assert long.returncode == 0, long
        row = daemon.wait_state("long", "done", "failed")
        assert row["state"] == "failed" and "context window" in row["reason"], row
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0
        if server.stdout is not None:
            server.stdout.close()
