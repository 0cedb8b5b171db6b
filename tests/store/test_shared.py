"""The cluster's part of the PostgreSQL store (``SharedStore``), on a real server: the
queue (claims that never hand one task to two nodes), hand-overs and releases fenced by
the epoch, batch renewals, the node table, the operator lock shared by every node, and
the NOTIFY wake-ups."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.console.tokens import SpoolTokens, TokenStore, bearer, listed, mint, revoke
from tests.store.conftest import new_task
from tests.support import poll_for
from worker.errors import (
    ConfigError,
    FencedError,
    LockBusyError,
    NotFoundError,
    RecordConflictError,
    SupersededError,
)
from worker.spool import Spool, TaskSpec
from worker.store.postgres import PostgresStore


def gone_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def two(postgres_schema: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    a = PostgresStore(postgres_schema, node="a", lease=30.0, migrate=True)
    b = PostgresStore(postgres_schema, node="b", lease=30.0)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_racing_claims_never_give_one_task_to_two_nodes(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    ids = [new_task(a, f"t{n}") for n in range(40)]
    got: dict[str, list[str]] = {"a": [], "b": []}

    def claimer(store: PostgresStore) -> None:
        while owners := store.claim(3):
            got[store.node] += [o.task_id for o in owners]

    threads = [threading.Thread(target=claimer, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got["a"] + got["b"]) == sorted(ids)  # each once, none lost
    assert a.leases() == {**dict.fromkeys(got["a"], "a"), **dict.fromkeys(got["b"], "b")}
    record, _ = a.get_record(ids[0])
    assert record is not None and record["state"] == "running"  # the record says so too


def test_a_claim_skips_live_leases_held_tasks_and_the_excluded(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    new_task(a, "q1")
    new_task(a, "q2")
    a.create(TaskSpec(id="h1", prompt="p"), {"state": "held"})
    assert [o.task_id for o in a.claim(5, exclude=["q1"])] == ["q2"]
    assert b.claim(5, exclude=["q1"]) == []  # q2 is leased, h1 held
    assert [o.task_id for o in b.claim(5)] == ["q1"]


def test_a_handover_fences_the_last_worker_and_a_release_ends_the_lease(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    task = new_task(a)
    (first,) = a.claim(1)
    second = a.handover(first)
    assert second.epoch > first.epoch
    with pytest.raises(FencedError):
        a.handover(first)
    with pytest.raises(FencedError):
        a.put_record(first, {"state": "done"}, release=True)
    a.put_record(second, {"state": "running", "pid": 7}, release=False)
    assert a.leases() == {task: "a"}
    a.put_record(second, {"state": "backoff"}, release=True, runnable_in=30.0)
    assert a.leases() == {} and b.claim(1) == []  # its backoff is not over
    a.put_record(
        a.acquire(task), {"state": "queued"}, release=True
    )  # (an operator's pause ends the same way)
    assert [o.task_id for o in b.claim(1)] == [task]
    with pytest.raises(FencedError):
        a.put_record(second, {"state": "done"}, release=True)


def test_a_batch_renewal_names_the_leases_that_moved(
    two: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = two
    for n in range(3):
        new_task(a, f"t{n}")
    owners = a.claim(3)
    taken = b.handover(owners[1])  # (as if b had claimed it after a's lease ran out)
    assert a.renew_all(owners) == [owners[1]]
    assert b.renew_all([taken]) == []
    assert a.renew_all([]) == []


def test_nodes_join_are_listed_and_a_live_name_is_not_taken_twice(
    two: tuple[PostgresStore, PostgresStore], postgres_schema: str
) -> None:
    a, b = two
    a.join(4)
    b.join(2)
    new_task(a)
    (claimed,) = a.claim(1)
    listed = {n.name: n for n in a.nodes()}
    assert set(listed) == {"a", "b"}
    assert listed["a"].tasks == 1 and listed["b"].tasks == 0 and listed["a"].max_workers == 4
    assert all(n.alive and n.heartbeat_age < 5 for n in listed.values())
    a.join(4)  # the same process again: a renewal, no refusal
    impostor = PostgresStore(postgres_schema, node="a")
    try:
        with impostor.db.step() as conn:  # a live node of this name on another machine
            conn.execute("UPDATE nodes SET host = 'elsewhere' WHERE name = 'a'")
        with pytest.raises(ConfigError, match="in use by a live node"):
            impostor.join(1)
        with impostor.db.step() as conn:  # this node's last life on this host, crashed
            conn.execute(
                "UPDATE nodes SET host = %s, pid = %s WHERE name = 'a'",
                (socket.gethostname(), gone_pid()),
            )
        impostor.join(1)  # restarted at once: not refused
    finally:
        impostor.close()
    b.leave()
    assert [n.name for n in a.nodes()] == ["a"]
    assert claimed.task_id == "t1"


def test_a_node_registered_again_elsewhere_supersedes_the_first_registration(
    two: tuple[PostgresStore, PostgresStore], postgres_schema: str
) -> None:
    a, _ = two
    assert a.join(2) == 1
    for n in range(2):
        new_task(a, f"t{n}")
    (held,) = a.claim(1)
    with a.db.step() as conn:  # a frozen past its lease: its row is stale
        conn.execute("UPDATE nodes SET seen_at = now() - interval '1 hour'")
    thawed = a
    again = PostgresStore(postgres_schema, node="a", lease=30.0)
    try:
        assert again.join(2) == 2  # the name's next epoch
        with pytest.raises(SupersededError) as caught:
            thawed.renew_all([held])
        assert caught.value.epoch == 1 and caught.value.now is not None
        assert caught.value.now[0] == 2 and "epoch 2" in str(caught.value)
        assert thawed.claim(5) == []  # the claim checks the registration too
        with pytest.raises(FencedError):
            thawed.handover(held)
        assert thawed.leases() == {"t0": "a"}  # (its lease was not renewed, nor moved)
        ((listed),) = thawed.nodes()
        assert (listed.name, listed.epoch) == ("a", 2)
        with pytest.raises(ConfigError, match="in use by a live node"):
            thawed.join(2)  # not while the other one renews: no flapping
        assert again.renew_all([]) == []
        again.leave()
        assert thawed.nodes() == []  # a daemon that left is no node
        assert thawed.join(2) == 3  # the name is free: a fresh epoch, never an old one
        assert [o.task_id for o in thawed.claim(5)] == ["t1"]
    finally:
        again.close()


def test_the_operator_lock_holds_across_stores(two: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two
    task = new_task(a)
    with a.operator_lock(task, 1.0):
        started = time.monotonic()
        with pytest.raises(LockBusyError), b.operator_lock(task, 0.3):
            pass
        assert time.monotonic() - started >= 0.3
    with b.operator_lock(task, 1.0):  # released with the block
        pass


def test_a_wake_reaches_every_listener(two: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = two
    task = new_task(a)
    woken = threading.Event()
    stop = b.listen(woken.set)
    try:
        poll_for(woken.is_set, 10, what="the listener's first wake-up (on connecting)")
        woken.clear()
        a.wake(task)
        assert woken.wait(5)
    finally:
        stop()


def test_console_tokens_are_shared_by_every_node_and_kept_as_digests(
    two: tuple[PostgresStore, PostgresStore], tmp_path: Path
) -> None:
    """An API token minted through one node's store is found through another's (its
    digest, never the token, in the table); revoked through either, it is gone for both.
    The spool's file keeps the same promises (``SpoolTokens``)."""
    a, b = two
    spool = SpoolTokens(Spool(tmp_path))
    pairs: list[tuple[TokenStore, TokenStore]] = [(a, b), (spool, spool)]
    for minting, reading in pairs:
        token, secret = mint(minting, "erin")
        found = bearer(reading, secret)
        assert found == token and found is not None and found.by == "erin"
        assert secret not in str(reading.tokens())
        with pytest.raises(RecordConflictError):
            minting.add_token(token.to_json())
        assert bearer(reading, secret + "x") is None and bearer(reading, "nope") is None
        assert [t.id for t in listed(reading)] == [token.id]
        revoke(reading, token.id)
        assert bearer(minting, secret) is None
        with pytest.raises(NotFoundError):
            revoke(minting, token.id)
