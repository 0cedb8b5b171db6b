"""The daemon's cluster path (``supervisor.placement.ClusterPlacement`` in a real
``Supervisor``) on the in-memory cluster (``worker.store.memshared``): no database
server, and a clock the test moves, so leases end without a wait. The daemon does not
serve: the test calls its placement's steps (join, schedule, tick) as its loop would,
and a worker's start is recorded rather than made (a worker process could not reach a
store in this one's memory); end to end on PostgreSQL is ``test_cluster.py``'s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.daemon import Supervisor
from supervisor.placement import ClusterPlacement
from supervisor.slot import TaskSlot
from tests.support import reply, scripted_task, text
from worker.config import Config
from worker.events import Event
from worker.protocol import TaskStatus
from worker.spool import Spool
from worker.store.memshared import MemoryCluster, MemorySharedStore
from worker.testing.shared_conformance import ManualClock

LEASE = 30.0


class Node:
    """A daemon of node ``a`` on the cluster, whose worker starts are recorded."""

    def __init__(self, root: Path, store: MemorySharedStore, clock: ManualClock) -> None:
        self.spool = Spool(root).on(store)  # (what ``agentd --store`` hands the daemon)
        self.store = store
        self.clock = clock
        self.daemon = Supervisor(self.spool, Config(), preload=False, clock=clock)
        self.started: list[str] = []

        def start(slot: TaskSlot) -> None:
            self.started.append(slot.task.id)

        self.daemon.launcher.start = start  # type: ignore[method-assign]  # (no worker process)
        placement = self.daemon.placement
        assert isinstance(placement, ClusterPlacement)
        self.placement = placement

    def ticks(self, seconds: float) -> None:
        """The daemon's loop for ``seconds``: a tick every tenth of a lease."""
        for _ in range(round(seconds / (LEASE / 10))):
            self.clock.advance(LEASE / 10)
            self.placement.tick(self.clock())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def cluster(clock: ManualClock) -> MemoryCluster:
    return MemoryCluster(clock=clock)


@pytest.fixture
def node(tmp_path: Path, cluster: MemoryCluster, clock: ManualClock) -> Iterator[Node]:
    made = Node(tmp_path / "spool", cluster.store("a", lease=LEASE), clock)
    yield made
    made.placement.leave()


def submit(node: Node, name: str) -> None:
    scripted_task(node.spool, [reply(text("done"))], name=name)


def test_a_daemon_claims_the_oldest_tasks_it_has_room_for_and_keeps_their_leases(
    node: Node, cluster: MemoryCluster
) -> None:
    joined = node.placement.join(lambda: None)
    assert joined["node"] == "a" and joined["epoch"] == 1
    for name in ("t3", "t1", "t2"):
        submit(node, name)
    node.placement.schedule(2, node.clock())
    assert node.started == ["t3", "t1"]
    assert node.store.leases() == {"t3": "a", "t1": "a"}
    events, _ = node.store.read_events("t3")
    claims = [(e["node"], e["epoch"]) for e in events if e["event"] == "task_claimed"]
    assert claims == [("a", 1)]

    other = cluster.store("b", lease=LEASE)
    other.claim(0)
    for _ in range(10):  # three leases long: the daemon's ticks renew them
        node.ticks(LEASE / 3)
        other.claim(0)
    assert [o.task_id for o in other.claim(5)] == ["t2"]  # never one of a's
    assert node.store.leases() == {"t3": "a", "t1": "a", "t2": "b"}
    assert {n.name: n.alive for n in other.nodes()} == {"a": True}


def test_a_daemon_whose_leases_were_taken_over_lets_them_go(
    node: Node, cluster: MemoryCluster
) -> None:
    node.placement.join(lambda: None)
    submit(node, "t1")
    node.placement.schedule(1, node.clock())
    assert node.started == ["t1"]
    slot = node.daemon.slots["t1"]
    assert slot.owner is not None and slot.record.state == TaskStatus.RUNNING

    other = cluster.store("b", lease=LEASE)  # a frozen: b watches its lease stand still
    other.claim(0)
    for _ in range(5):
        node.clock.advance(LEASE / 4)
        other.claim(0)
    (taken,) = other.claim(1)
    assert taken.previous is not None and taken.previous.node == "a"

    node.ticks(LEASE / 3)  # a thaws: its renewal names the lease that moved
    assert "t1" not in node.daemon.slots and slot.owner is None
    assert node.daemon.metrics.lease_lost == 1
    lost = [e for e in node.store.read_events("t1")[0] if e.get("event") == "lease_lost"]
    assert len(lost) == 1 and lost[0]["level"] == "warning"
    assert node.store.leases() == {"t1": "b"}


def test_a_task_the_daemon_gives_back_is_released_to_the_queue(
    node: Node, cluster: MemoryCluster
) -> None:
    node.placement.join(lambda: None)
    submit(node, "t1")
    node.placement.schedule(1, node.clock())
    slot = node.daemon.slots["t1"]
    node.daemon.save(slot, TaskStatus.QUEUED, reason=None)  # (no worker: a release)
    assert node.store.leases() == {} and "t1" not in node.daemon.slots
    (again,) = cluster.store("b", lease=LEASE).claim(1)
    assert again.task_id == "t1" and again.previous is None


def test_a_daemon_superseded_by_its_names_next_daemon_stops_and_claims_nothing(
    node: Node, cluster: MemoryCluster
) -> None:
    node.placement.join(lambda: None)
    submit(node, "t1")
    submit(node, "t2")
    node.placement.schedule(1, node.clock())
    assert list(node.daemon.slots) == ["t1"]
    successor = cluster.store("a", lease=LEASE)
    assert successor.join(2) == 2  # (the same process: a restart of the node's daemon)
    node.ticks(LEASE / 3)
    assert node.daemon.slots == {} and node.daemon.metrics.lease_lost == 1
    node.placement.schedule(4, node.clock())
    assert node.started == ["t1"]  # nothing claimed since
    successor.leave()
    node.ticks(LEASE / 3)  # the name is free: registered again, under the next epoch
    assert [(n.name, n.epoch) for n in successor.nodes()] == [("a", 3)]
    node.placement.schedule(4, node.clock())
    assert node.started == ["t1", "t2"]


def test_a_task_whose_node_stopped_renewing_is_claimed_here_and_said_adopted(
    node: Node, cluster: MemoryCluster
) -> None:
    """docs/design.md section 8's ``task_adopted``: the claim of a lease another node let
    stand still (it died, froze, or lost the database) says whose it was."""
    node.placement.join(lambda: None)
    submit(node, "t1")
    other = cluster.store("b", lease=LEASE)
    (held,) = other.claim(1)  # b runs t1, then stops renewing
    assert held.task_id == "t1" and node.store.leases() == {"t1": "b"}
    for _ in range(6):
        node.clock.advance(LEASE / 4)
        node.placement.schedule(1, node.clock())
    assert node.started == ["t1"] and node.store.leases() == {"t1": "a"}
    events = node.store.read_events("t1")[0]
    (claimed,) = [e for e in events if e["event"] == Event.TASK_CLAIMED]
    assert claimed["node"] == "a" and claimed["taken_over"]["node"] == "b"
    (adopted,) = [e for e in events if e["event"] == Event.TASK_ADOPTED]
    assert adopted["node"] == "a" and adopted["from_node"] == "b"
    assert adopted["level"] == "info"


def test_a_fresh_claim_is_not_said_adopted(node: Node) -> None:
    node.placement.join(lambda: None)
    submit(node, "t1")
    node.placement.schedule(1, node.clock())
    events = node.store.read_events("t1")[0]
    assert [e["event"] for e in events if e["event"].startswith("task_")] == [
        Event.TASK_SUBMITTED,
        Event.TASK_CLAIMED,
    ]


def test_every_claim_of_one_round_is_told_before_any_of_its_workers_starts(node: Node) -> None:
    """A takeover of many tasks: each ``task_claimed`` is stamped when the claim was made,
    not after the workers of the tasks claimed with it started."""
    node.placement.join(lambda: None)
    for name in ("t1", "t2", "t3"):
        submit(node, name)
    told_at_start: list[int] = []

    def start(slot: TaskSlot) -> None:
        claims = [node.store.read_events(t)[0] for t in ("t1", "t2", "t3")]
        told_at_start.append(sum(e["event"] == Event.TASK_CLAIMED for es in claims for e in es))

    node.daemon.launcher.start = start  # type: ignore[method-assign]
    node.placement.schedule(3, node.clock())
    assert told_at_start == [3, 3, 3]
