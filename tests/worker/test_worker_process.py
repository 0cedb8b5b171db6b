"""``python -m worker`` as a real process: exit codes, the task lock, SIGTERM, kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    REPO,
    assert_paired,
    finish,
    journal_records,
    kill_group,
    of_kind,
    poll_for,
    reap,
    reply,
    run_worker,
    scripted_task,
    start_worker,
    text,
    tool_use,
)
from worker.lock import is_locked
from worker.protocol import ExitCode, HeartbeatData, heartbeat_shaped
from worker.spool import Spool, TaskDir
from worker.state import fold
from worker.store.durable import atomic_write_json, read_json
from worker.store.journal import read_file

DONE = reply(text("Done."))


def exit_record(task: TaskDir) -> dict[str, Any]:
    data: dict[str, Any] = read_json(task.exit)
    return data


def in_model_call(task: TaskDir, turns: int) -> bool:
    """The worker waits on model call ``turns + 1`` (its earlier turns all recorded)."""
    try:
        beat = read_json(task.heartbeat)
        records = journal_records(task)
    except (OSError, ValueError):
        return False
    settled = records and records[-1]["k"] in ("header", "result", "user")
    return bool(beat.get("phase") == "model" and len(of_kind(records, "turn")) == turns and settled)


def test_success(spool: Spool) -> None:
    task = scripted_task(
        spool, [reply(tool_use("write_file", path="out.txt", content="hello")), DONE], name="ok"
    )
    proc = start_worker(task)
    code, err = finish(proc)
    assert code == ExitCode.DONE, err
    assert exit_record(task) | {"pid": 0, "at": ""} == {
        "code": 0,
        "state": "done",
        "reason": "end_turn",
        "pid": 0,
        "at": "",
    }
    beat = read_json(task.heartbeat)  # its last, written as it ended
    assert heartbeat_shaped(beat) and beat["pid"] == proc.pid
    assert set(beat) <= set(HeartbeatData.__annotations__)  # every field it wrote is typed
    assert exit_record(task)["pid"] == proc.pid
    assert (task.path / "workspace" / "out.txt").read_text() == "hello"
    assert journal_records(task)[-1]["k"] == "end"
    assert err.strip().splitlines() == ["agentd worker: task ok done: end_turn"]
    assert not is_locked(task.lock)


def test_second_worker_exits_at_once_while_the_first_holds_the_lock(spool: Spool) -> None:
    task = scripted_task(spool, [reply(text("thinking"), delay=30), DONE], name="locked")
    first = start_worker(task)
    try:
        poll_for(lambda: in_model_call(task, 0), 10, what="the first worker's model call")
        journal = task.journal.read_bytes()
        started = time.monotonic()
        code, err = finish(start_worker(task), timeout=15)
        elapsed = time.monotonic() - started
        assert code == ExitCode.LOCKED
        assert elapsed < 5, f"the second worker took {elapsed:.1f} s to give up"
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert f"held by process {first.pid}" in lines[0]
        assert "another worker is running this task" in lines[0]
        assert first.poll() is None, "the first worker was disturbed"
        assert task.journal.read_bytes() == journal
        assert not task.exit.exists()
    finally:
        reap(first)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda spec: "{not json", "cannot read the task spec"),
        (lambda spec: json.dumps({**spec, "v": 99}), "spec version 99"),
        (lambda spec: json.dumps({**spec, "max_turns": 0}), "max_turns must be at least 1"),
        (lambda spec: json.dumps({**spec, "prompt": 5}), "field 'prompt' has the wrong type"),
        (lambda spec: json.dumps({**spec, "tools": ["teleport"]}), "unknown tool(s) teleport"),
    ],
    ids=["not_json", "version", "max_turns", "prompt_type", "unknown_tool"],
)
def test_bad_spec_fails_with_a_one_line_reason(spool: Spool, damage: Any, message: str) -> None:
    task = scripted_task(spool, [DONE], name="badspec")
    spec = json.loads(task.spec.read_text())
    task.spec.write_text(damage(spec))
    code, err = finish(start_worker(task))
    assert code == ExitCode.FAILED
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("agentd worker: ")
    assert message in lines[0]
    assert "Traceback" not in err
    assert exit_record(task)["state"] == "failed"
    assert message in exit_record(task)["reason"]
    assert not task.journal.exists(), "a task that cannot start recorded something"


def test_missing_script_fails_clearly(spool: Spool) -> None:
    task = scripted_task(spool, [DONE], name="noscript")
    task.script.unlink()
    code, err = finish(start_worker(task))
    assert code == ExitCode.FAILED
    assert "the task has no script" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_config_exits_78(spool: Spool, tmp_path: Path) -> None:
    task = scripted_task(spool, [DONE], name="badconfig")
    config = tmp_path / "agentd.toml"
    config.write_text("max_workers = 0\n")
    code, err = finish(start_worker(task, args=["--config", str(config)]))
    assert code == ExitCode.CONFIG
    assert "max_workers" in err
    assert len(err.strip().splitlines()) == 1
    assert exit_record(task)["code"] == ExitCode.CONFIG


def test_sigterm_during_a_model_call_stops_cleanly_and_resumes(spool: Spool) -> None:
    responses = [
        reply(text("first"), tool_use("write_file", path="a.txt", content="a")),
        reply(text("second"), tool_use("write_file", path="b.txt", content="b"), delay=30),
        DONE,
    ]
    task = scripted_task(spool, responses, name="term")
    proc = start_worker(task)
    try:
        poll_for(lambda: in_model_call(task, 1), 10, what="the second model call")
        before = journal_records(task)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code, err = finish(proc, timeout=10)
    finally:
        reap(proc)
    assert code == ExitCode.STOPPED, err
    assert time.monotonic() - started < 5, "SIGTERM waited for the model call"
    assert exit_record(task)["state"] == "stopped"
    scan = read_file(task.journal)
    assert not scan.torn, "a half-written record was left behind"
    assert [r for r, _ in scan.records] == before  # nothing recorded after the signal
    assert "stopped" in err
    # The next start picks the task up where it stopped (without the slow model call).
    script = json.loads(task.script.read_text())
    script["responses"][1].pop("delay")
    atomic_write_json(task.script, script)
    assert run_worker(task) == ExitCode.DONE
    after = journal_records(task)
    assert after[: len(before)] == before
    assert [r["turn"] for r in of_kind(after, "turn")] == [1, 2, 3]
    assert (task.path / "workspace" / "b.txt").read_text() == "b"


TURNS = 8


def _chaos_script() -> list[dict[str, Any]]:
    responses = [
        reply(
            text(f"step {i}"),
            tool_use("write_file", path=f"f{i}.txt", content=str(i)),
            tool_use("outbox_send", to="ops", body=f"step {i}"),
            delay=0.03,
        )
        for i in range(TURNS)
    ]
    return [*responses, DONE]


@pytest.mark.parametrize("kill_after", [1, 3, 6])
def test_kill_9_mid_run_then_resume_loses_no_turn(spool: Spool, kill_after: int) -> None:
    task = scripted_task(spool, _chaos_script(), name=f"kill-{kill_after}")
    proc = start_worker(task)
    try:
        poll_for(
            lambda: len(of_kind(journal_records(task), "turn")) >= kill_after,
            15,
            what=f"{kill_after} turns",
        )
        time.sleep(0.005 * kill_after)  # land somewhere inside the next step
        kill_group(proc)
        proc.wait(timeout=10)
    finally:
        reap(proc)
    assert proc.returncode == -signal.SIGKILL
    before = journal_records(task)  # what the dead worker left (a torn tail is ignored)
    turns_before = of_kind(before, "turn")
    assert len(turns_before) >= kill_after
    assert not of_kind(before, "end"), "the worker finished before it was killed"

    assert run_worker(task) == ExitCode.DONE
    after = journal_records(task)
    turns_after = of_kind(after, "turn")
    assert turns_after[: len(turns_before)] == turns_before, "a recorded turn was lost"
    assert [t["turn"] for t in turns_after] == list(range(1, TURNS + 2))
    results_before = of_kind(before, "result")
    assert all(r in after for r in results_before), "a recorded result was lost"
    state = fold(task.load_spec().prompt, after)
    assert_paired(state.messages)
    assert state.ended == {"state": "done", "reason": "end_turn"}
    # One delivery per keyed call (a temp file a killed write left behind is no delivery).
    outbox = task.path / "workspace" / "outbox"
    deliveries = sorted(p.name for p in outbox.glob("agentd-*.json"))
    keys = sorted({r["key"] for r in of_kind(after, "intent") if r["tool"] == "outbox_send"})
    assert deliveries == [f"{key}.json" for key in keys]
    assert len(keys) == TURNS
    for i in range(TURNS):
        assert (task.path / "workspace" / f"f{i}.txt").read_text() == str(i)
    usage = sum(t["usage"]["input_tokens"] for t in turns_after)
    assert state.usage_total.input_tokens == usage  # counted once per recorded turn


def test_the_sdk_is_imported_at_start_up_not_inside_the_first_model_call() -> None:
    # A cold SDK import takes seconds: inside the first call it would count against
    # deadlines.model_call and could get a fresh worker stopped as stalled.
    probe = (
        "import sys\n"
        "from worker.__main__ import make_model\n"
        "from worker.spool import TaskSpec\n"
        "assert 'anthropic' not in sys.modules\n"
        "make_model(None, None, TaskSpec(id='t', prompt='p'))\n"
        "print('anthropic' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
