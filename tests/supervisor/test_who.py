# ruff: noqa: F811  (the fixtures of test_cli, imported: each test names them again)
"""Who did what (docs/design.md section 15): every operator action records ``by`` (the Unix
user) and ``via`` in what it writes, and ``history``, ``logs``, ``show``, the events, the
daemon's log and the hooks' payloads show them; automatic actions carry neither. ``by`` is
the name of the process's real uid, whatever ``$LOGNAME`` and ``$USER`` say."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.operator import Operator, Via
from supervisor.stores import store_of
from tests.daemon import Daemon, config_text, subreaper
from tests.supervisor.test_cli import (  # noqa: F401  (fixtures, used by name)
    Run,
    agentd,
    held,
    set_state,
    spool,
)
from tests.supervisor.test_daemon import charge_script
from tests.supervisor.test_events import RECORD_HOOK, hooks_table
from tests.support import (
    journal_records,
    of_kind,
    poll_for,
    reply,
    run_to_end,
    scripted_task,
    tool_use,
)
from tests.support import text as text_block
from worker.events import read_events
from worker.spool import Spool, TaskDir

#: The user these tests run as: the name of the real uid, what every action records.
USER = pwd.getpwuid(os.getuid()).pw_name
#: What a process may say of itself, and no action records.
CLAIMED = {"LOGNAME": "mallory", "USER": "mallory"}


@pytest.fixture(autouse=True)
def _user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run with ``$LOGNAME`` and ``$USER`` naming someone else."""
    for name, value in CLAIMED.items():
        monkeypatch.setenv(name, value)


def cli_process(spool: Spool, *args: str) -> subprocess.CompletedProcess[str]:
    """``agentd ARGS`` as its own process, with ``CLAIMED`` in its environment."""
    return Daemon(spool.root.parent, config_text()).run_cli(*args, env=CLAIMED, timeout=60)


def events(task: TaskDir, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(task.events) if e.get("event") == name]


def test_operator_fields_and_what_is_no_operator() -> None:
    assert Operator.here().fields() == {"by": USER, "via": "cli"}  # not $LOGNAME
    assert Operator.of({"by": "bob", "via": "console"}) == Operator("bob", Via.CONSOLE)
    # the mark of an earlier release's daemon, and anything else, is nobody
    for record in ({"by": "daemon"}, {"by": "", "via": "cli"}, {"via": "cli"}, None):
        assert Operator.of(record) is None
    assert str(Operator("bob", Via.API)) == "by bob via api"


def test_a_decision_names_its_operator_in_the_decision_event_history_show_and_logs(
    agentd: Run, held: tuple[TaskDir, str]
) -> None:
    task, call_id = held
    code, _, err = agentd("approve-dangling", task.id, call_id, "--skip", "--reason", "no")
    assert (code, err) == (0, "")
    decision = json.loads(next(task.decisions.iterdir()).read_text())
    assert (decision["by"], decision["via"]) == (USER, "cli")
    (event,) = events(task, "dangling_decided")
    assert (event["by"], event["via"]) == (USER, "cli")
    assert run_to_end(task) == "done"
    # the worker's own event, as it applied the decision, names who made it too
    applied = events(task, "dangling_decided")[-1]
    assert applied is not event and (applied["by"], applied["via"]) == (USER, "cli")
    (row,) = [r for r in json.loads(agentd("history", task.id, "--json")[1]) if r["tool_calls"]]
    assert row["tool_calls"][0]["decision"] == {"action": "skip", "by": USER, "via": "cli"}
    assert f"run_command(unsafe: skipped; skip by {USER} via cli)" in agentd("history", task.id)[1]
    shown = [json.loads(line) for line in agentd("show", task.id, "--json")[1].splitlines()]
    (line,) = [s for s in shown if s["kind"] == "decision"]
    assert (line["by"], line["via"], line["reason"]) == (USER, "cli", "no")
    assert f"(by {USER} via cli)" in agentd("show", task.id)[1]
    logged = agentd("logs", task.id)[1]
    assert f"dangling_decided call_id={call_id} action=skip by={USER} via=cli" in logged


def test_a_cancel_names_its_operator_in_its_record_and_its_event(agentd: Run, spool: Spool) -> None:
    task = scripted_task(spool, [reply(text_block("hi"))], name="to-cancel")
    code, out, _ = agentd("cancel", task.id)
    assert (code, out) == (0, f"{task.id}: cancelled\n")
    stamp = store_of(task).read_cancel(task.id)
    assert stamp is not None and (stamp["by"], stamp["via"]) == (USER, "cli")
    (event,) = events(task, "task_cancelled")  # (a cancel with no daemon is logged too)
    assert (event["by"], event["via"]) == (USER, "cli")


def test_by_is_the_real_users_name_never_what_the_environment_says(
    held: tuple[TaskDir, str], spool: Spool
) -> None:
    """``LOGNAME=mallory USER=mallory agentd approve-dangling`` and ``cancel``, each its own
    process: each records the name of its real uid (docs/design.md section 15)."""
    task, call_id = held
    done = cli_process(spool, "approve-dangling", task.id, call_id, "--skip", "--reason", "no")
    assert done.returncode == 0, done
    decision = json.loads(next(task.decisions.iterdir()).read_text())
    assert (decision["by"], decision["via"]) == (USER, "cli")
    other = scripted_task(spool, [reply(text_block("hi"))], name="cancelled-by")
    done = cli_process(spool, "cancel", other.id)
    assert done.returncode == 0, done
    stamp = store_of(other).read_cancel(other.id)
    assert stamp is not None and (stamp["by"], stamp["via"]) == (USER, "cli")
    for made in (task, other):
        assert "mallory" not in made.events.read_text()


def test_a_name_that_is_no_plain_user_name_is_recorded_as_the_uid() -> None:
    from supervisor.operator import plain, user_name

    assert user_name(os.getuid()) == USER
    unknown = next(uid for uid in range(3_000_000, 3_001_000) if not _known(uid))
    assert user_name(unknown) == str(unknown)  # no name in the password database
    for name in ("alice", "bob.ops", "_svc-1", "a" * 32):
        assert plain(name), name
    for name in ("mal\nlory", "-x", ".x", "a b", "a" * 33, "", "é"):
        assert not plain(name), name


def _known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_a_record_naming_an_odd_by_is_shown_quoted_on_its_line(
    agentd: Run, held: tuple[TaskDir, str]
) -> None:
    """A decision and a cancel line whose ``by`` has a newline (an earlier release took it
    from ``$LOGNAME``): ``logs``, ``history`` and ``show`` show each, quoted, on one line."""
    task, call_id = held
    odd = "mal\nlory"
    assert agentd("approve-dangling", task.id, call_id, "--skip", "--reason", "no")[0] == 0
    path = next(task.decisions.iterdir())
    path.write_text(json.dumps(json.loads(path.read_text()) | {"by": odd}))
    assert run_to_end(task) == "done"
    line = {"event": "task_cancelled", "timestamp": "2026-01-01T00:00:00.000Z", "level": "info",
            "task": task.id, "by": odd, "via": "cli", "origin": "daemon"}  # fmt: skip
    with task.events.open("a") as events_file:
        events_file.write(json.dumps(line) + "\n")
    quoted = json.dumps(odd)
    logged = agentd("logs", task.id)[1]
    assert f"task_cancelled by={quoted} via=cli" in logged
    assert f"action=skip by={quoted} via=cli" in logged
    assert f"skip by {quoted} via cli" in agentd("history", task.id)[1]
    assert f"(by {quoted} via cli)" in agentd("show", task.id)[1]
    for command in ("logs", "history", "show"):
        out = agentd(command, task.id)[1]
        assert not [x for x in out.splitlines() if x.startswith("lory")], (command, out)


def test_a_retry_names_its_operator(agentd: Run, spool: Spool) -> None:
    task = scripted_task(spool, [reply(text_block("hi"))], name="to-retry")
    set_state(task, "failed", "crash_loop")
    assert agentd("retry", task.id)[:2] == (0, f"{task.id}: queued for retry\n")
    (event,) = events(task, "task_retried")
    assert (event["by"], event["via"]) == (USER, "cli")


def test_a_rewind_and_a_fork_name_their_operator(agentd: Run, spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(text_block(f"turn {n}")) for n in (1, 2)], name="to-rewind", max_turns=1
    )
    assert run_to_end(task) in ("done", "failed")
    assert agentd("rewind", task.id, "--to", "0")[0] == 0
    (record,) = of_kind(journal_records(task), "rewind")
    assert (record["by"], record["via"]) == (USER, "cli")
    (event,) = events(task, "task_rewound")
    assert (event["by"], event["via"]) == (USER, "cli")
    rows = json.loads(agentd("history", task.id, "--json")[1])
    (cut,) = [r for r in rows if r["rewound"]]
    assert cut["rewind"]["by"] == USER and cut["rewind"]["to"] == 0
    assert f"by {USER} via cli" in agentd("history", task.id)[1]

    code, out, _ = agentd("fork", task.id, "--at", "0", "--name", "the-fork")
    assert (code, out) == (0, "the-fork\n")
    row = json.loads(agentd("status", "the-fork", "--json")[1])["tasks"][0]
    assert row["forked_from"] == {"task": task.id, "turn": 0}  # (its shape, as it was)
    (event,) = events(task, "task_forked")
    assert (event["by"], event["via"], event["fork"]) == (USER, "cli", "the-fork")
    base = of_kind(journal_records(spool.task("the-fork")), "base")[0]
    assert base["from"] == {"task": task.id, "turn": 0, "by": USER, "via": "cli"}


def test_automatic_actions_name_nobody(spool: Spool) -> None:
    task = scripted_task(spool, [reply(text_block("hi"))], name="alone")
    assert run_to_end(task) == "done"
    assert not [e for e in read_events(task.events) if "by" in e or "via" in e]


# -- a real daemon -----------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    out = tmp_path / "done.json"
    hook = [sys.executable, "-c", RECORD_HOOK, str(out)]
    with subreaper():
        made = Daemon(tmp_path / "d", config_text() + hooks_table(on_done=hook))
        try:
            made.start(env=CLAIMED)
            yield made
        finally:
            made.cleanup()


def test_the_daemon_logs_who_and_the_next_hook_says_who_led_to_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A decision made with the daemon up: its log has the decision's ``by`` (relayed),
    and the ``on_done`` hook of the end it led to names the operator; a cancel the
    daemon applies and a retry it takes name theirs in the daemon's own events."""
    name = "held-one"
    daemon.submit(charge_script(), name=name)
    charged = daemon.task(name).path / "workspace" / "charged"
    row = daemon.wait_row(
        name, lambda r: r["phase"] == "tool:run_command" and charged.exists(), what="the charge"
    )
    os.kill(row["pid"], signal.SIGKILL)
    daemon.wait_state(name, "held")
    (call,) = json.loads(daemon.cli("dangling", name, "--json")[1])
    other = {"LOGNAME": "bob-ops", "USER": "bob-ops"}  # said by the process: not recorded
    done = daemon.run_cli("approve-dangling", name, call["call_id"], "--skip", env=other)
    assert done.returncode == 0, done
    daemon.wait_state(name, "done")
    payload = poll_for(
        lambda: (
            (tmp_path / "done.json").exists() and json.loads((tmp_path / "done.json").read_text())
        ),
        15,
        what="the on_done hook",
    )["stdin"]
    assert (payload["by"], payload["via"], payload["acted"]) == (
        USER,
        "cli",
        "dangling_decided",
    )
    logged = poll_for(
        lambda: [e for e in daemon.log_events() if e.get("event") == "dangling_decided"],
        10,
        what="the decision in the daemon's log",
    )
    assert all(e["by"] == USER and e["via"] == "cli" for e in logged), logged

    # a cancel the daemon applies (its worker runs), and a retry it takes from its request
    daemon.submit([{"content": [text_block("slow")], "delay": 60}], name="slow")
    daemon.wait_state("slow", "running")
    assert daemon.run_cli("cancel", "slow", env=other).returncode == 0
    (cancelled,) = poll_for(lambda: daemon.events("slow", "task_cancelled"), 20, what="cancel")
    assert (cancelled["by"], cancelled["via"], cancelled["origin"]) == (USER, "cli", "daemon")
    # `agentd logs` shows who, on the daemon's own line of the cancel it carried out too
    (line,) = [x for x in daemon.cli("logs", "slow")[1].splitlines() if "task_cancelled" in x]
    assert f"by={USER} via=cli" in line, line
    # a script that ends before the task does fails it; its retry is the daemon's to take
    daemon.submit([reply(tool_use("list_dir"))], name="short")
    daemon.wait_state("short", "failed")
    assert daemon.run_cli("retry", "short", env=other).returncode == 0
    (retried,) = poll_for(lambda: daemon.events("short", "task_retried"), 20, what="retry")
    assert (retried["by"], retried["via"], retried["origin"]) == (USER, "cli", "daemon")
