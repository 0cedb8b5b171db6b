"""``exits.settle``: the one verdict on a worker's exit, for the daemon and ``agentd run``
alike, tested as ``policy.decide`` is: a pure function, no process, no clock."""

from __future__ import annotations

import random

import pytest

from supervisor import exits
from supervisor.exits import KillReason, TaskView, WaitKind, WorkerExit, settle
from worker.config import RestartConfig
from worker.protocol import ExitCode, TaskStatus

POLICY = RestartConfig(backoff_initial=1.0, backoff_max=30.0, crash_loop_limit=3)


def ended(
    code: int | None = None,
    *,
    sig: str | None = None,
    kill: KillReason | None = None,
    said: str | None = None,
    progressed: bool = False,
    turn: int = 4,
    unread: str | None = None,
) -> WorkerExit:
    return WorkerExit(code, sig, kill, said, progressed, turn, unread)


def verdict(exit_: WorkerExit, view: TaskView | None = None) -> exits.Verdict:
    return settle(exit_, view or TaskView(), POLICY, random.Random(7))


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (ExitCode.DONE, exits.Ended(TaskStatus.DONE, "why")),
        (ExitCode.FAILED, exits.Ended(TaskStatus.FAILED, "why")),
        (ExitCode.CONFIG, exits.Ended(TaskStatus.FAILED, "why")),
        (ExitCode.HELD, exits.Held("why")),
        (ExitCode.LOCKED, exits.LockWait()),
    ],
)
def test_a_worker_s_own_verdict_is_the_task_s(code: int, expected: exits.Verdict) -> None:
    assert verdict(ended(code, said="why")) == expected


def test_a_cancel_wins_over_whatever_the_worker_said_as_it_ended() -> None:
    for code in (ExitCode.DONE, ExitCode.HELD, None):
        assert verdict(ended(code, kill=KillReason.CANCEL, sig="SIGTERM")) == exits.Cancelled()


def test_a_stop_asked_for_requeues_and_a_stop_nobody_asked_for_depends_on_the_store() -> None:
    assert verdict(ended(ExitCode.STOPPED, kill=KillReason.STOP)) == exits.Requeued()
    assert verdict(ended(ExitCode.STOPPED), TaskView(shared=True)) == exits.Fenced()
    # on a spool nothing stops a worker but its supervisor: anything else is a crash
    assert isinstance(verdict(ended(ExitCode.STOPPED, progressed=True)), exits.Restart)


def test_a_storage_fault_is_a_wait_whose_run_restarts_after_progress() -> None:
    first = verdict(ended(ExitCode.STORAGE, said="ENOSPC"), TaskView(storage_waits=4))
    assert isinstance(first, exits.Wait)
    assert (first.kind, first.waits, first.reason) == (WaitKind.STORAGE, 5, "storage_fault: ENOSPC")
    again = verdict(ended(ExitCode.STORAGE, progressed=True), TaskView(storage_waits=4))
    assert isinstance(again, exits.Wait) and again.waits == 1
    assert again.why == exits.UNSAID[WaitKind.STORAGE]  # the worker could not say why
    assert again.delay < first.delay  # a new run of waits polls closely again


@pytest.mark.parametrize("code", [ExitCode.DONE, ExitCode.FAILED, ExitCode.CONFIG, ExitCode.HELD])
def test_a_verdict_whose_exit_record_the_store_could_not_give_waits_for_the_store(
    code: ExitCode,
) -> None:
    # not `done` with no reason: the worker, started again on its ended journal, says it
    got = verdict(ended(code, unread="the database is away"), TaskView(storage_waits=2))
    assert isinstance(got, exits.Wait)
    assert (got.kind, got.waits) == (WaitKind.STORAGE, 3)
    assert got.reason == "storage_fault: the exit record could not be read: the database is away"
    stopping = verdict(ended(code, unread="away"), TaskView(stopping=True))
    assert stopping == exits.Requeued()  # (the next start says it)
    cancelled = verdict(ended(code, kill=KillReason.CANCEL, unread="away"))
    assert cancelled == exits.Cancelled()


def test_an_exit_whose_words_are_only_its_why_is_judged_without_them() -> None:
    got = verdict(ended(ExitCode.STORAGE, unread="away"))
    assert isinstance(got, exits.Wait) and got.why == exits.UNSAID[WaitKind.STORAGE]
    stopped = verdict(ended(ExitCode.STOPPED, unread="away"), TaskView(shared=True))
    assert stopped == exits.Fenced()


def test_no_resources_is_a_wait_never_a_crash_whatever_the_count() -> None:
    found = verdict(ended(ExitCode.RESOURCES), TaskView(resource_waits=1000, crashes=()))
    assert isinstance(found, exits.Wait) and found.kind is WaitKind.RESOURCES
    assert found.waits == 1001 and found.delay <= POLICY.backoff_max
    assert found.reason.startswith("resources: ")


def test_a_server_that_cannot_list_its_tools_is_a_wait_counted_with_resources() -> None:
    found = verdict(ended(ExitCode.TOOLS, said="mcp: git: exited 1"), TaskView(resource_waits=1))
    assert isinstance(found, exits.Wait) and found.kind is WaitKind.MCP
    assert (found.waits, found.reason) == (2, "mcp: git: exited 1")
    unsaid = verdict(ended(ExitCode.TOOLS))
    assert (
        isinstance(unsaid, exits.Wait) and unsaid.reason == "mcp: a server could not list its tools"
    )


def test_a_server_that_cannot_list_its_tools_fails_the_task_at_the_restart_limit() -> None:
    limit = POLICY.crash_loop_limit
    found = verdict(
        ended(ExitCode.TOOLS, said="mcp: git: exited 1"), TaskView(resource_waits=limit - 1)
    )
    assert isinstance(found, exits.Ended) and found.state == "failed", found
    assert found.reason == exits.no_tool_list("git: exited 1", limit)
    assert found.reason.startswith(f"mcp: git: exited 1; no tool list after {limit} starts")


def test_a_crash_after_progress_restarts_at_once_and_is_remembered() -> None:
    found = verdict(ended(sig="SIGKILL", progressed=True, turn=9))
    assert found == exits.Restart(0.0, 9, [{"turn": 9, "progressed": True}])


def test_crashes_without_progress_back_off_then_give_up_on_the_same_turn() -> None:
    history: list[dict[str, object]] = []
    delays = []
    for _ in range(POLICY.crash_loop_limit - 1):
        found = verdict(ended(ExitCode.ERROR, turn=2), TaskView(crashes=history))
        assert isinstance(found, exits.Restart)
        delays.append(found.delay)
        history = list(found.crashes)
    assert 0 < delays[0] < delays[1]
    last = verdict(ended(sig="SIGSEGV", turn=2), TaskView(crashes=history))
    assert isinstance(last, exits.GaveUp) and last.reason == "crash_loop"
    assert len(last.crashes) == POLICY.crash_loop_limit


def test_the_crash_history_is_bounded() -> None:
    history = [{"turn": n, "progressed": True} for n in range(exits.CRASH_MEMORY)]
    found = verdict(ended(sig="SIGKILL", progressed=True, turn=99), TaskView(crashes=history))
    assert isinstance(found, exits.Restart)
    assert len(found.crashes) == exits.CRASH_MEMORY and found.crashes[-1]["turn"] == 99


def test_nothing_restarts_while_the_supervisor_stops() -> None:
    stopping = TaskView(stopping=True)
    for exit_ in (ended(sig="SIGKILL"), ended(ExitCode.STORAGE), ended(ExitCode.RESOURCES)):
        assert verdict(exit_, stopping) == exits.Requeued()
    # ...but what the worker said of its task still stands
    assert verdict(ended(ExitCode.DONE, said="end_turn"), stopping) == exits.Ended(
        TaskStatus.DONE, "end_turn"
    )


def test_how_a_crash_is_told() -> None:
    assert exits.how_it_ended(ended(sig="SIGKILL", kill=KillReason.HUNG)) == "hung"
    assert exits.how_it_ended(ended(sig="SIGKILL")) == "signal SIGKILL"
    assert exits.how_it_ended(ended(1)) == "exit code 1"
