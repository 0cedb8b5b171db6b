"""The loop on every backend: it never knows which store it has. A task runs, is held on
an unsafe dangling call, takes an operator's decision through the store and resumes from
its snapshot to the same end."""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support import reply, text, tool_use
from worker.config import Config
from worker.loop import AgentLoop, Outcome
from worker.models.scripted import ScriptedModel
from worker.protocol import ExitCode
from worker.spool import TaskSpec
from worker.state import fold
from worker.store.base import JSON, Owner, Snapshot, TaskStore
from worker.store.memory import MemoryStore
from worker.tools.registry import ToolRegistry

SCRIPT = [
    reply(text("Writing."), tool_use("write_file", path="a.txt", content="hi")),
    reply(text("Appending."), tool_use("append_file", path="a.txt", content="!")),
    reply(text("Done.")),
]


def make_loop(store: TaskStore, workspace: Path) -> AgentLoop:
    spec = store.load_spec("t1")
    return AgentLoop(
        store,
        spec,
        Config(),
        ScriptedModel(SCRIPT),
        ToolRegistry.standard(),
        workspace=workspace,
        snapshot_every=1,
    )


def test_a_task_runs_holds_and_resumes_on_every_store(store: TaskStore, tmp_path: Path) -> None:
    store.create(TaskSpec(id="t1", prompt="Write a file."), {"state": "queued"})
    workspace = tmp_path / "workspace"
    workspace.mkdir()

    loop = make_loop(store, workspace)
    loop.open()
    writer = loop.recorder.writer
    real_append = writer.append

    def crash_after_the_intent(records: Iterable[JSON], *, sync: bool = True) -> None:
        records = list(records)
        real_append(records, sync=sync)
        if any(r.get("tool") == "append_file" for r in records):
            raise KeyboardInterrupt  # the worker dies while the unsafe call runs

    writer.append = crash_after_the_intent  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    loop.close()
    assert store.get_snapshot("t1") is not None  # taken at the boundary after turn 1

    held = make_loop(store, workspace)
    outcome = held.run()
    held.close()
    assert (outcome.state, outcome.exit_code) == ("held", ExitCode.HELD)
    (call,) = fold("Write a file.", store.replay("t1")).dangling()
    assert call.tool == "append_file" and call.key is not None
    assert store.record_decision("t1", call.key, call.attempt, {"action": "skip"})

    resumed = make_loop(store, workspace)
    assert resumed.run() == Outcome("done", "end_turn", ExitCode.DONE)
    resumed.close()
    assert (workspace / "a.txt").read_text() == "hi"  # the skipped call never ran
    kinds = [r["k"] for r in store.replay("t1")]
    assert kinds.count("hold") == 1 and kinds.count("decision") == 1 and kinds[-1] == "end"
    events = [e["event"] for e in store.read_events("t1")[0]]
    assert "dangling_held" in events and "dangling_decided" in events


def test_a_worker_whose_ownership_moved_stops_with_lease_lost_and_records_nothing(
    store: TaskStore, tmp_path: Path
) -> None:
    store.create(TaskSpec(id="t1", prompt="Write a file."), {"state": "queued"})
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    loop = make_loop(store, workspace)
    loop.open()
    before = store.replay("t1")
    assert loop.owner is not None
    store.release(loop.owner)  # its lease ended while it was away: another node took it
    taken = store.acquire("t1")
    try:
        outcome = loop.run()
        assert (outcome.state, outcome.exit_code, outcome.fenced) == (
            "stopped",
            ExitCode.STOPPED,
            True,
        )
        assert outcome.reason.startswith("lease_lost: ")
        assert store.replay("t1") == before, "a fenced worker recorded a step"
        assert not (workspace / "a.txt").exists(), "a fenced worker ran a tool"
    finally:
        loop.close()
        store.release(taken)


def test_a_failed_snapshot_stops_the_worker_at_the_next_boundary(tmp_path: Path) -> None:
    class FullDisk(MemoryStore):
        def put_snapshot(self, owner: Owner, snapshot: Snapshot) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    store = FullDisk()
    store.create(TaskSpec(id="t1", prompt="Write files."), {"state": "queued"})
    script = [reply(tool_use("write_file", path=f"f{i}.txt", content="x")) for i in range(8)]
    loop = AgentLoop(
        store,
        store.load_spec("t1"),
        Config(),
        ScriptedModel([*script, reply(text("Done."))]),
        ToolRegistry.standard(),
        workspace=tmp_path,
        snapshot_every=3,
    )
    try:
        outcome = loop.run()
    finally:
        loop.close()
    assert outcome.exit_code == ExitCode.STORAGE  # a wait, never a crash
    # the snapshot of turn 3 failed on its thread: the boundary after turn 4 says so,
    # not the next snapshot's, three turns later
    assert loop.state.turn == 4
