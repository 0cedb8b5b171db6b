"""The supervisor end to end: a real daemon (``python -m supervisor start``), real worker
processes, real signals.

Every wait is a deadline poll (``poll_for``); every daemon, worker and tool process a
test starts is killed (by process group) in teardown. The test process makes itself a
child subreaper for the module, so workers orphaned by a killed daemon are reparented to
it and reaped here instead of piling up as zombies of PID 1.

Measured figures (hang detection time, decision-to-resume latency) are printed; run
with ``-s`` to see them.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.coordination import ring, running_pid
from supervisor.liveness import TOOL_DEADLINE_SLACK
from supervisor.record import TaskRecord
from supervisor.status import load_state
from supervisor.stores import store_of
from tests.daemon import (
    CRASH_LOOP_LIMIT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    Daemon,
    WorkerCensus,
    alive,
    config_text,
    group_alive,
    parse_time,
    spool_processes,
    worker_pids,
)
from tests.support import (
    DANGLING_FIELDS,
    REPO,
    assert_paired,
    journal_records,
    of_kind,
    poll_for,
    reply,
    text,
    tool_use,
    worker_env,
)
from worker.spool import Spool, TaskDir

pytestmark = pytest.mark.usefixtures("subreaper")


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(name: str = "d", **config: Any) -> Daemon:
        daemon = Daemon(tmp_path / name, config_text(**config))
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.cleanup()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that only need *a* daemon; each uses its own tasks."""
    daemon = Daemon(tmp_path_factory.mktemp("shared"), config_text(max_workers=16))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


# -- scripts --------------------------------------------------------------------------------


def steps(n: int, delay: float = 0.05, tool: str = "write_file") -> list[dict[str, Any]]:
    """n - 1 turns that each call one tool, then a final answer: n turns in all."""
    responses = []
    for i in range(1, n):
        if tool == "write_file":
            block = tool_use("write_file", path=f"step{i}.txt", content=f"step {i}")
        else:
            block = tool_use("read_file", path="missing.txt")
        responses.append(reply(text(f"Step {i}."), block, delay=delay))
    responses.append(reply(text("All done."), delay=delay))
    return responses


def turns_of(daemon: Daemon, task_id: str) -> list[int]:
    return [r["turn"] for r in of_kind(journal_records(daemon.task(task_id)), "turn")]


def assert_completed(daemon: Daemon, task_id: str, turns: int) -> None:
    row = daemon.row(task_id)
    assert row["state"] == "done", row
    assert turns_of(daemon, task_id) == list(range(1, turns + 1))  # none lost, none twice
    assert_paired(load_state(daemon.task(task_id)).messages)


# -- a task runs ------------------------------------------------------------------------------


def test_a_task_runs_to_done(shared: Daemon) -> None:
    task_id = shared.submit(steps(3), name="plain")
    row = shared.wait_state(task_id, "done", "failed")
    assert row["reason"] == "end_turn"
    assert row["turn"] == 3
    assert row["last_exit"] == {"code": 0, "signal": None}
    assert_completed(shared, task_id, 3)
    # (the record is written before the event that tells of it)
    poll_for(lambda: shared.events(task_id, "task_done"), 30, what="task_done")
    names = [e["event"] for e in shared.events(task_id)]
    assert names[0] == "task_submitted"
    assert {"worker_spawned", "worker_exited", "task_done"} <= set(names)
    spawned = shared.events(task_id, "worker_spawned")[0]
    assert isinstance(spawned["pid"], int)
    assert spawned["timestamp"].endswith("Z")


def test_a_task_submitted_as_the_daemon_becomes_ready_starts_at_once(
    make_daemon: Callable[..., Daemon],
) -> None:
    # Regression: the inbox watch was set up after READY, so a submission in that window
    # was only seen by the 5 s rescan.
    daemon = make_daemon()
    daemon.start()
    submitted = time.monotonic()
    task_id = daemon.submit(steps(1), name="early")
    daemon.wait_row(task_id, lambda r: r["state"] != "queued", timeout=2.0, what="a start")
    latency = time.monotonic() - submitted
    print(f"\nsubmit-to-start latency right after READY: {latency * 1000:.0f} ms")
    daemon.wait_state(task_id, "done")


# -- crashes, hangs and stalls -------------------------------------------------------------


def test_kill_9_at_random_moments_resumes_without_losing_or_repeating_a_turn(
    shared: Daemon,
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"\nkill -9 schedule seed: {seed}")
    turns = 14
    task_id = shared.submit(steps(turns, delay=0.08), name="chaos")
    killed: set[int] = set()
    last_turn = -1
    for _ in range(3):
        # a new worker, past the turn of the last kill (so it cannot be a crash loop)
        def progressed(row: dict[str, Any], after: int = last_turn) -> bool:
            return row["state"] == "running" and row["pid"] not in killed and row["turn"] > after

        row = shared.wait_row(task_id, progressed, what="a worker that made progress")
        time.sleep(rng.uniform(0.0, 0.25))  # the random moment: model call, tool, record
        row = shared.row(task_id)
        if row["state"] != "running" or row["pid"] in killed:
            continue
        os.kill(row["pid"], signal.SIGKILL)
        killed.add(row["pid"])
        last_turn = row["turn"]
    row = shared.wait_state(task_id, "done", "failed", timeout=30)
    assert row["state"] == "done", row
    assert_completed(shared, task_id, turns)
    assert row["restarts"] == len(killed) >= 2
    exits = shared.events(task_id, "worker_exited")
    assert sum(1 for e in exits if e["signal"] == "SIGKILL") == len(killed)
    assert {e["pid"] for e in exits} >= killed
    assert len(shared.events(task_id, "restart_scheduled")) == len(killed)
    # every resumed worker said so, and each write_file ran to a recorded result
    assert len(shared.events(task_id, "task_resumed")) >= len(killed) - 1
    state = load_state(shared.task(task_id))
    assert all(call.result is not None for call in state.calls.values())


def test_a_stopped_worker_is_detected_as_hung_killed_and_restarted(shared: Daemon) -> None:
    turns = 8
    task_id = shared.submit(steps(turns, delay=0.1), name="sigstop")
    row = shared.wait_row(task_id, lambda r: r["state"] == "running" and r["turn"] >= 2)
    pid = row["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    hung = poll_for(lambda: shared.events(task_id, "worker_hung"), 10, what="worker_hung")[0]
    detection = parse_time(hung["timestamp"]) - stopped_at
    print(
        f"\nhang detection: {detection:.2f} s after SIGSTOP (heartbeat timeout "
        f"{HEARTBEAT_TIMEOUT} s, interval {HEARTBEAT_INTERVAL} s); "
        f"heartbeat age {hung['age']:.2f} s"
    )
    assert hung["pid"] == pid
    assert HEARTBEAT_TIMEOUT - HEARTBEAT_INTERVAL - 0.1 <= detection <= HEARTBEAT_TIMEOUT + 1.0
    assert hung["age"] > HEARTBEAT_TIMEOUT
    assert hung["deadman"] == HEARTBEAT_TIMEOUT  # killed by its own kernel timer
    # the group was killed (a stopped process dies of SIGKILL), and the task resumed
    poll_for(lambda: not group_alive(pid), 30, what="the hung worker's group to be gone")
    row = shared.wait_state(task_id, "done", "failed", timeout=20)
    assert row["state"] == "done", row
    assert_completed(shared, task_id, turns)
    exited = [e for e in shared.events(task_id, "worker_exited") if e["pid"] == pid]
    assert exited and exited[0]["signal"] == "SIGKILL"
    assert row["restarts"] == 1


def test_a_stalled_tool_call_gets_term_then_kill_then_the_task_restarts(
    make_daemon: Callable[..., Daemon],
) -> None:
    tool_call, grace = 1.0, 1.0
    daemon = make_daemon(tool_call=tool_call, stop_grace=grace)
    daemon.start()
    # A tool that ignores its deadline (and SIGTERM: it sleeps in Python) stalls the worker.
    stall_id = daemon.submit(
        [reply(tool_use("stall", seconds=30, once="stalled")), reply(text("Done."))],
        name="stall",
    )
    # run_command keeps the deadline itself: its command is killed and the model gets an
    # error result, so the worker never stalls and is not restarted.
    sleep_id = daemon.submit(
        [reply(tool_use("run_command", command="sleep 30", timeout=60)), reply(text("Done."))],
        name="sleep",
    )
    row = daemon.wait_row(stall_id, lambda r: r["phase"] == "tool:stall")
    pid = row["pid"]
    stalled = poll_for(lambda: daemon.events(stall_id, "worker_stalled"), 10, what="stall")[0]
    killed = poll_for(lambda: daemon.events(stall_id, "worker_killed"), 10, what="kill")[0]
    (intent,) = of_kind(journal_records(daemon.task(stall_id)), "intent")[:1]
    detection = parse_time(stalled["timestamp"]) - parse_time(intent["at"])
    term_to_kill = parse_time(killed["timestamp"]) - parse_time(stalled["timestamp"])
    print(
        f"\nstall detection: {detection:.2f} s after the tool started (tool_call {tool_call} s"
        f" + {TOOL_DEADLINE_SLACK} s slack); KILL {term_to_kill:.2f} s after TERM (grace {grace} s)"
    )
    assert stalled["pid"] == killed["pid"] == pid
    assert stalled["phase"] == "tool:stall"
    assert tool_call + TOOL_DEADLINE_SLACK <= detection <= tool_call + TOOL_DEADLINE_SLACK + 1.0
    assert grace - 0.1 <= term_to_kill <= grace + 1.0
    row = daemon.wait_state(stall_id, "done", "failed", "held", timeout=20)
    assert row["state"] == "done", row
    assert row["restarts"] == 1
    assert row["last_exit"] == {"code": 0, "signal": None}
    exited = [e for e in daemon.events(stall_id, "worker_exited") if e["pid"] == pid]
    assert exited[0]["signal"] == "SIGKILL"
    assert len(daemon.events(stall_id, "dangling_rerun")) == 1  # idempotent: re-run
    assert_completed(daemon, stall_id, 2)

    row = daemon.wait_state(sleep_id, "done", "failed", "held", timeout=20)
    assert row["state"] == "done", row
    assert row["restarts"] == 0
    (call,) = load_state(daemon.task(sleep_id)).calls.values()
    assert call.result is not None and call.result["is_error"]
    assert f"timed out after {tool_call:g} s" in call.result["content"]
    assert not [p for p in spool_processes(daemon.spool.root) if "sleep" in p.name()]


def test_a_worker_crashing_on_the_same_turn_ends_in_crash_loop_then_retry_revives_it(
    shared: Daemon,
) -> None:
    looping = shared.submit(
        [
            reply(tool_use("write_file", path="before.txt", content="x")),
            reply(text("Now the crash."), tool_use("crash", unless="fixed")),
            reply(text("Survived.")),
        ],
        name="crash-loop",
    )
    healthy = shared.submit(steps(4, delay=0.1), name="healthy-neighbour")
    row = shared.wait_state(looping, "failed", "done", timeout=20)
    assert row["state"] == "failed", row
    assert row["reason"] == "crash_loop"
    assert row["turn"] == 2
    assert row["last_exit"] == {"code": None, "signal": "SIGKILL"}
    assert row["restarts"] == CRASH_LOOP_LIMIT - 1
    failed = poll_for(lambda: shared.events(looping, "task_failed"), 30, what="task_failed")
    assert failed[-1]["reason"] == "crash_loop"
    (loop_event,) = shared.events(looping, "crash_loop")
    assert loop_event["turn"] == 2 and loop_event["level"] == "error"
    record = TaskRecord.load(shared.task(looping))
    assert [c["turn"] for c in record.crashes] == [2] * CRASH_LOOP_LIMIT
    # the first crash followed progress (turns recorded): restarted at once; the next ones
    # only re-recorded the crash call's intent, which is no progress: backoff
    # (regression: any journal growth counted as progress, so a crash loop never backed off)
    assert [c["progressed"] for c in record.crashes] == [True] + [False] * (CRASH_LOOP_LIMIT - 1)
    delays = [e["delay"] for e in shared.events(looping, "restart_scheduled")]
    assert delays[0] == 0.0
    # backoff_initial 0.1 s with jitter down to 0.8x; the event rounds delays to the ms
    assert all(0.08 - 0.001 <= d <= 0.4 for d in delays[1:]), delays
    # the daemon kept serving the other task meanwhile
    shared.wait_state(healthy, "done")
    assert_completed(shared, healthy, 4)

    # retry: the operator fixes the cause, and the task gets a fresh restart budget
    workspace = Path(row["workspace"])
    (workspace / "fixed").write_text("")
    code, out, err = shared.cli("retry", looping)
    assert (code, err) == (0, "")
    assert out.strip() == f"{looping}: queued for retry"
    poll_for(lambda: shared.events(looping, "task_retried"), 30, what="the daemon to retry")
    row = shared.wait_state(looping, "done", "failed", timeout=60)
    assert row["state"] == "done", row
    assert TaskRecord.load(shared.task(looping)).crashes == []
    assert turns_of(shared, looping) == [1, 2, 3]
    # the dangling crash call was re-run (idempotent), this time to a result
    calls = load_state(shared.task(looping)).calls
    crash_call = next(c for c in calls.values() if c.tool == "crash")
    assert crash_call.result is not None and "not crashing" in crash_call.result["content"]
    assert crash_call.attempt == CRASH_LOOP_LIMIT + 1
    # a task that is not failed cannot be retried
    code, out, err = shared.cli("retry", looping)
    assert code == 3 and out == "" and err.count("\n") == 1 and "only a failed task" in err


# -- cancel, second start, garbage ---------------------------------------------------------


def test_cancel_of_a_running_task_ends_it_and_its_process_group(shared: Daemon) -> None:
    task_id = shared.submit(
        [reply(tool_use("run_command", command="sleep 30", timeout=60)), reply(text("Never."))],
        name="to-cancel",
    )
    row = shared.wait_row(task_id, lambda r: r["phase"] == "tool:run_command")
    pid = row["pid"]
    poll_for(lambda: any(p.name() == "sleep" for p in psutil.Process(pid).children(True)))
    code, out, err = shared.cli("cancel", task_id)
    assert (code, err) == (0, "")
    assert out.strip() == f"{task_id}: cancelled"  # it waits for the daemon to apply it
    row = shared.wait_state(task_id, "cancelled", "done", "failed", timeout=60)
    assert row["state"] == "cancelled", row
    assert row["reason"] == "cancelled by operator"
    assert row["pid"] is None
    poll_for(lambda: not group_alive(pid), 30, what="the worker's process group to be gone")
    poll_for(lambda: shared.events(task_id, "task_cancelled"), 30, what="task_cancelled")
    assert row["restarts"] == 0  # a cancel is not a crash: never restarted
    time.sleep(0.3)  # (a restart would show by now)
    assert shared.row(task_id)["state"] == "cancelled"
    assert len(shared.events(task_id, "worker_spawned")) == 1
    assert len(shared.events(task_id, "task_cancelled")) == 1
    code, out, err = shared.cli("cancel", task_id)
    assert code == 3 and err.count("\n") == 1 and "already cancelled" in err


def test_what_a_killed_worker_left_outside_its_group_dies_and_nothing_else(
    make_daemon: Callable[..., Daemon],
) -> None:
    # Run bare: what the daemon's sweep must catch is what no sandbox's PID namespace took
    # with it (and the pids the tree writes are the host's).
    shared = make_daemon(sandbox="off")
    shared.start()
    # A tree out of the worker's group that ignores SIGTERM: a setsid shell with two
    # children. Its shell comes to the daemon when the worker dies, and its children when
    # the daemon kills the shell: each sweep is followed by another one.
    tree = (
        "setsid sh -c 'trap \"\" TERM; sleep 300 & sleep 300 & echo $$ > tree.pid; wait' "
        ">/dev/null 2>&1 </dev/null &\nsleep 60"
    )
    task_id = shared.submit(
        [reply(tool_use("run_command", command=tree, timeout=120)), reply(text("Never."))],
        name="strays",
    )
    bystander = shared.submit(
        [reply(tool_use("run_command", command="sleep 60", timeout=120)), reply(text("Hm."))],
        name="bystander",
    )
    other = shared.wait_row(bystander, lambda r: r["phase"] == "tool:run_command")["pid"]
    pid = shared.wait_row(task_id, lambda r: r["phase"] == "tool:run_command")["pid"]
    pid_file = shared.task(task_id).path / "workspace" / "tree.pid"
    poll_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30)
    shell = int(pid_file.read_text())
    poll_for(lambda: len(psutil.Process(shell).children()) == 2, 30)
    strays = [shell, *(c.pid for c in psutil.Process(shell).children())]
    assert os.getpgid(shell) != pid  # out of the worker's group: the group kill misses it
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    poll_for(lambda: not any(alive(p) for p in strays), 60, what="every stray to be dead")
    print(f"\nstrays dead {time.monotonic() - killed:.3f} s after the kill -9 of their worker")
    shared.wait_state(task_id, "held")  # the unsafe call the kill cut short
    assert alive(other) and shared.row(bystander)["pid"] == other  # the sweep spared it
    logged = {p for e in shared.log_events() if e["event"] == "strays_killed" for p in e["pids"]}
    assert set(strays) <= logged
    code, _, _ = shared.cli("cancel", bystander)
    assert code == 0


def test_a_second_daemon_on_the_same_spool_refuses_naming_the_running_pid(
    shared: Daemon,
) -> None:
    assert shared.proc is not None
    done = shared.run_cli("start")
    assert done.returncode not in (0, 2, 3, 78), done
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"pid {shared.proc.pid}" in done.stderr
    assert "Traceback" not in done.stderr
    assert shared.proc.poll() is None  # the running one is untouched
    assert running_pid(shared.spool) == shared.proc.pid


def write_task_folder(spool: Spool, task_id: str, files: dict[str, bytes]) -> TaskDir:
    """A task folder written by hand; spec.json last, as submit does."""
    task = spool.task(task_id)
    task.path.mkdir(mode=0o700, parents=True)
    for name in sorted(files, key=lambda n: n == "spec.json"):
        (task.path / name).write_bytes(files[name])
    ring(spool, task_id)
    return task


def spec_bytes(task_id: str) -> bytes:
    return json.dumps(
        {"v": 1, "id": task_id, "prompt": "Do it.", "scripted": True, "max_turns": 10}
    ).encode()


def test_garbage_task_folders_fail_with_a_reason_and_the_daemon_keeps_serving(
    shared: Daemon,
) -> None:
    from worker.store.journal import JOURNAL_VERSION, encode

    script = json.dumps({"responses": steps(2)}).encode()
    header = encode({"k": "header", "v": JOURNAL_VERSION, "task": "bad-journal"})
    turn = encode(
        {"k": "turn", "turn": 1, "message": {"role": "assistant", "content": []}},
        durable=len(header) + 12,  # written once the 12 bytes before it were synced
    )
    damaged = header + b"\xff" * 12 + turn  # damage to synced bytes: corruption
    write_task_folder(shared.spool, "bad-spec", {"spec.json": b"{not json", "script.json": script})
    write_task_folder(
        shared.spool,
        "bad-journal",
        {"spec.json": spec_bytes("bad-journal"), "script.json": script, "journal": damaged},
    )
    write_task_folder(
        shared.spool,
        "bad-record-shape",  # whole frames, but a record that is not a turn record
        {
            "spec.json": spec_bytes("bad-record-shape"),
            "script.json": script,
            "journal": header + encode({"k": "turn", "turn": "one"}),
        },
    )
    write_task_folder(
        shared.spool,
        "bad-script",
        {"spec.json": spec_bytes("bad-script"), "script.json": b'{"responses": 7}'},
    )
    write_task_folder(
        shared.spool,
        "bad-record",
        {"spec.json": spec_bytes("bad-record"), "script.json": script, "state.json": b"\0\0"},
    )
    write_task_folder(
        shared.spool,
        "bad-spec-id",
        {"spec.json": spec_bytes("someone-else"), "script.json": script},
    )
    for task_id, words in [
        ("bad-spec", "spec"),
        ("bad-journal", "damaged"),
        ("bad-record-shape", "journal"),
        ("bad-script", "responses"),
        ("bad-record", "state.json"),
        ("bad-spec-id", "someone-else"),
    ]:
        row = shared.wait_state(task_id, "failed", "done", timeout=60)
        assert row["state"] == "failed", row
        assert words in row["reason"], row
        assert "\n" not in row["reason"]
    # nothing recorded was changed: the damaged journal is as it was
    assert shared.task("bad-journal").journal.read_bytes() == damaged
    assert shared.proc is not None and shared.proc.poll() is None
    task_id = shared.submit(steps(2), name="after-garbage")
    assert shared.wait_state(task_id, "done", "failed")["state"] == "done"
    code, out, _ = shared.cli("status", "--json")
    assert code == 0
    states = {t["id"]: t["state"] for t in json.loads(out)["tasks"]}
    assert states["bad-spec"] == "failed" and states["after-garbage"] == "done"


# -- held tasks and operator decisions ------------------------------------------------------

#: An unsafe call with a side effect (the file ``charged``) that is killed mid-way the
#: first time and quick when an operator has it re-run.
CHARGE = "if [ -e charged ]; then echo second run; else touch charged; exec sleep 30; fi"
DECISION_FORMS = ("rerun", "skip", "result", "result-file", "all")


def charge_script() -> list[dict[str, Any]]:
    return [
        reply(text("Charging."), tool_use("run_command", command=CHARGE, timeout=60)),
        reply(text("Charged.")),
    ]


class Held:
    """A daemon with tasks held on a dangling unsafe call, one per use."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.calls: dict[str, str] = {}  # task id -> held call id
        self.killed: dict[str, int] = {}  # task id -> the worker pid that was killed

    def hold(self, names: list[str]) -> None:
        daemon = self.daemon
        for name in names:
            daemon.submit(charge_script(), name=name)
        for name in names:
            charged = daemon.task(name).path / "workspace" / "charged"

            def charging(row: dict[str, Any], charged: Path = charged) -> bool:
                return row["phase"] == "tool:run_command" and charged.exists()

            row = daemon.wait_row(name, charging, what="the charge to be under way")
            os.kill(row["pid"], signal.SIGKILL)  # the worker only: the daemon kills the rest
            self.killed[name] = row["pid"]
        for name in names:
            row = daemon.wait_state(name, "held", "done", "failed")
            assert row["state"] == "held", row
            (held,) = row["dangling"]
            self.calls[name] = held["call_id"]


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    daemon = Daemon(tmp_path_factory.mktemp("held"), config_text(max_workers=16))
    try:
        daemon.start()
        held = Held(daemon)
        held.hold(
            [f"up-{f}" for f in DECISION_FORMS]
            + [f"down-{f}" for f in DECISION_FORMS]
            + ["contested"]
        )
        yield held
    finally:
        daemon.cleanup()


def test_an_unsafe_dangling_call_holds_the_task_and_is_listed(held: Held) -> None:
    daemon = held.daemon
    name = "up-rerun"
    # the killed worker's whole group went with it: the sleep of its command too
    assert not group_alive(held.killed[name])
    assert not [p for p in spool_processes(daemon.spool.root) if p.name() == "sleep"]
    row = daemon.row(name)
    assert row["pid"] is None and row["phase"] is None
    assert row["reason"].startswith(f"dangling run_command call {held.calls[name]}")
    assert row["restarts"] == 1
    assert (daemon.task(name).path / "workspace" / "charged").exists()
    held_events = daemon.events(name, "dangling_held")
    assert len(held_events) == 1 and held_events[0]["call_id"] == held.calls[name]

    code, out, err = daemon.cli("dangling", "--json")
    assert (code, err) == (0, "")
    rows = json.loads(out)
    assert {r["task"] for r in rows} == set(held.calls)
    for r in rows:
        assert set(r) >= DANGLING_FIELDS, r
        assert r["tool"] == "run_command" and r["effect"] == "unsafe"
        assert r["input"] == {"command": CHARGE, "timeout": 60}
        assert r["idempotency_key"].startswith("agentd-")
        assert r["call_id"] == held.calls[r["task"]]
        assert r["started_at"].endswith("Z")
    assert len({r["idempotency_key"] for r in rows}) == len(rows)
    code, out, _ = daemon.cli("dangling", name, "--json")
    assert [r["task"] for r in json.loads(out)] == [name]
    code, out, _ = daemon.cli("dangling", name)
    assert held.calls[name] in out and f"approve-dangling {name}" in out
    code, out, _ = daemon.cli("status")
    assert "1 held call(s)" in out


def decide_args(held: Held, name: str, form: str) -> list[str]:
    call = held.calls[name]
    if form == "rerun":
        return ["approve-dangling", name, call, "--rerun"]
    if form == "skip":
        return ["approve-dangling", name, call, "--skip", "--reason", "refunded by hand"]
    if form == "result":
        return ["approve-dangling", name, call, "--result", "charged once (verified)"]
    if form == "result-file":
        path = held.daemon.root / f"{name}.result"
        path.write_text("receipt 42: charged once\n")
        return ["approve-dangling", name, call, "--result-file", str(path)]
    assert form == "all"
    return ["approve-dangling", name, "--all", "--rerun"]


def check_decided(held: Held, name: str, form: str) -> None:
    daemon = held.daemon
    row = daemon.wait_state(name, "done", "failed", "held", timeout=60)
    assert row["state"] == "done", row
    assert_completed(daemon, name, 2)
    call = load_state(daemon.task(name)).calls[held.calls[name]]
    assert call.result is not None
    result = call.result
    if form in ("rerun", "all"):
        assert result["outcome"] == "rerun" and not result["is_error"]
        assert "second run" in result["content"]
        assert call.attempt == 2
    elif form == "skip":
        assert result["outcome"] == "skipped" and result["is_error"]
        assert "refunded by hand" in result["content"]
    elif form == "result":
        assert result["outcome"] == "operator" and not result["is_error"]
        assert result["content"] == "charged once (verified)"
    else:
        assert result["outcome"] == "operator"
        assert result["content"] == "receipt 42: charged once\n"
    decisions = of_kind(journal_records(daemon.task(name)), "decision")
    assert len(decisions) == 1 and decisions[0]["call_id"] == held.calls[name]
    assert daemon.cli("dangling", name, "--json")[1].strip() == "[]"


def test_each_decision_form_resumes_the_task_at_once_with_the_daemon_up(held: Held) -> None:
    daemon = held.daemon
    latencies = {}
    for form in DECISION_FORMS:
        name = f"up-{form}"
        task = daemon.task(name)
        decided = time.monotonic()
        code, out, err = daemon.cli(*decide_args(held, name, form))
        assert (code, err) == (0, ""), (form, err)
        action = {"all": "rerun", "result-file": "result"}.get(form, form)
        assert out.strip() == f"{name} {held.calls[name]} attempt 1: {action}"

        def resumed(task: TaskDir = task, call_id: str = held.calls[name]) -> bool:
            call = load_state(task).calls[call_id]
            return call.result is not None

        poll_for(resumed, 5, interval=0.005, what=f"{name} to resume")
        latencies[form] = time.monotonic() - decided
    print(
        "\ndecision-to-resume latency, daemon up (decision durable -> call settled in the "
        "journal): " + ", ".join(f"{f} {t * 1000:.0f} ms" for f, t in latencies.items())
    )
    assert max(latencies.values()) < 1.5
    for form in DECISION_FORMS:
        check_decided(held, f"up-{form}", form)


def test_two_concurrent_approvals_of_one_call_exactly_one_wins(held: Held) -> None:
    daemon = held.daemon
    name, call = "contested", held.calls["contested"]
    procs = [
        subprocess.Popen(
            daemon.command("approve-dangling", name, call, "--result", f"operator {i}"),
            cwd=REPO,
            env=worker_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outcomes = sorted((p.wait(timeout=30), *p.communicate()) for p in procs)
    (ok, ok_out, ok_err), (lost, lost_out, lost_err) = outcomes
    assert (ok, ok_err) == (0, ""), outcomes
    assert lost == 3, outcomes
    assert lost_out == ""
    assert lost_err.count("\n") == 1 and "Traceback" not in lost_err
    assert "already decided" in lost_err or "no held call" in lost_err
    assert ok_out.strip() == f"{name} {call} attempt 1: result"
    row = daemon.wait_state(name, "done", "failed", "held")
    assert row["state"] == "done", row
    (decision_file,) = daemon.task(name).decisions.iterdir()
    winner = json.loads(decision_file.read_text())["result"]
    result = load_state(daemon.task(name)).calls[call].result
    assert result is not None and result["content"] == winner  # the winner's, whole


def test_each_decision_form_is_recorded_with_the_daemon_down_and_applied_at_start(
    held: Held,
) -> None:
    daemon = held.daemon
    code, out, err = daemon.stop()
    assert (code, err) == (0, "")
    assert daemon.proc is not None and daemon.proc.returncode == 0
    assert running_pid(daemon.spool) is None
    for form in DECISION_FORMS:
        name = f"down-{form}"
        before = daemon.task(name).journal.read_bytes()
        code, out, err = daemon.cli(*decide_args(held, name, form))
        assert (code, err) == (0, ""), (form, err)
        # durable at once: the decision file; the task waits as queued for the daemon
        task = daemon.task(name)
        (decision_file,) = task.decisions.iterdir()
        assert json.loads(decision_file.read_text())["call_id"] == held.calls[name]
        assert daemon.row(name)["state"] == "queued"
        assert task.journal.read_bytes() == before  # the worker applies it, not the CLI
    code, out, _ = daemon.cli("status")
    assert "not running" in out
    started = time.monotonic()
    daemon.start()
    for form in DECISION_FORMS:
        check_decided(held, f"down-{form}", form)
    print(f"\ndaemon down: 5 decided tasks done {time.monotonic() - started:.2f} s after start")


# -- the daemon itself dies, stops, limits -------------------------------------------------


def test_kill_9_of_the_daemon_under_load_loses_nothing_and_never_doubles_a_worker(
    make_daemon: Callable[..., Daemon],
) -> None:
    # (20 fresh workers on a loaded machine may take more than the module's 2 s to beat first)
    daemon = make_daemon(max_workers=20, timeout=15.0)
    daemon.start()
    # short tasks end while no daemon runs; long ones are still running when it is back
    lengths = {f"load-{i:02d}": 6 if i % 2 else 20 for i in range(20)}
    n = len(lengths)
    with WorkerCensus(daemon.spool) as census:
        ids = [daemon.submit(steps(k, delay=0.15), name=t) for t, k in lengths.items()]
        poll_for(
            lambda: all(daemon.row(t)["turn"] >= 2 for t in ids),
            30,
            what="every task past turn 2",
        )
        daemon.kill()
        killed_at = time.monotonic()
        orphans = [t for t in ids if daemon.row(t)["state"] == "running"]
        daemon.start()
        restarted = time.monotonic() - killed_at
        for task_id in ids:
            daemon.wait_state(task_id, "done", "failed", timeout=30)
    adopted = [t for t in ids if daemon.events(t, "worker_adopted")]
    print(
        f"\ndaemon kill -9 with {len(orphans)} of {n} tasks running; restarted after "
        f"{restarted:.2f} s; {len(adopted)} workers adopted; census: {census.samples} samples, "
        f"{len(census.seen)} workers, at most {census.max_live} at once"
    )
    assert orphans and adopted
    assert census.overlaps == []
    for task_id, spans in census.lifetimes().items():
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end < start, f"{task_id}: worker lifetimes overlap: {spans}"
    # every worker was started by a daemon, or adopted by the next one (a worker started
    # by a daemon killed before it could record it)
    adopted_pids = {e["pid"] for t in ids for e in daemon.events(t, "worker_adopted")}
    assert set(census.seen) <= worker_pids(daemon.spool) | adopted_pids
    for task_id in ids:
        assert_completed(daemon, task_id, lengths[task_id])
        assert daemon.row(task_id)["restarts"] == 0  # adoption is not a restart
        # no worker ever found the task lock taken (which would mean a second worker)
        assert all(e["code"] != 6 for e in daemon.events(task_id, "worker_exited"))
        assert TaskRecord.load(daemon.task(task_id)).crashes == []


def test_a_worker_the_records_do_not_name_is_adopted_not_doubled(
    make_daemon: Callable[..., Daemon],
) -> None:
    # What a daemon killed between starting a worker and recording it leaves behind: a
    # queued task whose worker runs. Regression: the next daemon started a second worker.
    daemon = make_daemon()
    turns = 16  # 4 s at least: the stray must outlast a daemon start under load
    task_id = daemon.submit(steps(turns, delay=0.25), name="stray")
    stray = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker",
            str(daemon.task(task_id).path),
            "--config",
            str(daemon.config_path),
        ],
        cwd=REPO,
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    daemon.procs.append(stray)  # killed with the daemons, whatever happens
    try:
        assert daemon.row(task_id)["state"] == "queued"
        store = store_of(daemon.task(task_id))
        poll_for(
            lambda: store.owned(task_id) and store.owner_pid(task_id) == stray.pid,
            what="the stray's lock",
        )
        with WorkerCensus(daemon.spool) as census:
            daemon.start()
            row = daemon.wait_state(task_id, "done", "failed", timeout=20)
        assert row["state"] == "done", row
        (adopted,) = daemon.events(task_id, "worker_adopted")
        assert adopted["pid"] == stray.pid
        assert daemon.events(task_id, "worker_spawned") == []
        assert census.overlaps == [] and set(census.seen) == {stray.pid}
        assert row["restarts"] == 0 and row["last_exit"] == {"code": 0, "signal": None}
        assert_completed(daemon, task_id, turns)
    finally:
        stray.wait(timeout=10)


def test_stop_is_graceful_and_running_tasks_resume_on_the_next_start(
    make_daemon: Callable[..., Daemon],
) -> None:
    daemon = make_daemon()
    proc = daemon.start()
    turns = 30  # 3 s at least: the stop (a CLI process start) must land mid-task under load
    ids = [daemon.submit(steps(turns, delay=0.1), name=f"long-{i}") for i in range(3)]
    for task_id in ids:
        daemon.wait_row(task_id, lambda r: r["state"] == "running" and r["turn"] >= 2)
    pids = {t: daemon.row(t)["pid"] for t in ids}
    stop = daemon.run_cli("stop")
    assert stop.returncode == 0, stop
    *waited, last = stop.stdout.strip().splitlines()
    assert last == f"agentd stopped (pid {proc.pid})"
    # (a stop that lands in a tool call says first what it waits for: a slow fsync, say)
    assert all("is stopping: waiting up to" in line for line in waited), waited
    assert proc.wait(timeout=10) == 0
    for task_id in ids:
        row = daemon.row(task_id)
        assert row["state"] == "queued", row
        assert 2 <= row["turn"] < turns
        exits = [e for e in daemon.events(task_id, "worker_exited") if e["pid"] == pids[task_id]]
        assert exits and exits[0]["code"] == 5  # stopped at a safe point
        assert not group_alive(pids[task_id])
    assert not spool_processes(daemon.spool.root)
    names = [e["event"] for e in daemon.log_events()]
    assert names.index("supervisor_stopping") < names.index("supervisor_stopped")
    assert "Traceback" not in daemon.log()
    assert "not running" in daemon.cli("status")[1]
    daemon.start()
    for task_id in ids:
        row = daemon.wait_state(task_id, "done", "failed", timeout=20)
        assert row["state"] == "done", row
        assert row["restarts"] == 0  # a stop is not a crash
        assert_completed(daemon, task_id, turns)
        assert daemon.events(task_id, "task_resumed")


def test_stop_says_which_tool_call_it_waits_for_and_what_becomes_of_the_one_it_cut_off(
    make_daemon: Callable[..., Daemon],
) -> None:
    daemon = make_daemon(stop_grace=1.0, sandbox="off")
    proc = daemon.start()
    script = [
        reply(tool_use("run_command", "call-sleep", command="sleep 60")),
        reply(text("Never reached.")),
    ]
    task_id = daemon.submit(script, name="sleeper")
    daemon.wait_row(task_id, lambda r: r["phase"] == "tool:run_command")
    stop = daemon.run_cli("stop")
    assert stop.returncode == 0, stop
    assert proc.wait(timeout=10) == 0
    lines = stop.stdout.strip().splitlines()
    assert lines[0] == (
        f"agentd (pid {proc.pid}) is stopping: waiting up to 1 s for 1 tool call(s) to "
        f"finish, then cutting them off: {task_id} (run_command)"
    ), lines
    assert lines[1] == (
        f"cut off: {task_id} call call-sleep (run_command): "
        f"held for a decision at the next start (`agentd dangling {task_id}`)"
    ), lines
    assert lines[2] == f"agentd stopped (pid {proc.pid})"
    daemon.start()
    row = daemon.wait_state(task_id, "held")
    assert [c["call_id"] for c in row["dangling"]] == ["call-sleep"], row


def test_a_task_done_without_its_exit_record_says_why(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(sandbox="off")
    daemon.start()
    # the tool turns the exit record's path into a folder: the worker cannot write it, as
    # on a full disk, and still exits 0 (best effort), its journal saying how it ended
    block = tool_use("run_command", command="mkdir -p ../exit.json/in-the-way")
    task_id = daemon.submit([reply(block), reply(text("Finished."))], name="no-exit")
    row = daemon.wait_state(task_id, "done", "failed")
    assert row["state"] == "done", row
    assert (
        row["reason"] == "end_turn; the worker left no exit record (could it write to its spool?)"
    )


def test_max_workers_queues_the_rest(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(max_workers=2)
    daemon.start()
    ids = [daemon.submit(steps(3, delay=0.15), name=f"q-{i}") for i in range(5)]
    most_running = 0
    with WorkerCensus(daemon.spool) as census:

        def all_done() -> bool:
            nonlocal most_running
            rows = [daemon.row(t) for t in ids]
            # rows are read one after another, not at one instant: count the running
            # ones whose worker is still alive after the sweep (alive together, now)
            running = [r for r in rows if r["state"] == "running" and alive(r["pid"])]
            most_running = max(most_running, len(running))
            return all(r["state"] == "done" for r in rows)

        poll_for(all_done, 30, what="all five tasks done")
    # the daemon's own ordered log: +1 per worker_spawned, -1 per worker_exited
    live = peak = 0
    for event in daemon.log_events():
        live += {"worker_spawned": 1, "worker_exited": -1}.get(event["event"], 0)
        peak = max(peak, live)
    print(
        f"\nmax_workers=2: at most {most_running} running in status, {peak} by the daemon's "
        f"log, {census.max_live} worker processes alive"
    )
    assert most_running == 2 and peak == 2
    assert census.max_live <= 2
    for task_id in ids:
        assert_completed(daemon, task_id, 3)


def test_sd_notify_ready_status_watchdog_and_stopping(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    with tempfile.TemporaryDirectory(prefix="agentd-") as folder:
        address = str(Path(folder) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            sock.settimeout(5.0)
            proc = daemon.start({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "300000"})
            messages: list[str] = []

            def receive_until(predicate: Callable[[str], bool]) -> str:
                while True:
                    message = sock.recv(4096).decode()
                    messages.append(message)
                    if predicate(message):
                        return message

            receive_until(lambda m: m == "READY=1")
            task_id = daemon.submit([reply(text("Hi."), delay=0.6)], name="notified")
            row = daemon.wait_running(task_id)
            # workers do not inherit the notification socket: only the daemon speaks
            env = psutil.Process(row["pid"]).environ()
            assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
            receive_until(lambda m: m == "STATUS=1 running")
            receive_until(lambda m: m == "STATUS=1 done")
            dogs = sum(m == "WATCHDOG=1" for m in messages)
            code, _, _ = daemon.cli("stop")
            assert code == 0 and proc.wait(timeout=10) == 0
            receive_until(lambda m: m == "STOPPING=1")
    print(f"\nsd_notify: {dogs} watchdog pings while the task ran; messages {messages[:4]}...")
    assert messages.index("READY=1") < messages.index("STOPPING=1")
    assert dogs >= 2
    assert all("\n" not in m for m in messages)
