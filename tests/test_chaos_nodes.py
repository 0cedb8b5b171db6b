"""Node chaos (class 21) in CI: the quick mode of ``tests/chaos/nodes.py``, and the
harness's own parts against real processes, the real store and made-up journals, so that
each of its figures is known to be able to fail."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from tests.chaos.nodeaudit import (
    Audit,
    Cancel,
    Fault,
    Row,
    audit,
    claims_of,
    effects_after,
    event_marks,
    events_named,
    journal_rows,
    leases_of,
    moved_since,
    stamped,
)
from tests.chaos.nodes import KILL, STOP, serving, task_script
from tests.chaos.trees import freeze_tree, kill_tree, thaw
from tests.daemon import Daemon, parse_time, subreaper
from tests.support import poll_for, reply, text, tool_use
from worker.spool import TaskSpec
from worker.store.postgres import PostgresStore

#: A process that starts a child in a session of its own (as the fork server starts a
#: worker), which starts a grandchild; each prints its pid.
TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    depth = int(sys.argv[1])
    print(os.getpid(), flush=True)
    if depth:
        subprocess.Popen([sys.executable, __file__, str(depth - 1)], start_new_session=True)
    time.sleep(600)
    """
)


@contextlib.contextmanager
def _tree(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """The three processes of TREE (this process their subreaper), killed afterwards."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    with (
        subreaper(),
        subprocess.Popen(
            [sys.executable, str(script), "2"], stdout=subprocess.PIPE, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        try:
            yield proc, [int(proc.stdout.readline()) for _ in range(3)]
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)


def test_kill_tree_kills_descendants_in_other_sessions(tmp_path: Path) -> None:
    with _tree(tmp_path) as (proc, pids):
        assert kill_tree(proc.pid) == 3
        proc.wait(timeout=10)
        assert not [p for p in pids if _alive(p)]


def test_a_frozen_tree_is_stopped_until_thawed(tmp_path: Path) -> None:
    with _tree(tmp_path) as (proc, pids):
        frozen = freeze_tree(proc.pid)
        assert sorted(p.pid for p in frozen) == sorted(pids)
        assert {psutil.Process(p).status() for p in pids} == {psutil.STATUS_STOPPED}
        thaw(frozen)
        poll_for(lambda: psutil.STATUS_STOPPED not in {psutil.Process(p).status() for p in pids})


def test_kill_tree_ends_a_daemon_its_fork_server_and_its_workers(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d", "[heartbeat]\ninterval = 0.2\n")
    steps = [reply(text("1"), tool_use("write_file", path="1", content="x"), delay=0.3)]
    with subreaper():
        try:
            proc = daemon.start(timeout=30)
            task = daemon.submit([*steps, reply(text("done"), delay=60)], name="long")
            row = daemon.wait_running(task)
            tree = {proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))}
            assert row["pid"] in tree, "the worker is not a descendant of the daemon"
            assert kill_tree(proc.pid) >= 3  # the daemon, its fork server, the worker
            proc.wait(timeout=10)
            assert not [p for p in tree if _alive(p)]
        finally:
            daemon.cleanup()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_serving_counts_a_daemon_that_runs_a_node_s_tasks_unlisted() -> None:
    """The figure "two live daemons under one name", on made-up inputs: the listed daemon
    serves; one whose descendant is the worker of a task running on that node does too."""
    listed: list[dict[str, Any]] = [
        {"name": "n1", "pid": 100, "alive": True},
        {"name": "n2", "pid": 300, "alive": True},
    ]
    rows: dict[str, dict[str, Any]] = {
        "t1": {"state": "running", "node": "n1", "pid": 1001},
        "t2": {"state": "running", "node": "n2", "pid": 2001},
        "t3": {"state": "done", "node": None, "pid": None},
    }
    family = {1001: {100, 1}, 2001: {200, 1}}

    def parents(pid: int) -> set[int]:
        return family.get(pid, set())

    assert serving("n1", listed, rows, {100, 200}, parents) == {100}
    assert serving("n2", listed, rows, {200, 300}, parents) == {200, 300}  # one unlisted
    gone = [{**listed[0], "alive": False}]
    assert serving("n1", gone, rows, {100, 200}, parents) == {100}  # (by its worker)
    assert serving("n1", gone, {}, {100, 200}, parents) == set()


# -- the audit, on made-up inputs -------------------------------------------------------------


def _row(seq: int, epoch: int, record: dict[str, object]) -> Row:
    return Row(seq, epoch, {"at": f"2026-01-01T00:00:{seq:02d}.000Z", **record})


def _journal(script: list[dict[str, object]], epochs: list[int]) -> list[Row]:
    """The rows a worker writes for ``script`` (turn, intent, result per tool call, end),
    the i-th row written under ``epochs[i]`` (the last epoch repeats)."""
    records: list[dict[str, object]] = [{"k": "header", "v": 1}]
    for turn, response in enumerate(script, 1):
        content = response["content"]
        assert isinstance(content, list)
        records.append({"k": "turn", "turn": turn, "message": {"content": content},
                        "stop_reason": "tool_use", "usage": {}})  # fmt: skip
        for block in content:
            if block["type"] == "tool_use":
                effect = {"chaos_charge": "unsafe", "chaos_send": "keyed"}.get(block["name"], "")
                intent = {"k": "intent", "call_id": block["id"], "tool": block["name"]}
                records.append({**intent, "input": block["input"], "effect": effect, "attempt": 1})
                records.append({"k": "result", "call_id": block["id"], "content": "ok"})
    records.append({"k": "end", "state": "done", "reason": "end_turn"})
    return [_row(i + 1, epochs[min(i, len(epochs) - 1)], r) for i, r in enumerate(records)]


def _effects(script: list[dict[str, object]]) -> list[dict[str, object]]:
    lines = []
    for response in script:
        content = response["content"]
        assert isinstance(content, list)
        for block in content:
            if block["type"] == "tool_use":
                lines.append({"kind": "effect", "call_id": block["id"],
                              "tag": block["input"]["tag"]})  # fmt: skip
    return lines


def _audit(rows: list[Row], effects: list[dict[str, object]], **extra: object) -> Audit:
    faults = extra.pop("faults", [])
    claimed = extra.pop("claimed", {})
    skewed = extra.pop("skewed", [])
    return audit(
        {"t000": 6},
        {"t000": {"id": "t000", "state": "done", "reason": "end_turn"}},
        {"t000": rows},
        claimed,  # type: ignore[arg-type]
        [],
        effects,
        faults,  # type: ignore[arg-type]
        skewed=skewed,  # type: ignore[arg-type]
    )


SCRIPT = task_script("t000", 6, 0.0, 0)


def test_a_clean_run_audits_clean_and_times_the_failover() -> None:
    rows = _journal(SCRIPT, [1] * 5 + [2])  # epoch 2 took over at row 6
    died = parse_time("2026-01-01T00:00:04.250Z")
    claimed = {"t000": [(2, "n2", died + 1.5)]}  # (before row 6: not a fenced record)
    found = _audit(
        rows, _effects(SCRIPT), faults=[Fault(KILL, "n1", died, {"t000": 1})], claimed=claimed
    )
    assert found.completed == 1
    for name in ("lost", "steps_lost", "doubled", "fenced_records", "runs_without_intent",
                 "unsafe_repeated", "keyed_repeated", "effects_missing", "unpaired"):  # fmt: skip
        assert getattr(found, name) == 0, (name, found.examples)
    [takeover] = found.failover[KILL]
    assert takeover.step == 1.75  # to row 6, the first of epoch 2, stamped 00:00:06
    assert takeover.claim == 1.5


def test_every_violation_is_counted() -> None:
    rows = _journal(SCRIPT, [1, 1, 2, 2, 1, 2])  # row 5 by epoch 1 after epoch 2 wrote
    rows.insert(3, _row(3, 2, rows[1].record))  # turn 1 recorded twice
    effects = _effects(SCRIPT)
    charge = next(e for e in effects if str(e["tag"]).endswith(".4"))  # (offset 0: 4 charges)
    send = next(e for e in effects if str(e["tag"]).endswith(".2"))
    effects += [charge, send, {"kind": "exec", "call_id": "toolu_t000_99", "tag": "x"}]
    found = _audit(rows, effects)
    assert found.doubled == 1
    assert found.fenced_records == 1
    assert found.unsafe_repeated == 1
    assert found.keyed_repeated == 1
    assert found.runs_without_intent == 3  # both repeats had no intent of their own either
    assert found.completed == 0  # a turn recorded twice is not a completed script


def test_a_row_stamped_after_a_later_claim_is_a_fenced_record() -> None:
    rows = _journal(SCRIPT, [1])
    claim_at = 1767225603.5  # between rows 3 and 4, all of epoch 1
    found = _audit(rows, _effects(SCRIPT), claimed={"t000": [(2, "n2", claim_at)]})
    assert found.fenced_records == len(rows) - 3


def test_a_task_not_ended_is_lost_and_its_missing_effects_are_not_counted() -> None:
    rows = _journal(SCRIPT[:2], [1])[:-1]  # two turns, no end
    found = audit(
        {"t000": 6},
        {"t000": {"id": "t000", "state": "running", "reason": None}},
        {"t000": rows},
        {},
        [],
        _effects(SCRIPT[:2]),
        [Fault(STOP, "n1", 0.0, {"t000": 1})],
    )
    assert (found.lost, found.completed, found.effects_missing) == (1, 0, 0)
    assert STOP not in found.failover  # never taken over


def _hold(seq: int, epoch: int, call_id: str, why: str) -> Row:
    return _row(seq, epoch, {"k": "hold", "calls": [{"call_id": call_id, "why": why}]})


def test_a_hold_of_a_call_that_had_run_counts_unless_its_task_was_taken_over() -> None:
    """ "Tasks held for a call that ran once": a hold after the call's effect was logged,
    on a task no node took over (its hold names no node); one whose call had not run yet,
    or whose hold names the node it was taken from, is the rule (invariant 2)."""
    rows = _journal(SCRIPT, [1])
    call = next(r.record["call_id"] for r in rows if r.record.get("k") == "intent")
    at = stamped(rows[3])
    assert at is not None
    ran = [{"kind": "effect", "call_id": call, "tag": "x", "at": at - 1.0}]
    held = [*rows, _hold(len(rows) + 1, 1, call, "unsafe: its outcome is unknown")]
    assert _audit(held, ran).held_ran == 1
    taken = "unsafe: its outcome is unknown; it was running on node n1 (epoch 1), whose ..."
    assert _audit([*rows, _hold(len(rows) + 1, 2, call, taken)], ran).held_ran == 0
    after = [{**ran[0], "at": at + 3600.0}]  # (it ran once the operator decided)
    assert _audit(held, after).held_ran == 0


def test_effects_after_a_cancel_count_but_the_call_it_named_within_its_time() -> None:
    cancel = Cancel("f00", 100.0, "toolu_f00_1", 2.0)
    line = {"kind": "effect", "tag": "f00.1", "call_id": "toolu_f00_1"}
    assert effects_after([{**line, "at": 99.0}, {**line, "at": 101.5}], [cancel]) == []
    late = [{**line, "at": 102.5}, {**line, "tag": "f00.2", "call_id": "other", "at": 100.5}]
    assert effects_after(late, [cancel]) == late
    assert effects_after([{**line, "tag": "f001.1", "at": 150.0}], [cancel]) == []


def test_a_row_of_a_node_whose_clock_was_stepped_is_judged_by_its_epoch_alone() -> None:
    rows = _journal(SCRIPT, [1])
    claim_at = 1767225603.5  # between rows 3 and 4, all of epoch 1
    claimed = {"t000": [(1, "n1", 1767225600.0), (2, "n2", claim_at)]}
    found = _audit(rows, _effects(SCRIPT), claimed=claimed)
    assert found.fenced_records == len(rows) - 3
    skewed = [("n1", 1767225600.0, 1767225700.0)]  # n1 stepped: its stamps say nothing
    found = _audit(rows, _effects(SCRIPT), claimed=claimed, skewed=skewed)
    assert found.fenced_records == 0
    behind = _journal(SCRIPT, [1, 1, 2, 2, 1, 2])  # row 5 by epoch 1 after epoch 2 wrote
    found = _audit(behind, _effects(SCRIPT), claimed=claimed, skewed=skewed)
    assert found.fenced_records == 1  # (the epochs' order needs no clock)


# -- the readers of the database, against what the store writes --------------------------------


def test_the_readers_see_what_the_postgres_store_wrote(postgres_schema: str) -> None:
    store = PostgresStore(postgres_schema, node="n1", lease=30.0, migrate=True)
    try:
        store.create(TaskSpec(id="t1", prompt="Go."), {"state": "queued"})
        first = store.acquire("t1")
        writer, _ = store.open_journal(first)
        writer.append([{"k": "user", "content": [], "at": "2026-01-01T00:00:01.000Z"}])
        assert leases_of(postgres_schema, "n1") == {"t1": first.epoch}
        assert leases_of(postgres_schema, "n2") == {}
        store.release(first)
        assert leases_of(postgres_schema, "n1") == {}
        second = store.acquire("t1")
        store.open_journal(second)[0].append([{"k": "user", "content": [], "at": "x"}])
        store.append_event("t1", {"event": "task_claimed", "node": "n1", "epoch": second.epoch,
                                  "timestamp": "2026-01-01T00:00:02.000Z"})  # fmt: skip
        store.append_event("t1", {"event": "lease_lost", "node": "n1"})
    finally:
        store.close()
    rows = journal_rows(postgres_schema)["t1"]
    assert [(r.seq, r.record["k"]) for r in rows] == [(1, "header"), (2, "user"), (3, "user")]
    assert [r.epoch for r in rows] == [first.epoch, first.epoch, second.epoch]
    claimed = claims_of(events_named(postgres_schema, "task_claimed"))
    assert claimed == {"t1": [(second.epoch, "n1", parse_time("2026-01-01T00:00:02.000Z"))]}
    assert list(events_named(postgres_schema, "lease_lost")) == ["t1"]


def test_leases_moved_are_the_takeovers_and_fenced_workers_after_the_marks(
    postgres_schema: str,
) -> None:
    """ "Leases moved by a clock step", from the events table by number (no clock)."""
    store = PostgresStore(postgres_schema, node="n1", lease=30.0, migrate=True)
    try:
        store.create(TaskSpec(id="t1", prompt="Go."), {"state": "queued"})
        store.append_event("t1", {"event": "lease_lost", "node": "n1"})  # before: not counted
        marks = event_marks(postgres_schema)
        store.append_event("t1", {"event": "task_claimed", "node": "n1", "epoch": 2})
        assert moved_since(postgres_schema, marks) == []  # a claim of a free task
        taken = {"node": "n1", "epoch": 2, "ended_at": "2026-01-01T00:00:00.000Z"}
        store.append_event(
            "t1", {"event": "task_claimed", "node": "n2", "epoch": 3, "taken_over": taken}
        )
        store.append_event("t1", {"event": "lease_lost", "node": "n1"})
        moved = moved_since(postgres_schema, marks)
        assert [m["event"] for m in moved] == ["task_claimed", "lease_lost"]
    finally:
        store.close()
