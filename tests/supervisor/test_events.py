"""Task events in the daemon's own stream (docs/design.md section 8): whichever process made
them, each once and in order, at its level, with journald priorities under systemd; the
hooks a real daemon runs. (The names themselves: ``tests/worker/test_event_names.py``.)"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from supervisor.inbox import _drain
from supervisor.relay import DAEMON_MARK, EventRelay
from tests.daemon import Daemon, config_text, subreaper
from tests.supervisor.test_daemon import charge_script, steps
from tests.support import poll_for
from worker.events import Event, event_line, record_event, utc_now
from worker.protocol import ExitCode
from worker.spool import TaskSpec
from worker.store.files import FileStore
from worker.store.memory import MemoryStore

pytestmark = pytest.mark.usefixtures("subreaper")

# -- the relay ------------------------------------------------------------------------------


def _store_with_task() -> MemoryStore:
    store = MemoryStore()
    store.create(TaskSpec(id="t1", prompt="p"), {"state": "queued"})
    return store


def test_the_relay_logs_what_others_wrote_once_in_order_and_skips_the_daemons() -> None:
    store = _store_with_task()
    record_event(store, "t1", Event.TASK_SUBMITTED, task="t1")
    relay = EventRelay(structlog.get_logger(), store)
    with capture_logs() as seen:
        relay.track("t1", from_end=False)
        relay.pull("t1")
        mark, value = DAEMON_MARK
        record_event(store, "t1", Event.WORKER_SPAWNED, task="t1", pid=1, **{mark: value})
        record_event(store, "t1", Event.TASK_RESUMED, task="t1", pid=1, turn=2)
        record_event(store, "t1", Event.DANGLING_HELD, "warning", task="t1", pid=1, call_id="c1")
        relay.pull("t1")
        relay.pull("t1")  # nothing new: nothing logged
    assert [(e["event"], e["log_level"]) for e in seen] == [
        ("task_submitted", "info"),
        ("task_resumed", "info"),
        ("dangling_held", "warning"),
    ]
    assert seen[2]["call_id"] == "c1" and seen[2]["pid"] == 1


def test_a_task_found_at_start_is_relayed_from_the_end_of_its_file() -> None:
    store = _store_with_task()
    record_event(store, "t1", Event.TASK_SUBMITTED, task="t1")
    relay = EventRelay(structlog.get_logger(), store)
    with capture_logs() as seen:
        relay.track("t1", from_end=True)
        relay.pull("t1")
        record_event(store, "t1", Event.TASK_RESUMED, task="t1")
        relay.pull("t1")
    assert [e["event"] for e in seen] == ["task_resumed"]


def test_the_daemons_own_line_is_logged_where_its_file_has_it() -> None:
    """A worker's line appended between the daemon's pull and its own line comes first in
    the file, and so in the log (``EventRelay.pull(own=...)``)."""
    store = _store_with_task()
    log = structlog.get_logger()
    relay = EventRelay(log, store)
    relay.track("t1", from_end=False)
    relay.pull("t1")  # what the daemon reads before it writes
    record_event(store, "t1", Event.TASK_RESUMED, task="t1")  # a worker, meanwhile
    mark, value = DAEMON_MARK
    own = event_line(Event.WORKER_SPAWNED, task="t1", **{mark: value})
    store.append_event("t1", own)
    with capture_logs() as seen:
        relay.pull("t1", own=(own, lambda: log.info("worker_spawned", task="t1")))
        relay.pull("t1")  # nothing more, and the daemon's line never twice
    assert [e["event"] for e in seen] == ["task_resumed", "worker_spawned"]


def test_a_worker_s_events_ring_its_daemon_with_one_file_however_many(tmp_path: Path) -> None:
    """A worker's store rings the daemon about each event it appends (the daemon relays it
    at once, with no poll of every task), and leaves at most one doorbell file a task for
    a daemon that does not run (``agentd run``'s long tasks)."""
    store = FileStore(tmp_path / "spool", ring_on_events=True)
    store.spool.ensure()
    store.create(TaskSpec(id="t1", prompt="p"), {"state": "queued"})
    for n in range(50):
        record_event(store, "t1", Event.MODEL_RETRY, attempt=n)
    assert [p.name for p in store.spool.inbox.iterdir()] == ["t1.events.0"]
    store.spool.ring("t2")  # a command's own ring
    assert _drain(store.spool.inbox) == {"t1", "t2"}
    assert list(store.spool.inbox.iterdir()) == []
    (store.spool.inbox / "not-a-ring").touch()
    assert _drain(store.spool.inbox) is None  # a name it cannot read: every task


# -- a real daemon ------------------------------------------------------------------------------

#: A hook that writes what it was given (stdin, environment) to the file named by $1.
RECORD_HOOK = (
    "import json, os, sys; json.dump({'stdin': json.load(sys.stdin), "
    "'env': dict(os.environ)}, open(sys.argv[1], 'w'))"
)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for daemon in made:
        daemon.cleanup()


def hooks_table(**hooks: list[str]) -> str:
    return "[hooks]\n" + "".join(f"{key} = {json.dumps(cmd)}\n" for key, cmd in hooks.items())


def hold(daemon: Daemon, name: str) -> dict[str, Any]:
    """Submit a task whose unsafe call is cut short by a kill -9: it is held."""
    daemon.submit(charge_script(), name=name)
    charged = daemon.task(name).path / "workspace" / "charged"
    row = daemon.wait_row(
        name,
        lambda r: r["phase"] == "tool:run_command" and charged.exists(),
        what="the charge to be under way",
    )
    os.kill(row["pid"], signal.SIGKILL)
    return daemon.wait_state(name, "held")


def test_a_hold_reaches_the_daemons_stream_as_a_warning_and_its_hook_gets_the_json(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    out = tmp_path / "hook.json"
    hook = [sys.executable, "-c", RECORD_HOOK, str(out)]
    daemon = Daemon(tmp_path / "d", config_text(extra=hooks_table(on_held=hook)))
    daemons.append(daemon)
    pgpass = tmp_path / "pgpass"
    pgpass.write_text("*:*:*:*:pg-hook-canary\n")
    daemon.start(
        env={
            "ANTHROPIC_API_KEY": "sk-ant-api03-hook-canary-0123456789abcdef",
            "PGPASSWORD": "pg-hook-canary",
            "PGPASSFILE": str(pgpass),
        }
    )
    row = hold(daemon, "held-1")

    def relayed(name: str) -> list[dict[str, Any]]:
        return [e for e in daemon.log_events() if e["event"] == name and e.get("task") == "held-1"]

    (held,) = poll_for(lambda: relayed("dangling_held"), 10, what="the hold in the daemon log")
    assert held["level"] == "warning"
    assert held["call_id"] == row["dangling"][0]["call_id"]
    assert len(relayed("task_submitted")) == 1  # made by the submitting command
    killed, holding = relayed("worker_exited")  # the kill -9, then the resumed worker's hold
    assert killed["signal"] == "SIGKILL" and killed["level"] == "warning"
    assert holding["code"] == ExitCode.HELD and holding["level"] == "info"
    # once each, in the order of the task's own file
    names = [e["event"] for e in daemon.log_events() if e.get("task") == "held-1"]
    assert names == [e["event"] for e in daemon.events("held-1")]
    assert all(e.get("origin") == "daemon" for e in daemon.events("held-1", "worker_exited"))

    def hook_output() -> Any:
        try:  # (the hook may have made its file and not written it whole yet)
            return json.loads(out.read_text())
        except (OSError, ValueError):
            return None

    seen = poll_for(hook_output, 10, what="the hook")
    event = seen["stdin"]
    assert event["event"] == "dangling_held" and event["task"] == "held-1"
    assert event["kind"] == "call"
    assert event["reason"] == row["reason"] and event["node"]
    (call,) = event["dangling"]
    assert call["call_id"] == row["dangling"][0]["call_id"] and call["tool"] == "run_command"
    assert (seen["env"]["AGENTD_EVENT"], seen["env"]["AGENTD_TASK"]) == ("dangling_held", "held-1")
    assert "ANTHROPIC_API_KEY" not in seen["env"]
    assert "sk-ant-api03-hook-canary" not in json.dumps(seen)
    assert not [name for name in seen["env"] if name.startswith("PG")]  # the store's neither
    assert all(not line.startswith("<") for line in daemon.log_path.read_text().splitlines())


def test_a_hook_that_hangs_is_cut_at_10_s_while_the_daemon_serves_on(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    pidfile = tmp_path / "hook.pid"
    hang = ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"]
    daemon = Daemon(tmp_path / "d", config_text(extra=hooks_table(on_done=hang)))
    daemons.append(daemon)
    daemon.start()
    first = daemon.submit(steps(2), name="first")
    daemon.wait_state(first, "done")
    poll_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10, what="the hook")
    # The hook hangs; the daemon runs a whole task meanwhile (its own hook hangs too).
    second = daemon.submit(steps(3), name="second")
    daemon.wait_state(second, "done", timeout=8)
    assert not [e for e in daemon.log_events() if e["event"] == "hook_failed"]

    def cut() -> list[dict[str, Any]]:
        return [e for e in daemon.log_events() if e["event"] == "hook_failed"]

    def both() -> list[dict[str, Any]] | None:
        found = cut()
        return found if len(found) == 2 else None

    failed = poll_for(both, 15, what="both hooks cut")
    assert {e["task"] for e in failed} == {first, second}
    assert all(e["level"] == "warning" and e["why"] == "killed after 10 s" for e in failed)
    assert all(e["hook"] == "on_done" for e in failed)
    assert len(daemon.events(first, "hook_failed")) == 1  # in the task's events too
    assert not os.path.exists(f"/proc/{pidfile.read_text().strip()}/cmdline") or (
        b"sleep" not in Path(f"/proc/{pidfile.read_text().strip()}/cmdline").read_bytes()
    )
    code, _, _ = daemon.stop()
    assert code == 0


def test_priority_prefixes_appear_under_journald_only(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    daemon = Daemon(tmp_path / "d", config_text(extra=hooks_table(on_done=["false"])))
    daemons.append(daemon)
    daemon.start(env={"JOURNAL_STREAM": "8:4242"})
    task = daemon.submit(steps(2), name="journal")
    daemon.wait_state(task, "done")

    def lines() -> list[str]:
        return daemon.log_path.read_text().splitlines()

    poll_for(lambda: any('"hook_failed"' in line for line in lines()), 10, what="hook_failed")
    prefixed = [re.fullmatch(r"<([0-7])>(\{.*\})", line) for line in lines()]
    assert all(prefixed), [line for line, m in zip(lines(), prefixed, strict=True) if not m]
    by_event = {json.loads(m.group(2))["event"]: int(m.group(1)) for m in prefixed if m}
    assert by_event["supervisor_ready"] == 6
    assert by_event["task_submitted"] == 6  # relayed lines carry theirs too
    assert by_event["hook_failed"] == 4


def test_what_was_written_while_no_daemon_ran_is_relayed_at_the_next_start_once(
    tmp_path: Path,
) -> None:
    """Each task's relay cursor is kept in the spool: a task submitted, and an event
    recorded, while the daemon is down reach its log when it starts, and two more
    restarts log neither again."""
    with subreaper():
        daemon = Daemon(tmp_path / "d", config_text())
        try:
            daemon.start()
            first = daemon.submit(steps(1), name="first")
            daemon.wait_state(first, "done")
            daemon.stop()
            late = daemon.submit(steps(1), name="late")  # no daemon runs
            note = {
                "event": "operator_note",
                "timestamp": utc_now(),
                "level": "info",
                "task": first,
            }
            FileStore.of(daemon.task(first)).append_event(first, note)
            for _ in range(3):
                daemon.start()
                daemon.wait_state(late, "done")
                poll_for(lambda: "operator_note" in daemon.log(), 30, what="the relayed note")
                daemon.stop()
            seen = [(e.get("task"), e["event"]) for e in daemon.log_events()]
            assert seen.count(("late", "task_submitted")) == 1
            assert seen.count(("first", "task_submitted")) == 1
            assert seen.count(("first", "operator_note")) == 1
        finally:
            daemon.cleanup()
