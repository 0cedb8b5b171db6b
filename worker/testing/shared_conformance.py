"""The cluster conformance suite: what every ``SharedStore`` backend promises (docs/design.md
section 10), shipped in the package so that any backend can run it (pytest needed).

A backend runs it from a test module of its own: import the suite's tests, and give a
``shared_backend`` fixture that makes a store of one cluster for each node a test asks
for, with the lease length and the monotonic clock the suite gives (the suite moves the
clock by hand, so no test waits for a lease to end)::

    import pytest
    from worker.testing.shared_conformance import *  # noqa: F403  (the suite's tests)

    @pytest.fixture
    def shared_backend() -> SharedBackend:
        database = MyDatabase()  # one cluster for the whole test
        return lambda node, lease, clock: MyStore(database, node=node, lease=lease, clock=clock)

The same stores should pass the ``TaskStore`` suite (``worker.testing.store_conformance``).
Every test here is backend-blind: the in-memory cluster (``worker.store.memshared``) and
PostgreSQL pass them unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from worker.errors import (
    ConfigError,
    FencedError,
    LockBusyError,
    RecordConflictError,
    SupersededError,
)
from worker.spool import TaskSpec
from worker.store.base import SharedStore

#: How to make a store of the test's one cluster: (node, lease seconds, clock) -> store.
SharedBackend = Callable[[str, float, Callable[[], float]], SharedStore]

#: The lease of every store the suite makes, seconds (only its clock moves it).
LEASE = 30.0
#: What a taker waits past a lease (``worker.store.pglease.TAKEOVER_MARGIN``), and more.
MARGIN = 1.0


class ManualClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._guard = threading.Lock()

    def __call__(self) -> float:
        with self._guard:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._guard:
            self.now += seconds


@dataclass
class Cluster:
    """The stores of one test's cluster, one per node, on one ``ManualClock``."""

    backend: SharedBackend
    clock: ManualClock = field(default_factory=ManualClock)
    opened: list[SharedStore] = field(default_factory=list)

    def node(self, name: str) -> SharedStore:
        store = self.backend(name, LEASE, self.clock)
        self.opened.append(store)
        return store

    def watch(self, seconds: float, *watchers: SharedStore) -> None:
        """Let ``seconds`` pass while ``watchers`` look at the leases, as a node's claims
        do every poll (a lease is judged only by what its taker watched)."""
        step = LEASE / 4
        for store in watchers:
            store.claim(0)
        while seconds > 0:
            self.clock.advance(min(step, seconds))
            seconds -= step
            for store in watchers:
                store.claim(0)


@pytest.fixture
def cluster(shared_backend: SharedBackend) -> Iterator[Cluster]:
    """The test's cluster; its stores are closed after."""
    made = Cluster(shared_backend)
    yield made
    for store in made.opened:
        store.close()


def new_task(store: SharedStore, task_id: str = "t1", state: str = "queued") -> str:
    store.create(TaskSpec(id=task_id, prompt="Do the thing."), {"state": state})
    return task_id


# -- the queue ----------------------------------------------------------------------------


def test_racing_claims_never_give_one_task_to_two_nodes(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    ids = [new_task(a, f"t{n}") for n in range(40)]
    got: dict[str, list[str]] = {"a": [], "b": []}

    def claimer(store: SharedStore) -> None:
        while owners := store.claim(3):
            got[store.node] += [o.task_id for o in owners]

    threads = [threading.Thread(target=claimer, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got["a"] + got["b"]) == sorted(ids)  # each once, none lost
    assert a.leases() == {**dict.fromkeys(got["a"], "a"), **dict.fromkeys(got["b"], "b")}


def test_claims_take_the_oldest_first_and_their_records_say_running(cluster: Cluster) -> None:
    a = cluster.node("a")
    for task in ("c", "a", "b"):  # created in this order, not their names'
        new_task(a, task)
    owners = a.claim(2)
    assert [o.task_id for o in owners] == ["c", "a"]
    assert all(o.holder == "a" and o.previous is None for o in owners)
    record, _ = a.get_record("c")
    assert record is not None and record["state"] == "running"
    assert a.get_record("b")[0] == {"state": "queued"}
    assert [o.task_id for o in a.claim(5)] == ["b"]


def test_a_claim_skips_live_leases_held_tasks_and_the_excluded(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    new_task(a, "q1")
    new_task(a, "q2")
    new_task(a, "h1", state="held")
    new_task(a, "d1", state="done")
    assert [o.task_id for o in a.claim(5, exclude=["q1"])] == ["q2"]
    assert b.claim(5, exclude=["q1"]) == []  # q2 is leased, h1 held, d1 done
    assert [o.task_id for o in b.claim(5)] == ["q1"]
    assert a.leases() == {"q2": "a", "q1": "b"}


def test_a_paused_task_is_not_claimed_until_the_pause_ends(cluster: Cluster) -> None:
    a = cluster.node("a")
    task = new_task(a)
    assert not a.pause_requested(task)
    a.request_pause(task, 600.0)
    assert a.pause_requested(task) and a.claim(1) == []
    a.end_pause(task)
    assert not a.pause_requested(task)
    assert [o.task_id for o in a.claim(1)] == [task]


# -- epochs, hand-overs and releases ----------------------------------------------------


def test_a_handover_fences_the_last_worker_and_a_release_ends_the_lease(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    task = new_task(a)
    (first,) = a.claim(1)
    second = a.handover(first)
    assert second.epoch > first.epoch and second.holder == "a"
    a.check_fence(second)
    for step in (a.handover, a.check_fence, a.renew):
        with pytest.raises(FencedError):
            step(first)
    with pytest.raises(FencedError):
        a.put_record(first, {"state": "done"}, release=True)
    a.put_record(second, {"state": "running", "pid": 7}, release=False)
    assert a.leases() == {task: "a"} and a.get_record(task)[0] == {"state": "running", "pid": 7}
    a.put_record(second, {"state": "backoff"}, release=True, runnable_in=600.0)
    assert a.leases() == {} and not a.owned(task)
    assert b.claim(1) == []  # its backoff is not over
    with pytest.raises(FencedError):
        a.check_fence(second)  # a release moves the epoch on
    a.put_record(a.acquire(task), {"state": "queued"}, release=True)  # (an operator's move)
    (third,) = b.claim(1)
    assert third.task_id == task and third.epoch > second.epoch
    with pytest.raises(FencedError):
        a.put_record(second, {"state": "done"}, release=True)
    assert b.get_record(task)[0] == {"state": "running"}  # the refused write wrote nothing


def test_a_released_task_with_no_backoff_is_claimable_at_once(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    new_task(a, "t1")
    (owner,) = a.claim(1)
    new_task(a, "t2")  # queued after t1 was claimed
    a.put_record(owner, {"state": "queued"}, release=True)
    assert [o.task_id for o in b.claim(5)] == ["t2", "t1"]  # t1 is behind t2 now


def test_a_stale_owners_journal_is_fenced_by_a_claim(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    task = new_task(a)
    (first,) = a.claim(1)
    writer, _ = a.open_journal(first, header={"task": task})
    writer.append([{"k": "user", "content": "by the first"}])
    a.put_record(first, {"state": "queued"}, release=True)
    (second,) = b.claim(1)
    with pytest.raises(FencedError):
        writer.append([{"k": "user", "content": "too late"}])
    later, _ = b.open_journal(second)
    later.append([{"k": "user", "content": "by the second"}])
    assert [r.get("content") for r in b.replay(task)[1:]] == ["by the first", "by the second"]
    writer.close()
    later.close()


def test_acquire_and_claims_share_one_lease(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    task = new_task(a)
    owner = b.acquire(task)  # (an operator's command, on any node)
    assert a.owned(task) and a.claim(1) == []
    with pytest.raises(LockBusyError):
        a.acquire(task)
    b.release(owner)
    assert not a.owned(task)
    (claimed,) = a.claim(1)
    assert claimed.epoch > owner.epoch
    with pytest.raises(FencedError):
        a.check_fence(owner)


# -- renewals and takeovers ---------------------------------------------------------------


def test_a_batch_renewal_names_the_leases_that_moved(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    for n in range(3):
        new_task(a, f"t{n}")
    owners = a.claim(3)
    taken = b.handover(owners[1])  # (as if b had claimed it after a's lease ran out)
    assert a.renew_all(owners) == [owners[1]]
    assert b.renew_all([taken]) == []
    assert a.renew_all([]) == []


def test_a_lease_left_standing_still_is_taken_over_and_its_holder_fenced(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    task = new_task(a)
    (held,) = a.claim(1)
    cluster.watch(LEASE / 2, b)
    assert b.claim(1) == []  # half a lease: still a's
    cluster.watch(LEASE / 2 + MARGIN, b)
    (taken,) = b.claim(1)
    assert taken.task_id == task and taken.holder == "b" and taken.epoch > held.epoch
    assert taken.previous is not None
    assert (taken.previous.node, taken.previous.epoch) == ("a", held.epoch)
    assert taken.previous.ended_at.endswith("Z")
    assert b.leases() == {task: "b"}
    assert a.renew_all([held]) == [held]
    with pytest.raises(FencedError):
        a.put_record(held, {"state": "done"}, release=True)
    assert b.get_record(task)[0] == {"state": "running"}


def test_a_renewed_lease_is_never_taken_over(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    new_task(a)
    (held,) = a.claim(1)
    for _ in range(4):  # four leases long, renewed every third of one
        cluster.watch(LEASE / 3, b)
        assert a.renew_all([held]) == []
        cluster.watch(LEASE / 3, b)
        a.renew(held)
        cluster.watch(LEASE / 3, b)
        assert b.claim(1) == []
    a.check_fence(held)


def test_a_lease_is_judged_by_what_its_taker_watched(cluster: Cluster) -> None:
    """Time no one watched is not a lease's end: a node that starts looking (or looks
    again after a pause past half a lease) waits a whole lease from then."""
    a = cluster.node("a")
    new_task(a)
    a.claim(1)
    cluster.clock.advance(LEASE * 3)  # nobody looking
    late = cluster.node("b")
    assert late.claim(1) == []  # sees it now for the first time
    cluster.watch(LEASE / 2, late)
    assert late.claim(1) == []
    cluster.watch(LEASE / 2 + MARGIN, late)
    assert len(late.claim(1)) == 1


def test_a_claim_without_expired_takes_only_free_tasks(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    new_task(a, "t1")
    a.claim(1)
    new_task(a, "t2")
    cluster.watch(LEASE + MARGIN, b)
    assert [o.task_id for o in b.claim(5, expired=False)] == ["t2"]
    assert [o.task_id for o in b.claim(5)] == ["t1"]


def test_an_operator_seizes_a_free_lease_at_once_and_a_stalled_one_after_half(
    cluster: Cluster,
) -> None:
    a, op = cluster.node("a"), cluster.node("op")
    free, busy = new_task(a, "t1"), new_task(a, "t2")
    seized = op.seize(free)
    assert seized is not None and seized.holder is None and seized.epoch == 0
    assert seized.owner.task_id == free and op.leases() == {free: "op"}
    op.put_record(seized.owner, {"state": "queued"}, release=True)
    ((held),) = a.claim(1, exclude=[free])
    assert held.task_id == busy
    assert op.seize(busy) is None  # just renewed, as far as op has seen
    cluster.clock.advance(LEASE / 4)
    a.renew(held)
    assert op.seize(busy) is None  # renewed since op last looked
    cluster.clock.advance(LEASE / 4)
    assert op.seize(busy) is None  # a quarter of a lease unrenewed: not frozen yet
    cluster.clock.advance(LEASE / 4)
    taken = op.seize(busy)
    assert taken is not None and (taken.holder, taken.epoch) == ("a", held.epoch)
    assert taken.ends_in == pytest.approx(LEASE / 2)  # the rest of the holder's lease
    with pytest.raises(FencedError):
        a.check_fence(held)


def test_orphans_are_this_nodes_running_leases_with_their_beats(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    for n in range(3):
        new_task(a, f"t{n}")
    mine = a.claim(2)
    (theirs,) = b.claim(1)
    a.publish_heartbeat("t0", {"pid": 11, "turn": 1})
    b.publish_heartbeat(theirs.task_id, {"pid": 12})
    assert a.orphans() == [(mine[0], {"pid": 11, "turn": 1})]  # t1 has no beat yet
    again = cluster.node("a")  # the node's next daemon sees them too
    assert [(o.task_id, o.epoch) for o, _ in again.orphans()] == [("t0", mine[0].epoch)]
    a.put_record(mine[0], {"state": "done"}, release=True)
    assert again.orphans() == []


# -- the nodes ----------------------------------------------------------------------------


def test_nodes_join_are_listed_and_leave(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    assert a.join(4) == 1
    assert b.join(2) == 1
    new_task(a)
    a.claim(1)
    listed = {n.name: n for n in a.nodes()}
    assert set(listed) == {"a", "b"}
    assert (listed["a"].tasks, listed["b"].tasks, listed["a"].max_workers) == (1, 0, 4)
    assert all(n.alive and n.heartbeat_age < 5 and n.epoch == 1 for n in listed.values())
    assert a.join(4) == 2  # the same daemon again: its next epoch, not refused
    assert a.renew_all([]) == []
    b.leave()
    assert [n.name for n in a.nodes()] == ["a"]
    assert b.join(2) == 2  # never an epoch a frozen daemon may still hold


def test_a_node_registered_again_supersedes_the_first_registration(cluster: Cluster) -> None:
    """The node's next daemon (a restart, or a second daemon given the name while the
    first was frozen) registers the name under its next epoch; the first one's
    renewals, claims and hand-overs are refused from then on, and it may not take the
    name back while the other renews it."""
    first = cluster.node("a")
    assert first.join(2) == 1
    for n in range(2):
        new_task(first, f"t{n}")
    (held,) = first.claim(1)
    again = cluster.node("a")
    assert again.join(2) == 2
    with pytest.raises(SupersededError) as caught:
        first.renew_all([held])
    assert caught.value.epoch == 1 and caught.value.now is not None
    assert caught.value.now[0] == 2 and "epoch 2" in str(caught.value)
    assert first.claim(5) == []  # the claim checks the registration too
    with pytest.raises(FencedError):
        first.handover(held)
    assert first.leases() == {"t0": "a"}  # (its lease was not renewed, nor moved)
    ((listed),) = first.nodes()
    assert (listed.name, listed.epoch) == ("a", 2)
    with pytest.raises(ConfigError, match="in use by a live node"):
        first.join(2)  # not while the other one renews: no flapping
    assert again.renew_all([]) == []
    again.leave()
    assert first.nodes() == []  # a daemon that left is no node
    assert first.join(2) == 3  # the name is free: a fresh epoch, never an old one
    assert [o.task_id for o in first.claim(5)] == ["t1"]


# -- coordination -------------------------------------------------------------------------


def test_the_operator_lock_holds_across_stores(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    task = new_task(a)
    with a.operator_lock(task, 1.0):
        started = time.monotonic()
        with pytest.raises(LockBusyError), b.operator_lock(task, 0.3):
            pass
        assert time.monotonic() - started >= 0.3
        with b.operator_lock(new_task(a, "t2"), 1.0):  # another task's: free
            pass
    with b.operator_lock(task, 1.0):  # released with the block
        pass


def test_a_wake_reaches_every_listener(cluster: Cluster) -> None:
    a, b, c = cluster.node("a"), cluster.node("b"), cluster.node("c")
    task = new_task(a)
    woken = [threading.Event(), threading.Event()]
    stops = [b.listen(woken[0].set), c.listen(woken[1].set)]
    try:
        for event in woken:  # a listener's first wake-up: on connecting
            assert event.wait(10)
            event.clear()
        a.wake(task)
        assert all(event.wait(10) for event in woken)
    finally:
        for stop in stops:
            stop()


def test_console_tokens_are_shared_by_every_node_and_unique(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    first = {"id": "k1", "digest": "d" * 64, "by": "erin", "created_at": "2026-01-01T00:00:00.000Z"}
    second = {**first, "id": "k2", "digest": "e" * 64, "created_at": "2026-01-02T00:00:00.000Z"}
    a.add_token(first)
    b.add_token(second)
    assert b.token("d" * 64) == first and a.token("e" * 64) == second
    assert [t["id"] for t in a.tokens()] == ["k1", "k2"]
    for taken in ({**first, "digest": "f" * 64}, {**first, "id": "k3"}):
        with pytest.raises(RecordConflictError):
            b.add_token(taken)
    assert b.revoke_token("k1") and not a.revoke_token("k1")
    assert a.token("d" * 64) is None and [t["id"] for t in b.tokens()] == ["k2"]
