"""The fenced append, the claim and the renewal (worker/store/pglease.py), on a real
PostgreSQL: fencing, SKIP LOCKED races between real connections, round trips counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.postgres import SeverableProxy
from tests.support import poll_for
from worker.errors import FencedError, NotFoundError
from worker.store import pgschema
from worker.store.pglease import TAKEOVER_MARGIN, Held, Lease, LeaseWatch, append, claim, renew

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def db(postgres_schema: str) -> Iterator[str]:
    """A URL of a migrated, empty schema."""
    with psycopg.connect(postgres_schema, autocommit=True) as conn:
        pgschema.migrate(conn)
    yield postgres_schema


def connect(url: str) -> Conn:
    return psycopg.connect(url, autocommit=True)


def add_tasks(conn: Conn, *ids: str, state: str = "queued", after: str = "0 s") -> None:
    for task_id in ids:
        conn.execute(
            "INSERT INTO tasks (id, spec, state, runnable_at) "
            "VALUES (%s, '{}', %s, now() + %s::interval)",
            (task_id, state, after),
        )


def journal(conn: Conn, task_id: str) -> list[tuple[int, int, bytes]]:
    rows = conn.execute(
        "SELECT seq, epoch, record FROM journal WHERE task = %s ORDER BY seq", (task_id,)
    ).fetchall()
    return [(seq, epoch, bytes(record)) for seq, epoch, record in rows]


def only(leases: list[Lease]) -> Lease:
    assert len(leases) == 1, leases
    return leases[0]


# -- the fenced append -----------------------------------------------------------------


def test_appends_under_the_lease_record_in_order_and_advance_the_seq(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        lease = only(claim(conn, "a", 1, 30))
        assert (lease.epoch, lease.seq) == (1, 0)
        assert append(conn, "t1", lease.epoch, 0, [b"header"]) == 1
        assert append(conn, "t1", lease.epoch, 1, [b"turn 1", b"result 1"]) == 3
        assert append(conn, "t1", lease.epoch, 3, []) == 3
        assert journal(conn, "t1") == [(1, 1, b"header"), (2, 1, b"turn 1"), (3, 1, b"result 1")]
        assert conn.execute("SELECT seq FROM tasks WHERE id = 't1'").fetchone() == (3,)


def test_an_append_after_a_takeover_records_nothing(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        old = only(claim(conn, "a", 1, 0.2))
        append(conn, "t1", old.epoch, 0, [b"one"])
        watch = LeaseWatch()  # node b's
        new = only(poll_for(lambda: claim(conn, "b", 1, 30, watch=watch), what="the lease's end"))
        assert (new.epoch, new.seq, new.node) == (old.epoch + 1, 1, "b")

        with pytest.raises(FencedError, match="lease moved to epoch 2") as caught:
            append(conn, "t1", old.epoch, 1, [b"two from the old owner", b"and more"])
        assert "\n" not in str(caught.value)
        assert journal(conn, "t1") == [(1, 1, b"one")]
        assert conn.execute("SELECT seq FROM tasks WHERE id = 't1'").fetchone() == (1,)

        assert append(conn, "t1", new.epoch, new.seq, [b"two"]) == 2
        assert journal(conn, "t1") == [(1, 1, b"one"), (2, 2, b"two")]


def test_an_append_after_a_stale_seq_records_nothing(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        lease = only(claim(conn, "a", 1, 30))
        append(conn, "t1", lease.epoch, 0, [b"one", b"two"])
        for stale in (0, 1, 3):
            with pytest.raises(FencedError, match=f"at seq 2, not {stale}"):
                append(conn, "t1", lease.epoch, stale, [b"other"])
        assert journal(conn, "t1") == [(1, 1, b"one"), (2, 1, b"two")]


def test_retrying_an_append_that_committed_unseen_is_not_a_second_step(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        lease = only(claim(conn, "a", 1, 30))
        assert append(conn, "t1", lease.epoch, 0, [b"one", b"two"]) == 2
        assert append(conn, "t1", lease.epoch, 0, [b"one", b"two"]) == 2  # the retry
        assert journal(conn, "t1") == [(1, 1, b"one"), (2, 1, b"two")]


def test_an_append_to_a_missing_task_says_so(db: str) -> None:
    with connect(db) as conn, pytest.raises(NotFoundError, match="no longer exists"):
        append(conn, "gone", 1, 0, [b"x"])


def test_an_append_costs_one_round_trip(db: str, postgres_url: str) -> None:
    """One statement, its own transaction: no BEGIN, no COMMIT, no read of the fence."""
    with SeverableProxy.in_front_of(postgres_url) as proxy, connect(proxy.url_for(db)) as conn:
        add_tasks(conn, "t1")
        lease = only(claim(conn, "a", 1, 30))
        seq = 0
        for _ in range(8):  # past psycopg's prepare_threshold: the steady state
            seq = append(conn, "t1", lease.epoch, seq, [b"x" * 1000])
        before = proxy.exchanges
        for _ in range(5):
            seq = append(conn, "t1", lease.epoch, seq, [b"y" * 1000])
        assert proxy.exchanges - before == 5
        before = proxy.exchanges
        renew(conn, lease, 30)
        assert proxy.exchanges - before == 1


def test_a_connection_cut_before_the_reply_leaves_the_step_whole_or_absent(
    db: str, postgres_url: str
) -> None:
    with connect(db) as setup:
        add_tasks(setup, "t1")
        lease = only(claim(setup, "a", 1, 30))
    with SeverableProxy.in_front_of(postgres_url) as proxy:
        conn = connect(proxy.url_for(db))
        append(conn, "t1", lease.epoch, 0, [b"one"])
        proxy.sever()
        with pytest.raises(psycopg.OperationalError):
            append(conn, "t1", lease.epoch, 1, [b"two", b"three"])
        proxy.restore()
        with connect(proxy.url_for(db)) as again:
            # Whether or not it landed, the retry leaves exactly one copy of the step.
            assert append(again, "t1", lease.epoch, 1, [b"two", b"three"]) == 3
            assert [r for _, _, r in journal(again, "t1")] == [b"one", b"two", b"three"]


# -- the claim -------------------------------------------------------------------------


def test_a_claim_takes_runnable_tasks_up_to_its_limit_oldest_first(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "q1", "q2", "q3")
        add_tasks(conn, "later", state="backoff", after="1 hour")
        add_tasks(conn, "due", state="backoff", after="-1 hour")
        add_tasks(conn, "h", state="held")
        add_tasks(conn, "d", state="done")
        first = claim(conn, "a", 2, 30)
        assert [lease.task_id for lease in first] == ["due", "q1"]
        assert {(lease.node, lease.epoch) for lease in first} == {("a", 1)}
        rest = claim(conn, "b", 10, 30)
        assert [lease.task_id for lease in rest] == ["q2", "q3"]
        assert claim(conn, "c", 10, 30) == []
        assert claim(conn, "c", 0, 30) == []
        rows = conn.execute("SELECT id, state, node FROM tasks ORDER BY id").fetchall()
        assert rows == [("d", "done", None), ("due", "running", "a"), ("h", "held", None),
                        ("later", "backoff", None), ("q1", "running", "a"),
                        ("q2", "running", "b"), ("q3", "running", "b")]  # fmt: skip


def test_a_claim_skips_a_task_another_transaction_has_locked_without_waiting(db: str) -> None:
    with connect(db) as conn, connect(db) as other:
        add_tasks(conn, "t1", "t2")
        with other.transaction():
            other.execute("SELECT id FROM tasks WHERE id = 't1' FOR UPDATE")
            conn.execute("SET statement_timeout = '5s'")  # a wait would fail the test
            assert [lease.task_id for lease in claim(conn, "a", 10, 30)] == ["t2"]
        assert [lease.task_id for lease in claim(conn, "a", 10, 30)] == ["t1"]


def test_racing_nodes_claim_each_task_exactly_once(db: str) -> None:
    tasks = [f"t{n:03}" for n in range(120)]
    with connect(db) as conn:
        add_tasks(conn, *tasks)
    nodes = [f"node-{n}" for n in range(8)]
    claimed: dict[str, list[Lease]] = {node: [] for node in nodes}
    start = threading.Barrier(len(nodes))
    errors: list[BaseException] = []

    def run(node: str) -> None:
        try:
            with connect(db) as mine:
                start.wait(30)
                while leases := claim(mine, node, 3, 60):
                    claimed[node] += leases
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    every = [lease.task_id for leases in claimed.values() for lease in leases]
    assert sorted(every) == tasks  # each task once: none lost, none twice
    assert {lease.epoch for leases in claimed.values() for lease in leases} == {1}
    assert sum(1 for leases in claimed.values() if leases) > 1, "no race happened"
    with connect(db) as conn:
        owners: dict[str, str] = dict(conn.execute("SELECT id, node FROM tasks").fetchall())
    assert all(owners[lease.task_id] == node for node, ls in claimed.items() for lease in ls)


# -- the renewal -----------------------------------------------------------------------


def test_a_renewal_extends_the_lease_while_the_epoch_holds(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        lease = only(claim(conn, "a", 1, 0.5))
        counted = conn.execute("SELECT renewals FROM tasks WHERE id = 't1'").fetchone()
        renewed = renew(conn, lease, 60)
        assert renewed.expires is not None
        assert (renewed.task_id, renewed.epoch) == ("t1", lease.epoch)
        assert counted is not None
        assert conn.execute("SELECT renewals, lease_seconds FROM tasks").fetchone() == (
            counted[0] + 1,
            60.0,
        )  # the count a taker watches moved, and the holder's length is the new one
        assert claim(conn, "b", 1, 30) == []  # still held: the renewal kept it


def test_a_renewal_after_a_takeover_is_refused(db: str) -> None:
    with connect(db) as conn:
        add_tasks(conn, "t1")
        old = only(claim(conn, "a", 1, 0.2))
        watch = LeaseWatch()  # node b's
        new = only(poll_for(lambda: claim(conn, "b", 1, 30, watch=watch), what="the lease's end"))
        with pytest.raises(FencedError, match="taken over"):
            renew(conn, old, 30)
        assert renew(conn, new, 30).epoch == new.epoch


def test_an_append_racing_a_takeover_waits_for_it_and_then_records_nothing(db: str) -> None:
    """The fence is checked on the row as the takeover left it, not as the append's
    snapshot saw it (READ COMMITTED re-checks an updated row)."""
    with connect(db) as conn, connect(db) as taker, connect(db) as watcher:
        add_tasks(conn, "t1")
        old = only(claim(conn, "a", 1, 0.2))
        watch = LeaseWatch()  # node b's: it sees the lease stand still for its length
        assert claim(watcher, "b", 0, 30, watch=watch) == []
        poll_for(lambda: watch.expired(30), what="the lease's end, as node b sees it")
        outcome: list[BaseException | int] = []
        with taker.transaction():
            new = only(claim(taker, "b", 1, 30, watch=watch))  # locked until COMMIT

            def step() -> None:
                try:
                    outcome.append(append(conn, "t1", old.epoch, 0, [b"late"]))
                except BaseException as exc:
                    outcome.append(exc)

            racer = threading.Thread(target=step)
            racer.start()
            poll_for(
                lambda: watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND query LIKE '%WITH fence AS%'"
                ).fetchone() == (1,),
                what="the append to wait on the takeover's row lock",
            )  # fmt: skip
        racer.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], FencedError), outcome
        assert journal(conn, "t1") == []
        assert append(conn, "t1", new.epoch, 0, [b"first"]) == 1


# -- the lease's end: how long a taker saw it stand still ----------------------------------


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_watch_judges_a_lease_over_only_after_it_stood_still_for_its_length_and_the_margin() -> (
    None
):
    clock = Clock()
    watch = LeaseWatch(clock)
    a = Held("t1", "a", 1, 5, lease=2.0)
    b = Held("t2", "b", 1, 9, lease=None)  # (a row of an older release: the reader's lease)
    watch.observe([a, b])
    clock.now += 2.0 + TAKEOVER_MARGIN - 0.01
    watch.observe([a, b])
    assert watch.expired(lease=10.0) == []
    clock.now += 0.01
    assert watch.expired(lease=10.0) == [a]  # b is judged by the reader's 10 s
    watch.observe([Held("t1", "a", 1, 6, lease=2.0), b])  # renewed: it starts over
    assert watch.expired(lease=10.0) == []
    clock.now += 10.0
    watch.observe([b])  # t1 is held no more (released)
    assert watch.expired(lease=10.0) == [b] and watch.still("t1") is None
    assert watch.still("t2") == (b, 2.0 + TAKEOVER_MARGIN + 10.0)
    watch.blind()  # a read failed: the time until the next read does not count
    assert watch.expired(lease=10.0) == []
    clock.now += 5.0
    watch.observe([b])
    assert watch.still("t2") == (b, 2.0 + TAKEOVER_MARGIN + 10.0)


def test_a_lease_taken_over_under_a_new_holder_is_watched_anew() -> None:
    clock = Clock()
    watch = LeaseWatch(clock)
    watch.observe([Held("t1", "a", 1, 5, lease=1.0)])
    clock.now += 1.0
    watch.note(Held("t1", "b", 2, 6, lease=1.0), "t1")  # another node claimed it
    clock.now += 1.0
    assert watch.expired(lease=1.0) == []
    assert watch.still("t1") == (Held("t1", "b", 2, 6, lease=1.0), 1.0)


def test_no_wall_clock_ends_a_lease_that_its_holder_renews(db: str) -> None:
    """The server's clock stepped two minutes on (every lease_expires in the past, as a
    step of the database host's clock leaves it): a taker that watches the leases takes
    none while their holder renews them, and takes one its holder stopped renewing only
    after it saw it stand still for the lease and the margin, on its own clock."""
    with connect(db) as conn, connect(db) as taker:
        add_tasks(conn, "t1", "t2")
        mine = claim(conn, "a", 2, 1.0)
        watch = LeaseWatch()  # node b's
        deadline = time.monotonic() + 3 * (1.0 + TAKEOVER_MARGIN)
        while time.monotonic() < deadline:
            mine = [renew(conn, lease, 1.0) for lease in mine]
            stopped = time.monotonic()  # (a's worker of t1 renews no more after the loop)
            conn.execute("UPDATE tasks SET lease_expires = now() - interval '2 minutes'")
            assert claim(taker, "b", 2, 30, watch=watch) == []
            time.sleep(0.2)
        while not (taken := claim(taker, "b", 2, 30, watch=watch)):
            renew(conn, mine[1], 1.0)
            time.sleep(0.05)
        assert [lease.task_id for lease in taken] == ["t1"]
        assert time.monotonic() - stopped >= 1.0 + TAKEOVER_MARGIN
        (lease,) = taken
        assert lease.previous is not None
        assert (lease.previous.node, lease.previous.epoch) == ("a", mine[0].epoch)


def test_a_watch_counts_no_pause_in_its_reads_past_its_gap() -> None:
    """A node too busy to claim for a while (or stopped) did not see whether the database
    was away meanwhile: the pause past the gap does not count toward a lease standing
    still, and no lease is judged over until the next read."""
    clock = Clock()
    watch = LeaseWatch(clock, gap=1.0)
    held = Held("t1", "a", 1, 5, lease=2.0)
    watch.observe([held])
    for _ in range(3):  # reads every second: one watch
        clock.now += 1.0
        watch.observe([held])
    assert watch.expired(lease=2.0) == [held]
    clock.now += 1.5  # no read for longer than the gap
    assert watch.expired(lease=2.0) == []
    watch.observe([held])
    assert watch.still("t1") == (held, 4.0)  # (the 0.5 s past the gap left out)
    clock.now += 0.5
    watch.observe([held])
    assert watch.expired(lease=2.0) == [held]


def test_a_dead_holder_s_task_is_taken_over_whatever_the_server_s_clock_said_before(
    db: str,
) -> None:
    """A task claimed while the database host's clock ran two minutes ahead keeps that
    time in its row (``runnable_at``, ``lease_expires``); stepped back, the clock must
    keep neither a queued task nor a dead holder's from the other nodes. (Only a
    backoff waits for its time.)"""
    with connect(db) as conn, connect(db) as taker:
        add_tasks(conn, "t1", "t2", after="2 minutes")  # (written while ahead)
        add_tasks(conn, "b1", state="backoff", after="2 minutes")
        (held,) = claim(conn, "a", 1, 1.0)  # t1 or t2: queued, whatever runnable_at says
        watch = LeaseWatch()
        rest = claim(taker, "b", 1, 30, watch=watch)
        assert {held.task_id, *(r.task_id for r in rest)} == {"t1", "t2"}
        (taken,) = poll_for(  # a's holder renews no more: b takes its lease, running
            lambda: claim(taker, "b", 5, 30, watch=watch), 10, interval=0.05, what="takeover"
        )
        assert (taken.task_id, taken.epoch) == (held.task_id, held.epoch + 1)
        assert claim(taker, "b", 5, 30, watch=watch) == []  # the backoff waits its time
