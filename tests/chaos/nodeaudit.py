"""The audit of chaos class 21 (``tests.chaos.nodes``): the database read directly, and
the figures of one run as a function of what the cluster left (journal rows, lifecycle
events, the effects log, the faults delivered), so that each can be checked on made-up
inputs (``tests/test_chaos_nodes.py``)."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.chaos import kill9
from tests.daemon import parse_time
from tests.support import assert_paired
from worker.state import fold

JSON = dict[str, Any]
FINAL = frozenset({"done", "failed", "cancelled"})
#: How long a read of the harness waits for a database that restarts or recovers.
PATIENCE = 60.0


def connect(url: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """A connection for the harness, which waits out a database that restarts or
    recovers (a fault of the class: the nodes wait it out too)."""
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            return psycopg.connect(url, connect_timeout=5, autocommit=autocommit)
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


#: The effect class of each chaos tool (the frozen tool's slow charge is unsafe too).
EFFECT_OF = {**kill9.EFFECT_OF, "chaos_slow_charge": "unsafe"}


# -- the database, read directly ---------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One journal row: the record, and the epoch of the lease that wrote it."""

    seq: int
    epoch: int
    record: JSON


def journal_rows(url: str) -> dict[str, list[Row]]:
    """Every task's journal rows in order, straight from the journal table."""
    rows: dict[str, list[Row]] = {}
    with connect(url) as conn:
        for task, seq, epoch, record in conn.execute(
            "SELECT task, seq, epoch, record FROM journal ORDER BY task, seq"
        ):
            rows.setdefault(task, []).append(Row(int(seq), int(epoch), json.loads(bytes(record))))
    return rows


def events_named(url: str, name: str) -> dict[str, list[JSON]]:
    """Every task's lifecycle events called ``name``, in order, from the events table."""
    found: dict[str, list[JSON]] = {}
    with connect(url) as conn:
        for task, event in conn.execute(
            "SELECT task, event FROM events WHERE event->>'event' = %s ORDER BY task, n", (name,)
        ):
            found.setdefault(task, []).append(event)
    return found


#: A claim: the epoch it took, the node, and when (Unix time).
Claim = tuple[int, str, float]


def claims_of(events: dict[str, list[JSON]]) -> dict[str, list[Claim]]:
    """The ``task_claimed`` events of each task as claims (malformed ones left out)."""
    found: dict[str, list[Claim]] = {}
    for task, named in events.items():
        for event in named:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                claim = (int(event["epoch"]), str(event["node"]), parse_time(event["timestamp"]))
                found.setdefault(task, []).append(claim)
    return found


def leases_of(url: str, node: str) -> dict[str, int]:
    """The tasks whose lease ``node`` holds, and its epoch of each."""
    with connect(url) as conn:
        return {
            task: int(epoch)
            for task, epoch in conn.execute(
                "SELECT id, epoch FROM tasks WHERE node = %s AND lease_expires IS NOT NULL",
                (node,),
            )
        }


@dataclass
class Fault:
    """One fault delivered: what, to whom, when (Unix time), and the leases its victim held."""

    kind: str
    node: str | None
    at: float
    held: dict[str, int] = field(default_factory=dict)  # task -> epoch
    processes: int = 0


# -- the audit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Takeover:
    """One task of a node that died: seconds from the fault to another node's claim of it
    (None: no claim event) and to its next step under the new lease; what that step was."""

    claim: float | None
    step: float
    what: str


@dataclass
class Audit:
    tasks: int = 0
    lost: int = 0
    completed: int = 0
    steps_lost: int = 0
    doubled: int = 0
    fenced_records: int = 0
    runs_without_intent: int = 0
    unsafe_repeated: int = 0
    keyed_repeated: int = 0
    effects_missing: int = 0
    unpaired: int = 0
    held_ran: int = 0  # holds of a call that had run, on a task no node took over
    failover: dict[str, list[Takeover]] = field(default_factory=dict)  # by fault kind
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 4:
            self.examples.append(what)


def audit(
    turns: dict[str, int],
    status: dict[str, JSON],
    rows: dict[str, list[Row]],
    claimed: dict[str, list[Claim]],
    seen: list[dict[str, list[Row]]],
    effects: list[JSON],
    faults: list[Fault],
    *,
    others: Collection[str] = (),
    skewed: Collection[Skew] = (),
) -> Audit:
    """The figures of one run, from what the cluster left: the status rows, the journal
    rows, the ``task_claimed`` events, the journals read at each fault and the effects log.
    A function of its inputs alone, so that it can be checked on made-up ones.

    ``others`` are tasks of a fate of their own (the frozen tool's: cancelled, rewound),
    audited for their steps and effects but not counted as tasks to complete; ``skewed``
    the nodes whose wall clock was stepped, and when (``fenced``)."""
    out = Audit(tasks=len(turns))
    intents: Counter[str] = Counter()
    completed: set[str] = set()
    for task in sorted({*turns, *others}):
        row = status.get(task)
        mine = rows.get(task, [])
        state = fold("", [r.record for r in mine])
        live = [t.turn for t in state.turns if not t.rewound]
        out.doubled += len(live) - len(set(live))
        if task in turns:
            if row is None or row["state"] not in FINAL:
                out.lost += 1
                where = f"{row['state']} at turn {row.get('turn')} of {turns[task]}" if row else ""
                out.note(f"{task}: {where or 'missing from status'}")
            done = row is not None and (row["state"], row.get("reason")) == ("done", "end_turn")
            if done and sorted(live) == list(range(1, turns[task] + 1)):
                completed.add(task)
            elif row is not None and row["state"] in FINAL:
                out.note(f"{task}: {row['state']} ({row.get('reason')}), turns {live}")
        try:  # (a task cancelled mid-call is never sent again: its last call stays open)
            cancelled = row is not None and row["state"] == "cancelled"
            assert_paired(state.messages, allow_pending=cancelled)
        except AssertionError as exc:
            out.unpaired += 1
            out.note(f"{task}: {exc}")
        out.fenced_records += fenced(task, mine, claimed.get(task, []), out, skewed)
        final = {(r.seq, r.epoch, json.dumps(r.record, sort_keys=True)) for r in mine}
        for earlier in seen:
            gone = [
                r
                for r in earlier.get(task, [])
                if (r.seq, r.epoch, json.dumps(r.record, sort_keys=True)) not in final
            ]
            out.steps_lost += len(gone)
            if gone:
                out.note(f"{task}: row {gone[0].seq} seen at a fault is gone or changed")
        intents.update(r.record["call_id"] for r in mine if r.record.get("k") == "intent")

    out.completed = len(completed)
    effects_of: Counter[str] = Counter()
    runs: Counter[str] = Counter()
    for line in effects:
        if line.get("kind") == "effect":
            effects_of[str(line.get("tag"))] += 1
        if line.get("kind") in ("exec", "effect", "dup"):
            runs[str(line.get("call_id"))] += 1
    for call_id, count in runs.items():
        if count > intents[call_id]:
            out.runs_without_intent += count - intents[call_id]
            out.note(f"call {call_id} ran {count} times with {intents[call_id]} intents")
    for task in sorted({*turns, *others}):
        out.held_ran += held_after_it_ran(task, rows.get(task, []), effects, out)
        for block in _uses(rows.get(task, [])):
            kind = EFFECT_OF.get(block["name"], "")
            tag = str(block["input"].get("tag"))
            if kind in ("unsafe", "keyed") and effects_of[tag] > 1:
                setattr(out, f"{kind}_repeated", getattr(out, f"{kind}_repeated") + 1)
                out.note(f"{kind} operation {tag} took effect {effects_of[tag]} times")
            elif kind in ("unsafe", "keyed") and effects_of[tag] == 0 and task in completed:
                out.effects_missing += 1
                out.note(f"{kind} operation {tag} never took effect")

    for fault in faults:
        for task, epoch in fault.held.items():
            later = [(s, r) for r in rows.get(task, []) if r.epoch > epoch and (s := stamped(r))]
            if not later:
                continue
            took = [(node, at) for e, node, at in claimed.get(task, []) if e > epoch][:1]
            claim = took[0][1] - fault.at if took else None
            by = "".join(f", claimed by {n} at {at - fault.at:.1f} s" for n, at in took)
            seconds, first = later[0][0] - fault.at, later[0][1]
            step = " ".join(str(first.record.get(k, "")) for k in ("k", "tool", "call_id")).strip()
            what = f"{task} of {fault.node}{by}, next step ({step}) at {seconds:.1f} s"
            out.failover.setdefault(fault.kind, []).append(Takeover(claim, seconds, what))
    return out


def _uses(rows: list[Row]) -> list[JSON]:
    """The tool_use blocks of a task's recorded turns (what its transcript asked for)."""
    return [
        block
        for r in rows
        if r.record.get("k") == "turn"
        for block in r.record["message"]["content"]
        if block.get("type") == "tool_use"
    ]


def held_after_it_ran(task: str, rows: list[Row], effects: list[JSON], out: Audit) -> int:
    """Holds of a call that had run (an effect of it logged before the hold), on a task
    whose holder no node took over: a call whose result the worker had in hand, held for
    an operator anyway (a hold on a task taken over from a node that stopped renewing
    names that node, and is the rule: invariant 2)."""
    ran: dict[str, list[float]] = {}
    for line in effects:
        if line.get("kind") in ("effect", "dup") and isinstance(line.get("at"), int | float):
            ran.setdefault(str(line.get("call_id")), []).append(float(line["at"]))
    count = 0
    for r in rows:
        if r.record.get("k") != "hold" or (at := stamped(r)) is None:
            continue
        for call in r.record.get("calls", []):
            if "it was running on node" in str(call.get("why")):
                continue
            if any(t < at for t in ran.get(str(call.get("call_id")), [])):
                count += 1
                out.note(f"{task}: call {call.get('call_id')} held after it ran: {call.get('why')}")
    return count


#: A node whose wall clock was stepped, and the span of stamps it may have written then:
#: (node, first, last), Unix time as its stepped clock read it.
Skew = tuple[str, float, float]


def fenced(
    task: str,
    rows: list[Row],
    claimed: list[Claim],
    out: Audit,
    skewed: Collection[Skew] = (),
) -> int:
    """Rows written by an owner whose lease had already moved on: an epoch below an earlier
    row's (the old owner wrote after its successor did), or a row stamped after the claim of
    a later epoch (the old owner wrote after its successor took the task). A row or claim
    stamped by a node while its wall clock was stepped (``skewed``) is judged by the
    epochs' order alone: its stamp says nothing of when it was written."""

    def askew(node: str | None, stamp: float) -> bool:
        return any(node == name and first <= stamp <= last for name, first, last in skewed)

    trusted = [(e, node, at) for e, node, at in claimed if not askew(node, at)]
    bad = 0
    highest = 0
    for r in rows:
        stamp = stamped(r)
        if stamp is not None and askew(writer(r.epoch, claimed), stamp):
            stamp = None
        later = [e for e, _, at in trusted if e > r.epoch and stamp is not None and at < stamp]
        if r.epoch < highest:
            out.note(f"{task}: row {r.seq} of epoch {r.epoch} after one of epoch {highest}")
        elif later:
            out.note(
                f"{task}: row {r.seq} of epoch {r.epoch} stamped after epoch {later[0]}'s claim"
            )
        bad += r.epoch < highest or bool(later)
        highest = max(highest, r.epoch)
    return bad


def writer(epoch: int, claimed: list[Claim]) -> str | None:
    """The node that wrote under ``epoch``: the one whose claim came last at or before it
    (a node's own restarts take further epochs, and claim nothing)."""
    before = [(e, node) for e, node, _ in claimed if e <= epoch]
    return max(before)[1] if before else None


def stamped(row: Row) -> float | None:
    """When the worker stamped a record (Unix time); None for one without a stamp."""
    try:
        return parse_time(str(row.record["at"]))
    except (KeyError, ValueError):
        return None


def effects_after(effects: list[JSON], cancels: list[Cancel]) -> list[JSON]:
    """Effects of a cancelled task logged after its cancel returned ``cancelled``, but the
    call the cancel named, within the time it said that call may still complete."""
    late = []
    for cancel in cancels:
        for line in effects:
            if line.get("kind") != "effect" or not str(line.get("tag", "")).startswith(
                f"{cancel.task}."
            ):
                continue
            at = float(line.get("at", 0.0))
            announced = line.get("call_id") == cancel.call and at <= cancel.at + cancel.ends_in
            if at > cancel.at and not announced:
                late.append(line)
    return late


@dataclass(frozen=True)
class Cancel:
    """A cancel that returned ``cancelled`` (Unix time ``at``), the call it said may still
    complete, and for how long."""

    task: str
    at: float
    call: str | None
    ends_in: float


def event_marks(url: str) -> dict[str, int]:
    """Each task's last event number now: events after it came later (their order is the
    commits', whatever any clock said)."""
    with connect(url) as conn:
        return {task: int(n) for task, n in conn.execute("SELECT id, events FROM tasks")}


def moved_since(url: str, marks: Mapping[str, int]) -> list[JSON]:
    """The leases that moved after ``marks`` (``event_marks``): a claim that took a lease
    over (``taken_over``), and a worker fenced (``lease_lost``)."""
    moved = []
    with connect(url) as conn:
        for task, n, event in conn.execute(
            "SELECT task, n, event FROM events WHERE event->>'event' IN "
            "('task_claimed', 'lease_lost') ORDER BY task, n"
        ):
            if n > marks.get(task, 0) and (
                event.get("event") == "lease_lost" or "taken_over" in event
            ):
                moved.append({"task": task, **event})
    return moved
