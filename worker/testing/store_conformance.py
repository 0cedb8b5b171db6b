"""The store conformance suite: what every ``TaskStore`` backend promises, shipped in the
package so that any backend can run it (pytest needed).

A backend runs it from a test module of its own: import the suite's tests, and give a
``store`` fixture that makes an empty store for each test::

    import pytest
    from worker.testing.store_conformance import *  # noqa: F403  (the suite's tests)

    @pytest.fixture
    def store(tmp_path: Path) -> TaskStore:
        return MyStore(tmp_path)

Nothing here knows which backend it has. agentd runs it on each of its own
(``tests/store/test_conformance.py``); a cluster's store passes the cluster suite too
(``worker.testing.shared_conformance``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker.errors import (
    FencedError,
    InvalidIdError,
    LockBusyError,
    RecordConflictError,
    StateConflictError,
    StorageError,
)
from worker.spool import TaskSpec
from worker.state import TaskState, fold
from worker.store import replay
from worker.store.base import JSON, MAX_RECORD, START, Snapshot, TaskStore, Version

HEADER = {"task": "t1"}


def new_task(store: TaskStore, task_id: str = "t1", prompt: str = "Do the thing.") -> str:
    """A task in ``store`` with a queued record; its id."""
    store.create(TaskSpec(id=task_id, prompt=prompt), {"state": "queued"})
    return task_id


def user(text: str) -> JSON:
    return {"k": "user", "content": [{"type": "text", "text": text}]}


def turn(n: int, text: str = "ok") -> JSON:
    return {
        "k": "turn",
        "turn": n,
        "message": {"role": "assistant", "content": [{"type": "text", "text": text}]},
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 10, "output_tokens": 2},
        "model": "m",
    }


def race(writers: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` on ``writers`` threads released at the same instant."""
    start = threading.Barrier(writers)
    results: list[Any] = [None] * writers

    def run(i: int) -> None:
        start.wait(timeout=10)
        try:
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


# -- tasks --------------------------------------------------------------------------------


def test_a_created_task_is_listed_and_its_id_is_taken(store: TaskStore) -> None:
    new_task(store, "b")
    new_task(store, "a", prompt="Other.")
    assert store.task_ids() == ["a", "b"]
    assert store.exists("a") and not store.exists("c")
    assert store.load_spec("a").prompt == "Other."
    with pytest.raises(StateConflictError):
        new_task(store, "a")
    assert store.get_record("a")[0] == {"state": "queued"}


def test_a_forks_first_records_come_after_a_header(store: TaskStore) -> None:
    base = user("from the parent")
    store.create(TaskSpec(id="f1", prompt="p"), {"state": "queued"}, journal=[base])
    records = store.replay("f1")
    assert [r["k"] for r in records] == ["header", "user"]
    assert records[0]["task"] == "f1" and records[1] == base


def test_what_prepare_makes_comes_before_the_task_and_a_failed_one_leaves_none(
    store: TaskStore,
) -> None:
    seen: list[bool] = []
    spec = TaskSpec(id="f1", prompt="p")
    store.create(spec, {}, prepare=lambda _: seen.append(store.exists("f1")))
    assert seen == [False] and store.exists("f1")

    def fail(_: Path | None) -> None:
        raise OSError("no room for the workspace")

    with pytest.raises(OSError, match="no room"):
        store.create(TaskSpec(id="f2", prompt="p"), {"state": "queued"}, prepare=fail)
    assert not store.exists("f2")
    new_task(store, "f2")  # the id is still free
    assert store.get_record("f2")[0] == {"state": "queued"}


# -- the journal --------------------------------------------------------------------------


def test_appended_records_replay_in_order_with_their_header(store: TaskStore) -> None:
    task = new_task(store)
    assert store.replay(task) == []  # no journal yet
    owner = store.acquire(task)
    writer, records = store.open_journal(owner, header=HEADER)
    assert records == [{"k": "header", "v": 2, "task": "t1"}]
    writer.append([user("one"), turn(1)])
    writer.append([user("two")], sync=False)
    writer.sync()
    writer.close()
    expected = [records[0], user("one"), turn(1), user("two")]
    assert store.replay(task) == expected
    writer, again = store.open_journal(owner, header=HEADER)  # reopened: the same records
    assert again == expected
    writer.close()


def test_a_cursor_replays_only_what_came_after_it(store: TaskStore) -> None:
    task = new_task(store)
    writer, _ = store.open_journal(store.acquire(task), header=HEADER)
    writer.append([user("one")])
    mark = writer.cursor
    assert writer.volume_since(mark) == 0
    writer.append([user("two"), user("three")])
    assert writer.cursor > mark and writer.volume_since(mark) > 0
    assert store.replay(task, mark) == [user("two"), user("three")]
    assert store.replay(task, writer.cursor) == []
    writer.close()


def test_held_records_are_written_by_the_next_append(store: TaskStore) -> None:
    task = new_task(store)
    writer, _ = store.open_journal(store.acquire(task), header=HEADER)
    writer.hold([turn(1)])
    assert store.replay(task)[1:] == []
    writer.append([user("next")])
    assert store.replay(task)[1:] == [turn(1), user("next")]
    writer.close()


def test_a_close_writes_what_is_held_unless_the_owner_lost_the_task(store: TaskStore) -> None:
    """Every store closes a journal alike: the held records are written while the owner
    holds the task, and never once it has lost it."""
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.hold([turn(1)])
    writer.close()
    assert store.replay(task)[1:] == [turn(1)]

    writer, _ = store.open_journal(owner)
    writer.hold([user("held by an owner that lost the task")])
    store.release(owner)
    writer.close()
    assert store.replay(task)[1:] == [turn(1)]


def test_an_oversized_record_is_refused_and_changes_nothing(store: TaskStore) -> None:
    task = new_task(store)
    writer, _ = store.open_journal(store.acquire(task), header=HEADER)
    writer.append([user("kept")])
    before = store.replay(task)
    with pytest.raises(StorageError, match="over the") as refused:
        writer.append([user("x" * MAX_RECORD)])
    assert not refused.value.fault  # an error, never a storage fault to wait out
    writer.append([user("after")])
    assert store.replay(task) == [*before, user("after")]
    writer.close()


# -- snapshots ----------------------------------------------------------------------------


def test_a_snapshot_keeps_its_cursor_and_replays_to_the_same_state(store: TaskStore) -> None:
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    assert store.get_snapshot(task) is None
    writer.append([turn(1), user("more")])
    state = fold("Do the thing.", store.replay(task))
    size = store.put_snapshot(owner, Snapshot(writer.cursor, state))
    mark = writer.cursor
    writer.append([turn(2, "later")])
    writer.append([user("and more")])

    snapshot = store.get_snapshot(task)
    assert snapshot is not None and size > 0
    assert snapshot.cursor == mark and snapshot.size == size
    assert store.replay(task, snapshot.cursor) == [turn(2, "later"), user("and more")]
    fast = replay.load(store, task, full=False)
    slow = replay.load(store, task)
    assert (fast.messages, fast.turn, fast.usage) == (slow.messages, slow.turn, slow.usage)
    assert fast.turn == 2
    writer.close()


def test_reading_all_tasks_at_once_reads_what_each_read_does(store: TaskStore) -> None:
    """``read_all``: status's reads of every task answered as they would be one by one
    (snapshot or none, a heartbeat or none), and nothing written meanwhile is lost."""
    plain, snapped = new_task(store, "t1"), new_task(store, "t2")
    writer, _ = store.open_journal(store.acquire(plain), header=HEADER)
    writer.append([turn(1), user("more")])
    owner = store.acquire(snapped)
    other, _ = store.open_journal(owner, header={"task": snapped})
    other.append([turn(1)])
    store.put_snapshot(owner, Snapshot(other.cursor, fold("Do the thing.", store.replay(snapped))))
    other.append([turn(2, "later")])
    store.publish_heartbeat(snapped, {"pid": 1, "turn": 2})

    def reads() -> list[Any]:
        seen: list[Any] = [store.task_ids()]
        for task in (plain, snapped):
            snapshot = store.get_snapshot(task)
            after = snapshot.cursor if snapshot is not None else START
            state = replay.load(store, task, full=False)
            seen += [store.exists(task), store.load_spec(task), store.get_record(task)]
            seen += [store.read_heartbeat(task), after, store.replay(task, after)]
            seen += [(state.turn, state.messages)]
        return seen

    alone = reads()
    with store.read_all():
        together = reads()
        writer.append([user("written meanwhile")])
    assert together == alone
    assert store.replay(plain)[-1] == user("written meanwhile")  # read after the block
    writer.close()
    other.close()


def test_a_snapshot_that_does_not_fit_is_dropped_for_the_journal(store: TaskStore) -> None:
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.append([turn(1)])
    store.put_snapshot(owner, Snapshot(writer.cursor, TaskState("Do the thing.")))
    writer.append([{"k": "rewind", "to": 0}])  # needs the boundaries no snapshot has
    writer.close()
    ignored: list[Exception] = []
    writer, state, used = replay.resume(store, owner, "Do the thing.", on_ignored=ignored.append)
    assert used is None and ignored == []  # folded from the start, quietly
    assert state.turn == 0 and state.epoch == 1
    writer.close()


# -- ownership and the fence ----------------------------------------------------------------


def test_one_owner_at_a_time(store: TaskStore) -> None:
    task = new_task(store)
    first = store.acquire(task)
    assert store.owned(task)
    with pytest.raises(LockBusyError):
        store.acquire(task)
    store.renew(first)
    store.release(first)
    assert not store.owned(task)
    second = store.acquire(task)
    assert second.epoch > first.epoch
    store.release(second)


def test_owner_pid_names_no_process_until_the_task_is_owned(store: TaskStore) -> None:
    task = new_task(store)
    assert store.owner_pid(task) is None
    owner = store.acquire(task)
    assert store.owner_pid(task) in (os.getpid(), None)  # None: an owner it cannot name
    store.release(owner)


def test_a_stale_owners_steps_are_refused_after_ownership_moves(store: TaskStore) -> None:
    task = new_task(store)
    old = store.acquire(task)
    stale, _ = store.open_journal(old, header=HEADER)
    stale.append([user("by the old owner")])
    store.release(old)  # a lease lost, a lock released: ownership moves
    new = store.acquire(task)
    writer, _ = store.open_journal(new, header=HEADER)

    with pytest.raises(FencedError):
        stale.append([user("too late")])
    with pytest.raises(FencedError):
        stale.hold([user("too late")])
    with pytest.raises(FencedError):
        store.put_snapshot(old, Snapshot(stale.cursor, TaskState("p")))
    with pytest.raises(FencedError):
        store.renew(old)
    with pytest.raises(FencedError):
        store.open_journal(old, header=HEADER)
    store.release(old)  # a stale release takes nothing from the new owner
    assert store.owned(task)

    writer.append([user("by the new owner")])
    assert [r.get("content") for r in store.replay(task)[1:]] == [
        user("by the old owner")["content"],
        user("by the new owner")["content"],
    ]
    stale.close()
    writer.close()


def test_an_owner_that_released_its_task_is_fenced_before_anyone_takes_it(
    store: TaskStore,
) -> None:
    task = new_task(store)
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    writer.append([user("while owned")])
    writer.hold([user("held, never written")])
    store.release(owner)  # nobody owns it now: the old owner must not write, nor take it back

    with pytest.raises(FencedError):
        writer.append([user("after the release")])
    with pytest.raises(FencedError):
        writer.sync()  # the held record would ride on it
    with pytest.raises(FencedError):
        store.put_snapshot(owner, Snapshot(writer.cursor, TaskState("p")))
    with pytest.raises(FencedError):
        store.renew(owner)
    writer.close()
    assert not store.owned(task)
    assert [r.get("content") for r in store.replay(task)[1:]] == [user("while owned")["content"]]
    store.release(store.acquire(task))  # and the next owner takes it at once


# -- decisions, the cancel and the task record ------------------------------------------------


@pytest.mark.parametrize("writers", [2, 8])
def test_a_decision_is_recorded_exactly_once(store: TaskStore, writers: int) -> None:
    task = new_task(store)
    assert store.read_decision(task, "agentd-key1", 1) is None
    won = race(writers, lambda i: store.record_decision(task, "agentd-key1", 1, {"by": i}))
    assert sorted(won, key=str) == [False] * (writers - 1) + [True]
    winner = won.index(True)
    assert store.read_decision(task, "agentd-key1", 1) == {"by": winner}
    assert store.record_decision(task, "agentd-key1", 2, {"by": "next attempt"})


@pytest.mark.parametrize("writers", [2, 8])
def test_a_cancel_is_recorded_exactly_once(store: TaskStore, writers: int) -> None:
    task = new_task(store)
    assert not store.cancel_requested(task)
    assert store.read_cancel(task) is None
    won = race(writers, lambda i: store.request_cancel(task, {"by": f"user{i}", "via": "cli"}))
    assert won.count(True) == 1 and won.count(False) == writers - 1
    assert store.cancel_requested(task)
    # the record read back is the winner's: who asked (docs/design.md section 15)
    assert store.read_cancel(task) == {"by": f"user{won.index(True)}", "via": "cli"}
    store.withdraw_cancel(task)
    assert not store.cancel_requested(task)
    assert store.read_cancel(task) is None


def test_compare_and_set_refuses_a_stale_version(store: TaskStore) -> None:
    task = new_task(store)
    record, version = store.get_record(task)
    assert record == {"state": "queued"}
    newer = store.cas_record(task, version, {"state": "running"})
    assert newer != version
    with pytest.raises(RecordConflictError):
        store.cas_record(task, version, {"state": "cancelled"})
    with pytest.raises(RecordConflictError):
        store.cas_record(task, Version(), {"state": "cancelled"})
    assert store.get_record(task) == ({"state": "running"}, newer)
    store.cas_record(task, newer, {"state": "backoff"}, durable=False)
    assert store.get_record(task)[0] == {"state": "backoff"}


def test_the_record_version_is_the_one_the_record_was_read_with(store: TaskStore) -> None:
    task = new_task(store)
    _, version = store.get_record(task)
    assert store.record_version(task) == version
    newer = store.cas_record(task, store.record_version(task), {"state": "running"})
    assert store.record_version(task) == newer != version
    assert store.get_record(task) == ({"state": "running"}, newer)


def test_the_names_a_message_gives_tell_the_items_apart(store: TaskStore) -> None:
    task = new_task(store)
    assert task in store.record_name(task)
    names = {store.decision_name(task, key, n) for key in ("k1", "k2") for n in (1, 2)}
    assert len(names) == 4 and all("k1" in n or "k2" in n for n in names)


@pytest.mark.parametrize("writers", [2, 8])
def test_compare_and_set_has_one_winner_in_a_race(store: TaskStore, writers: int) -> None:
    task = new_task(store)
    _, version = store.get_record(task)
    results = race(writers, lambda i: store.cas_record(task, version, {"state": "x", "by": i}))
    winners = [i for i, r in enumerate(results) if isinstance(r, Version)]
    assert len(winners) == 1
    assert all(isinstance(r, RecordConflictError) for r in results if not isinstance(r, Version))
    assert store.get_record(task)[0] == {"state": "x", "by": winners[0]}


# -- events, heartbeats, exits ----------------------------------------------------------------


def test_events_read_back_in_order_from_a_cursor(store: TaskStore) -> None:
    task = new_task(store)
    assert store.read_events(task) == ([], START)
    for n in range(5):
        store.append_event(task, {"event": "e", "n": n})
    events, mark = store.read_events(task)
    assert [e["n"] for e in events] == [0, 1, 2, 3, 4]
    store.append_event(task, {"event": "e", "n": 5})
    later, end = store.read_events(task, mark)
    assert [e["n"] for e in later] == [5] and end > mark

    def write(i: int) -> None:
        for n in range(20):
            store.append_event(task, {"event": "w", "writer": i, "n": n})

    race(4, write)
    written, _ = store.read_events(task, end)
    for i in range(4):  # each writer's events in its own order, none lost
        assert [e["n"] for e in written if e["writer"] == i] == list(range(20))


def test_the_ends_of_the_journal_and_the_events_are_where_the_next_read_starts(
    store: TaskStore,
) -> None:
    """``journal_end`` and ``events_end``: a reader that starts there gets exactly what
    was added after."""
    task = new_task(store)
    assert store.journal_end(task) == START and store.events_end(task) == START
    owner = store.acquire(task)
    writer, _ = store.open_journal(owner, header=HEADER)
    with_header = store.journal_end(task)
    assert with_header == writer.cursor and store.replay(task, with_header) == []
    writer.append([user("one")])
    assert store.replay(task, with_header) == [user("one")]
    assert store.journal_end(task) == writer.cursor > with_header
    writer.close()
    store.release(owner)
    store.append_event(task, {"event": "before"})
    mark = store.events_end(task)
    store.append_event(task, {"event": "after"})
    events, end = store.read_events(task, mark)
    assert [e["event"] for e in events] == ["after"] and end == store.events_end(task)


def test_heartbeats_and_exits_are_published_and_read(store: TaskStore) -> None:
    task = new_task(store)
    assert store.read_heartbeat(task) is None and store.read_exit(task) is None
    store.publish_heartbeat(task, {"pid": 1, "turn": 3})
    store.publish_heartbeat(task, {"pid": 1, "turn": 4})
    store.publish_exit(task, {"code": 0, "state": "done"})
    assert store.read_heartbeat(task) == {"pid": 1, "turn": 4}
    assert store.read_exit(task) == {"code": 0, "state": "done"}


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "", "A", "x\0y", "a" * 65, "-a"])
def test_an_id_no_store_accepts_is_refused_before_anything(store: TaskStore, bad: str) -> None:
    for step in (
        store.exists,
        store.acquire,
        store.replay,
        store.get_snapshot,
        store.read_heartbeat,
        store.cancel_requested,
        store.read_cancel,
        store.owner_pid,
        store.record_name,
        lambda task_id: store.create(TaskSpec(id=task_id, prompt="p"), {}),
    ):
        with pytest.raises(InvalidIdError):
            step(bad)
    assert store.task_ids() == []


@pytest.mark.parametrize("key", ["", "../x", "a b", "k" * 129])
def test_a_decision_key_no_store_accepts_is_refused(store: TaskStore, key: str) -> None:
    task = new_task(store)
    with pytest.raises(InvalidIdError):
        store.record_decision(task, key, 1, {"action": "rerun"})
    with pytest.raises(InvalidIdError):
        store.read_decision(task, key, 1)
    with pytest.raises(InvalidIdError):
        store.decision_name(task, key, 1)
