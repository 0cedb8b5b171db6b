"""The faults of chaos class 21 (``tests.chaos.nodes``) that the issue "a cluster that
survives its own faults" added: a frozen node's tool, the database read-only or cut
mid-commit, and wall-clock steps on the database host and on a node. Each is a function
of the cluster and the class's random source that delivers one fault and returns it.

* ``frozen_tool``: a task of its own runs ``chaos_slow_charge`` (an unsafe call of twice
  the lease); the node running it has its whole tree stopped (SIGSTOP) mid-call, and an
  operator on another node then approves the call (once another node holds it), cancels
  the task, or rewinds it past the call; the node is thawed past its lease. The kernel
  kills the frozen worker at its lease's end, so its call never completes: effects done
  twice 0, effects after a cancel 0. What each command said is checked too: the hold
  names the frozen node and when its lease ended, the cancel's line and the rewind's
  ``cut off:`` line name the node and what may still complete.
* ``read_only``: ``default_transaction_read_only`` set for the whole server and every
  session told (``pg_reload_conf``), half the time every session cut as well (a failover
  onto a standby), for longer than the lease; then writable again.
* ``midcommit``: a node's link cut as the server answers the next statement it sent
  (``SeverableProxy.sever_at_reply``: it ran, maybe committed, and the node learns
  nothing), then mended within a second.
* ``db_clock`` and ``node_clock``: a wall-clock step of ±``STEP`` seconds on the database
  host (``DatabaseClock``) or on a node (``NodeClocks``), held past a lease, then back;
  every lease that moved meanwhile (a claim that took one over, a worker fenced) counts.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.chaos.effect_tools import read_log
from tests.chaos.nodeaudit import Cancel, Fault, connect, event_marks, leases_of, moved_since
from tests.chaos.nodeclock import STEP
from tests.chaos.trees import freeze_tree, thaw
from tests.support import poll_for, reply, text

if TYPE_CHECKING:
    from tests.chaos.nodes import Cluster

FROZEN, READ_ONLY, MIDCOMMIT = "frozen tool", "read-only db", "mid-commit cut"
DB_CLOCK, NODE_CLOCK = "db clock step", "node clock step"
#: The faults of the database itself: a node that dies in one died of a database fault.
DATABASE_FAULTS = frozenset({"db restart", READ_ONLY, MIDCOMMIT, DB_CLOCK})
#: What the operator does while a node is frozen mid-call, in turn.
APPROVE, CANCEL, REWIND = "approve", "cancel", "rewind"
ACTIONS = (APPROVE, CANCEL, REWIND)
SLOW_TOOL = "chaos_slow_charge"


@dataclass
class Frozen:
    """One frozen-tool fault: its task, the frozen node, what the operator did, whether
    the command said what it must (``told``), and the cancel when it was one."""

    task: str
    node: str
    action: str
    told: bool = False
    cancel: Cancel | None = None


def frozen_tool(cluster: Cluster, rng: random.Random) -> Fault:
    plan = cluster.plan
    action = ACTIONS[(cluster.first_action + len(cluster.frozen)) % len(ACTIONS)]
    name = f"f{len(cluster.frozen):02d}"
    use = {
        "type": "tool_use",
        "id": f"toolu_{name}_1",
        "name": SLOW_TOOL,
        "input": {"tag": f"{name}.1", "amount": 1, "seconds": 2 * plan.lease + 2},
    }
    script = [reply(text("Charging."), use, delay=0.1), reply(text("Charged."), delay=0.1)]
    cluster.submit_script(name, script, turns=2)
    cluster.extra.add(name)
    row = poll_for(lambda: _running(cluster, name), 60, interval=0.05, what=f"{name}'s slow call")
    node = cluster.nodes[str(row["node"])]
    assert node.proc is not None
    frozen = freeze_tree(node.proc.pid)
    fault = Fault(FROZEN, node.name, time.time(), leases_of(cluster.url, node.name), len(frozen))
    run = Frozen(name, node.name, action)
    cluster.frozen.append(run)
    try:
        {APPROVE: _approve, CANCEL: _cancel, REWIND: _rewind}[action](cluster, run)
    finally:  # thawed once its lease is over: the kernel has killed its worker by then
        time.sleep(max(0.0, fault.at + plan.lease + rng.uniform(1.0, 2.0) - time.time()))
        thaw(frozen)
    time.sleep(2 * plan.interval)  # its fenced workers wake and find out
    return fault


def _running(cluster: Cluster, task: str) -> dict[str, object] | None:
    with contextlib.suppress(Exception):  # (a command refused: ask again)
        row = cluster.rows().get(task)
        if (
            row
            and row["state"] == "running"
            and row["node"]
            and row["phase"] == f"tool:{SLOW_TOOL}"
        ):
            return row
    return None


def _held(cluster: Cluster, task: str) -> dict[str, object] | None:
    with contextlib.suppress(Exception):  # (a node mid-claim: ask again)
        for row in cluster.dangling():
            if row["task"] == task:
                return dict(row)
    return None


def _approve(cluster: Cluster, run: Frozen) -> None:
    """Once another node holds the call: the hold names the frozen node; the operator
    checks the ledger (nothing: the frozen call never completes) and re-runs it."""
    bound = cluster.plan.takeover_bound + 30.0
    held = poll_for(lambda: _held(cluster, run.task), bound, interval=0.2, what="the hold")
    reason = str(cluster.rows()[run.task].get("reason") or "")
    run.told = f"it was running on node {run.node} " in reason and "without a renewal" in reason
    done = [
        line
        for line in read_log(cluster.effects)
        if line.get("call_id") == held["call_id"] and line.get("kind") == "effect"
    ]
    args = ["--result", f"{done[-1]['result']} (verified in the ledger)"] if done else ["--rerun"]
    code, _, _ = cluster.operator.cli("approve-dangling", run.task, str(held["call_id"]), *args)
    cluster.holds_decided += code == 0


_CANCELLED = re.compile(
    r"agentd: (?P<task>\S+) cancelled; node (?P<node>\S+) has not renewed its lease \(ends in "
    r"(?P<ends>\d+\.\d) s\); its running call (?P<call>\S+) may still complete until then\n"
)


def _cancel(cluster: Cluster, run: Frozen) -> None:
    """At once: recorded now, and the line says which node and call, and until when."""
    code, out, _ = cluster.operator.cli("cancel", run.task)
    returned = time.time()
    said = _CANCELLED.fullmatch(out)
    run.told = code == 0 and said is not None and said["node"] == run.node
    if code == 0:
        call, ends = (said["call"], float(said["ends"])) if said else (None, 0.0)
        run.cancel = Cancel(run.task, returned, call, ends)


def _rewind(cluster: Cluster, run: Frozen) -> None:
    """Past the call: the ``cut off:`` line names the frozen node and its lease's end."""
    code, out, _ = cluster.operator.cli("rewind", run.task, "--to", "0", "--yes")
    line = (
        rf"^cut off: turn 1 {SLOW_TOOL} \(unsafe\) \S+: node {re.escape(run.node)} has not "
        r"renewed its lease \(ends in \d+\.\d s\); it may still complete until then"
    )
    run.told = code == 0 and re.search(line, out, re.MULTILINE) is not None


def read_only(cluster: Cluster, rng: random.Random) -> Fault:
    fault = Fault(READ_ONLY, None, time.time())
    failover = rng.random() < 0.5
    with connect(cluster.db.url, autocommit=True) as admin:
        admin.execute("SET default_transaction_read_only = off")  # (this session only)
        admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        admin.execute("SELECT pg_reload_conf()")
        if failover:  # (a standby takes over: every session is cut too)
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
        time.sleep(cluster.plan.lease + rng.uniform(1.0, 2.0))  # past the lease
        admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
        admin.execute("SELECT pg_reload_conf()")
    return fault


def midcommit(cluster: Cluster, rng: random.Random) -> Fault:
    name = cluster.victim(rng)
    fault = Fault(MIDCOMMIT, name, time.time(), leases_of(cluster.url, name))
    proxy = cluster.proxies[name]
    before = proxy.severed_at_reply
    proxy.sever_at_reply()
    with contextlib.suppress(AssertionError):  # (a node sends every claim poll: soon)
        poll_for(lambda: proxy.severed_at_reply > before, 10, interval=0.01)
    cluster.cuts_at_reply += proxy.severed_at_reply - before
    time.sleep(rng.uniform(0.2, 1.0))  # a blip: shorter than the lease
    proxy.restore()
    time.sleep(2 * cluster.plan.interval)
    return fault


def db_clock(cluster: Cluster, rng: random.Random) -> Fault:
    offset = rng.choice((STEP, -STEP))
    marks = event_marks(cluster.url)
    fault = Fault(DB_CLOCK, None, time.time())
    cluster.dbclock.step(offset)
    _hold_step(cluster, rng)
    cluster.dbclock.step(0)  # (a step back: the other way)
    _hold_step(cluster, rng)
    cluster.leases_moved += moved_since(cluster.url, marks)
    return fault


def node_clock(cluster: Cluster, rng: random.Random) -> Fault:
    name = cluster.victim(rng)
    offset = rng.choice((STEP, -STEP))
    marks = event_marks(cluster.url)
    fault = Fault(NODE_CLOCK, name, time.time(), leases_of(cluster.url, name))
    cluster.clocks.step(name, offset)
    _hold_step(cluster, rng)
    cluster.clocks.step(name, 0)
    cluster.skewed.append((name, fault.at, time.time(), offset))
    _hold_step(cluster, rng)
    cluster.leases_moved += moved_since(cluster.url, marks)
    return fault


def _hold_step(cluster: Cluster, rng: random.Random) -> None:
    """Longer than a lease and a taker's margin: a lease the step moved would have moved."""
    time.sleep(cluster.plan.lease + 0.5 + rng.uniform(0.5, 1.5))
