"""``supervisor.coordination``: one spool's and a shared store's coordination keep the
same promises (the operator lock, offline, a pause asked and ended, a ring), each its own
way; a shared store's is tested on the in-memory cluster, without a database server.
End to end on PostgreSQL: ``test_cluster.py``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.coordination import (
    ClusterCoordination,
    Coordination,
    SpoolCoordination,
    SupervisorLock,
    coordination,
)
from tests.support import reply, scripted_task, text
from worker.errors import StateConflictError
from worker.spool import Spool, TaskDir
from worker.store.memshared import MemoryCluster
from worker.testing.shared_conformance import ManualClock, new_task

LEASE = 30.0


@pytest.fixture(params=["spool", "cluster"])
def setting(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Coordination, TaskDir, Spool]]:
    spool = Spool(tmp_path / "spool").ensure()
    if request.param == "spool":
        task = scripted_task(spool, [reply(text("done"))], name="t1")
        yield SpoolCoordination(spool), task, spool
        return
    cluster = MemoryCluster(clock=ManualClock()).store("a", lease=LEASE)
    new_task(cluster, "t1")
    spool = spool.on(cluster)
    yield ClusterCoordination(cluster), spool.task("t1"), spool


def test_a_spool_s_coordination_is_its_shared_store_s_when_it_is_on_one(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool")
    assert isinstance(coordination(spool), SpoolCoordination)
    cluster = MemoryCluster(clock=ManualClock()).store("a", lease=LEASE)
    chosen = coordination(spool.on(cluster))
    assert isinstance(chosen, ClusterCoordination) and chosen.cluster is cluster
    task = spool.on(cluster).task("t1")  # a task of it, and the spool it is in, the same
    again = coordination(task.spool)
    assert task.shared is cluster and isinstance(again, ClusterCoordination)
    assert spool.task("t1").shared is None  # (its own files: the cache keeps them apart)


def test_the_operator_lock_lets_one_command_in_at_a_time(
    setting: tuple[Coordination, TaskDir, Spool],
) -> None:
    co, task, _ = setting
    with co.operator_lock(task, wait=1.0):
        failed: list[BaseException] = []

        def second() -> None:  # (another command: a thread of its own)
            try:
                with co.operator_lock(task, wait=0.2):
                    pass
            except StateConflictError as exc:
                failed.append(exc)

        other = threading.Thread(target=second)
        other.start()
        other.join(5)
        assert len(failed) == 1 and "did not end within 0.2 s" in str(failed[0])
    with co.operator_lock(task, wait=0.2):  # let go: the next one gets in
        pass


def test_a_pause_is_seen_until_it_ends(setting: tuple[Coordination, TaskDir, Spool]) -> None:
    co, task, _ = setting
    assert not co.pause_requested(task)
    patience = co.ask_pause(task, 5.0)
    assert co.pause_requested(task)
    co.end_pause(task)
    assert not co.pause_requested(task)
    # with no daemon on the spool nobody is asked to stop, so nobody is waited for long;
    # on a shared store a node is, for the whole wait
    assert patience == (5.0 if isinstance(co, ClusterCoordination) else 0.2)


def test_offline_on_a_spool_is_holding_the_supervisor_lock(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool").ensure()
    co = SpoolCoordination(spool)
    with co.offline() as alone:
        assert alone  # no daemon: the command writes the record itself
    daemon = SupervisorLock(spool)
    daemon.acquire()  # (a daemon runs)
    try:
        with co.offline() as alone:
            assert not alone  # it leaves a request for the daemon
    finally:
        daemon.release()
    assert co.settle_time(3.0) == 3.0 and co.seize("t1") is None and co.nobody_applies()


def test_on_a_shared_store_a_command_is_always_offline_and_waits_out_a_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = MemoryCluster(clock=ManualClock()).store("a", lease=LEASE)
    co = ClusterCoordination(cluster)
    with co.offline() as alone:
        assert alone  # the database's compare-and-set settles who wins
    assert co.settle_time(3.0) == LEASE and not co.nobody_applies()
    new_task(cluster, "t1")
    assert not co.runs_elsewhere(Spool(tmp_path).task("t1"))
    (owner,) = cluster.claim(1)
    assert co.runs_elsewhere(Spool(tmp_path).task("t1"))  # its node's to cancel
    assert owner.task_id == "t1"


def test_a_ring_reaches_the_daemon_s_inbox_or_every_node(
    setting: tuple[Coordination, TaskDir, Spool],
) -> None:
    co, task, spool = setting
    if isinstance(co, SpoolCoordination):
        co.ring(task.id)
        assert [p.name.split(".")[0] for p in spool.inbox.iterdir()] == [task.id]
        return
    assert isinstance(co, ClusterCoordination)
    woken = threading.Event()
    stop = co.cluster.listen(woken.set)
    with contextlib.ExitStack() as done:
        done.callback(stop)
        assert woken.wait(5)  # (a listener is called once as it starts)
        woken.clear()
        co.ring(task.id)
        assert woken.wait(5)
