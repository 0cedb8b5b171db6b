"""The in-memory cluster's own promises (``worker.store.memshared``), beyond the cluster
conformance suite it passes with PostgreSQL: what its clock decides (a backoff's end, a
pause's end, a node's liveness) and a daemon of another process, both of which the
suite cannot move on a real server."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.store.memshared import MemoryCluster
from worker.testing.shared_conformance import ManualClock, new_task

LEASE = 30.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_backoff_and_a_pause_end_on_the_clusters_clock(clock: ManualClock) -> None:
    a = MemoryCluster(clock=clock).store("a", lease=LEASE)
    new_task(a, "t1")
    new_task(a, "t2")
    (owner,) = a.claim(1)
    a.put_record(owner, {"state": "backoff"}, release=True, runnable_in=60.0)
    a.request_pause("t2", 120.0)
    assert a.claim(5) == []
    clock.advance(60.0)
    assert [o.task_id for o in a.claim(5)] == ["t1"]
    assert a.pause_requested("t2")
    clock.advance(60.0)
    assert not a.pause_requested("t2")
    assert [o.task_id for o in a.claim(5)] == ["t2"]


def test_a_node_that_stops_renewing_is_not_alive_and_its_name_is_free(clock: ManualClock) -> None:
    cluster = MemoryCluster(clock=clock)
    frozen, elsewhere = cluster.store("a", lease=LEASE), cluster.store("a", lease=LEASE, pid=1)
    assert frozen.join(2) == 1
    with pytest.raises(ConfigError, match=r"in use by a live node \(pid \d+"):
        elsewhere.join(2)  # a daemon of another process: not while the first renews
    clock.advance(LEASE / 2)
    frozen.renew_all([])
    clock.advance(LEASE / 2)
    ((node),) = elsewhere.nodes()
    assert node.alive and node.heartbeat_age == pytest.approx(LEASE / 2)
    with pytest.raises(ConfigError):
        elsewhere.join(2)
    clock.advance(LEASE / 2 + 1.0)
    ((node),) = elsewhere.nodes()
    assert not node.alive
    assert elsewhere.join(2) == 2
    ((node),) = frozen.nodes()
    assert (node.pid, node.epoch, node.alive) == (1, 2, True)
