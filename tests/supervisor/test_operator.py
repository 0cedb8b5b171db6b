"""Operator commands against a real daemon: checked before they act, applied at a safe
point, and a cancel that is final (docs/design.md section 2, invariant 7).

Every command runs as its own process, the way an operator gives it; the campaign of the
same attacks is ``tests/chaos/operator.py`` (fault class 18), whose helpers these use.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.status import load_state
from tests.chaos.operator import (
    GRACE,
    agentd,
    config_text,
    first_call,
    hold,
    race,
    release,
    running_script,
    runs,
    sequence,
    wait_tool,
    workspace_file,
)
from tests.daemon import Daemon, alive, group_alive
from tests.support import journal_records, of_kind, poll_for, reply, text, tool_use

pytestmark = pytest.mark.usefixtures("subreaper")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("operator"), config_text())
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def record_kinds(daemon: Daemon, task_id: str) -> list[str]:
    return [str(r["k"]) for r in journal_records(daemon.task(task_id))]


def test_a_refused_rewind_leaves_the_running_tool_alone(daemon: Daemon) -> None:
    name = "refused"
    daemon.submit(running_script(None), name=name)  # until the test releases it
    wait_tool(daemon, name)
    for args, code in (
        (["--to", "99"], 2),
        (["--to", "-1"], 2),
        (["--to", "0"], 2),  # no --yes, and the running call cannot be undone
        (["--to", "1", "--yes"], 3),  # the live turn: its call has no result yet
    ):
        result = agentd(daemon, "rewind", name, *args)
        assert (result.code, result.out) == (code, ""), result
        assert result.one_line_error, result
    call_id = first_call(daemon, name)
    assert load_state(daemon.task(name)).calls[call_id].result is None  # still running
    assert daemon.row(name)["phase"] == "tool:run_command"
    release(daemon, name)
    row = daemon.wait_state(name, "done", "held", "failed", timeout=60)
    assert row["state"] == "done" and row["restarts"] == 0, row
    assert workspace_file(daemon, name, "out.txt") == "start\nfinished\n"
    assert "hold" not in record_kinds(daemon, name) and "rewind" not in record_kinds(daemon, name)
    assert daemon.events(name, "worker_killed") == []
    assert len(daemon.events(name, "worker_spawned")) == 1
    assert not (daemon.task(name).path / "pause.request").exists()


def test_an_accepted_rewind_waits_for_the_call_or_says_it_cut_it_off(daemon: Daemon) -> None:
    short, long = "rewind-short", "rewind-long"
    daemon.submit(running_script(GRACE * 0.75), name=short)
    daemon.submit(running_script(None), name=long)  # never released: always past the grace
    for name in (short, long):
        wait_tool(daemon, name)
    # within the grace: the rewind waits for the call's result, then rewinds past it
    call_id = first_call(daemon, short)
    result = agentd(daemon, "rewind", short, "--to", "0", "--yes")
    assert result.code == 0 and "cut off" not in result.out, result
    (first, *_) = of_kind(journal_records(daemon.task(short)), "result")
    assert first["call_id"] == call_id and "exit code 0" in first["content"]
    assert workspace_file(daemon, short, "out.txt").startswith("start\nfinished\n")
    assert daemon.events(short, "worker_killed") == []
    (event,) = daemon.events(short, "task_rewound")
    assert (event["from_turn"], event["to"], event["cut_off"]) == (1, 0, [])
    # past the grace: the call is cut off, and the rewind says so in one line and its event
    call_id = first_call(daemon, long)
    result = agentd(daemon, "rewind", long, "--to", "0", "--yes")
    assert result.code == 0, result
    (line,) = [line for line in result.out.splitlines() if line.startswith("cut off:")]
    assert call_id in line and "run_command (unsafe)" in line and f"({GRACE:g} s)" in line
    (event,) = daemon.events(long, "task_rewound")
    assert event["cut_off"] == [call_id] and event["level"] == "warning"
    assert daemon.events(long, "worker_killed")
    assert agentd(daemon, "cancel", long).code in (0, 3)  # its new branch would run again


def test_cancel_is_final_with_the_daemon_down_and_the_next_start_runs_nothing(
    daemon: Daemon,
) -> None:
    name = "cancelled-down"
    (call_id,) = hold(daemon, [name]).values()
    daemon.stop()
    try:
        result = agentd(daemon, "cancel", name)
        assert (result.code, result.out) == (0, f"{name}: cancelled\n"), result
        journal = daemon.task(name).journal.read_bytes()
        for args in (
            ("approve-dangling", name, "--all", "--rerun"),
            ("approve-dangling", name, call_id, "--rerun"),
            ("rewind", name, "--to", "0", "--yes"),
            ("retry", name),
        ):
            refused = agentd(daemon, *args)
            assert refused.code == 3 and refused.one_line_error, refused
            assert "was cancelled" in refused.err
    finally:
        daemon.start()
    daemon.cli("status")  # the daemon has seen every task by the time it serves
    row = daemon.wait_state(name, "cancelled", "queued", "running", "held", "done")
    assert row["state"] == "cancelled", row
    assert daemon.task(name).journal.read_bytes() == journal
    assert runs(daemon, name) == 1 and daemon.events(name, "dangling_decided") == []


def test_a_worker_that_outlived_its_daemon_is_stopped_when_its_task_is_cancelled(
    daemon: Daemon,
) -> None:
    name = "orphan"
    command = "sleep 4; echo after >> late.txt"
    daemon.submit([reply(tool_use("run_command", command=command, timeout=60))], name=name)
    row = daemon.wait_row(name, lambda r: r["phase"] == "tool:run_command")
    daemon.kill()  # kill -9: its worker, in a session of its own, runs on
    try:
        result = agentd(daemon, "cancel", name)
        assert (result.code, result.out) == (0, f"{name}: cancelled\n"), result
    finally:
        daemon.start()
    daemon.wait_row(name, lambda r: r["state"] == "cancelled" and not alive(row["pid"]))
    assert daemon.events(name, "worker_adopted")
    poll_for(lambda: not group_alive(row["pid"]), 30, what="the worker's group to be gone")
    assert workspace_file(daemon, name, "late.txt") == ""  # its tool was stopped with it


@pytest.mark.parametrize("up", [True, False], ids=["daemon-up", "daemon-down"])
def test_cancel_racing_approve_has_exactly_one_winner(daemon: Daemon, up: bool) -> None:
    names = [f"race-{'up' if up else 'down'}-{i}" for i in range(3)]
    hold(daemon, names)
    if not up:
        daemon.stop()
    outcomes = {}
    try:
        for i, name in enumerate(names):
            pair: list[tuple[str, ...]] = [
                ("cancel", name),
                ("approve-dangling", name, "--all", "--rerun"),
            ]
            one, other = pair if i % 2 else pair[::-1]
            first, second = race(daemon, one, other, gap=0.0)
            outcomes[name] = (first, second) if i % 2 else (second, first)
    finally:
        if not up:
            daemon.start()
    for name, (cancel, approve) in outcomes.items():
        row = daemon.wait_state(name, "done", "cancelled", "failed", timeout=20)
        if (cancel.code, approve.code) == (0, 0):  # the cancel came after the call's result
            # (to the millisecond of their stamps: a tie is as far as they can tell)
            assert sequence(daemon, name) in ("after", "tie"), row
            assert row["state"] == "cancelled", row
            continue
        assert sorted((cancel.code, approve.code)) == [0, 3], (cancel, approve)
        loser = cancel if cancel.code else approve
        assert loser.one_line_error and loser.out == "", loser
        if cancel.code == 0:
            assert "already decided" in approve.err or "was cancelled" in approve.err
            assert (row["state"], runs(daemon, name)) == ("cancelled", 1), row
        else:
            # the decision won: the cancel found it decided, or the task done (before its
            # cancel was recorded, or after, before the daemon could apply it)
            assert any(
                why in cancel.err for why in ("already decided", "ended done", "already done")
            ), cancel
            assert (row["state"], runs(daemon, name)) == ("done", 2), row


def test_a_crashed_task_waiting_for_a_place_says_it_is_queued(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "one-place", config_text(max_workers=1))
    try:
        long = [reply(tool_use("run_command", command="sleep 30", timeout=60)), reply(text("."))]
        daemon.submit(long, name="first")
        daemon.submit([reply(text("Done."))], name="second")
        daemon.start()  # it has seen both once it serves; "first", the older, runs
        row = daemon.wait_row("first", lambda r: r["phase"] == "tool:run_command")
        assert daemon.row("second")["state"] == "queued"
        os.kill(row["pid"], signal.SIGKILL)
        daemon.wait_state("second", "done", timeout=20)  # it had the place first
        (event,) = daemon.events("first", "restart_scheduled")
        assert (event["delay"], event["queued"]) == (0.0, True), event
    finally:
        daemon.cleanup()
