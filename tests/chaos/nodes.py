"""Chaos class 21, nodes: three agentd nodes on one PostgreSQL, and every way a node or
its database goes away under them (docs/design.md section 10, invariant 10).

The cluster: a throwaway PostgreSQL of the class's own (``supervisor.pgcluster``, so it
can be restarted), one fresh schema in it, and three ``agentd start`` processes (``n1``,
``n2``, ``n3``), each on its own spool with ``--store URL --node nX``, a short ``[cluster]
lease`` and a heartbeat that renews it twice a second. Each node reaches the database
through a ``tests.postgres.SeverableProxy`` of its own, so its network can be cut. Tasks
run on the scripted model and call the effect-logging tools of the other classes
(``tests.chaos.effect_tools``: read-only, idempotent, keyed with and without a reconcile
check, unsafe), whose every side effect lands in one effects log outside every spool,
shared by the three nodes.

Then, at random instants while tasks run, one fault at a time:

* ``kill -9`` of a node's whole process tree: the daemon, its fork server and its workers
  (which run in sessions of their own, so a process group is not enough: the tree is
  walked with psutil and frozen with SIGSTOP until no new process appears, then killed).
  The node is started again once its tasks have moved (or the takeover bound has passed),
  as a service manager would, under the same name;
* ``SIGSTOP`` of a node's whole tree for longer than its lease, then ``SIGCONT``: its
  workers wake up fenced and must record nothing and run no tool;
* a restart of PostgreSQL (``immediate``: as if its machine lost power), down a moment:
  a storage fault for every node at once;
* a cut of a node's connection (its proxy severed) for longer than the lease, then restored;
* a thawed duplicate: ``SIGSTOP`` of a node's tree past its lease, a second daemon started
  under the same name meanwhile (on a spool of its own), then ``SIGCONT`` of the first. The
  first must find itself superseded (``node_superseded``) and serve nothing: while both
  run, each sample counts the daemons that serve the name, the one ``agentd nodes
  --json`` lists for it and each that a running task's worker of that node descends
  from (``serving``). Then the second stops, and the first must register the name again.

Each fault falls on a node that holds leases (drawn by how many), when one does.

Between faults a careful operator decides held calls (``agentd dangling --json`` and
``approve-dangling`` against the cluster): a call whose effect is in the log gets that
outcome, any other is re-run. The operator does not decide while a node is frozen or cut
off: a paused process cannot be told from a dead one, and one that wakes may finish the
effect it was in (started under a live lease: fencing forbids what comes after, not that).

Once the faults stop, every task must complete: the harness waits with a deadline, then
reads ``agentd --store URL status --json``. The audit reads the journal table itself with
psycopg (rows and the epoch of the lease that wrote each), the ``task_claimed`` events and
the effects log:

* tasks lost: submitted but absent from status, or not ended by the deadline;
* recorded steps lost: a journal row seen at a fault and gone or changed at the end;
* steps recorded twice: two turn records of one turn on the live branch;
* records by a fenced epoch: a row whose epoch is below an earlier row's (written by an
  owner after its successor), or stamped after a later epoch's ``task_claimed`` event;
* tool runs without an intent: an effects-log run of a call that has fewer intent records
  (a fenced worker that ran a tool its refused intent never made durable);
* unsafe and keyed effects repeated (per logical operation, from the outside record),
  unsafe and keyed effects missing, transcripts not paired (the scripted model's
  transcript, folded from the rows, checked as the Messages API would);
* two live daemons under one name: samples of a thawed duplicate in which two served it;
* tasks completed (100 %), and failover: from a node's death (or stop, or cut) to the
  claim of each of its tasks by another node (its ``task_claimed`` event), bounded by the
  lease plus ``FAILOVER_SLACK``, and to the task's next step under the new lease (the first
  journal row of a higher epoch), p50 and max against the lease. The next step is shown,
  not bounded: it may wait on the outside world, as a keyed call does on the keyed
  service's lock while a frozen worker holds it until its SIGCONT.

``python -m tests.chaos.nodes [--full] [--seed N]`` prints the table and exits 1 on any
violation; ``tests/test_chaos_nodes.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg

from supervisor.pgcluster import ThrowawayCluster
from supervisor.stores import forget_shared
from tests.chaos.effect_tools import EFFECTS_ENV, JITTER_ENV, read_log
from tests.chaos.kill9 import EFFECT_OF
from tests.daemon import Daemon, parse_time, reap_orphans, subreaper
from tests.faults.report import Figure, campaign_main
from tests.postgres import SeverableProxy, fresh_schema
from tests.support import assert_paired, poll_for, reply, text
from worker.state import fold

JSON = dict[str, Any]
FAULT = "21 nodes"
NODES = ("n1", "n2", "n3")
KILL, STOP, RESTART_DB, CUT, TWIN = "kill", "stop", "db restart", "cut", "twin"
FINAL = frozenset({"done", "failed", "cancelled"})
#: Seconds past the lease another node may take to claim a dead node's task ("the lease
#: plus a second or two", docs/design.md section 10): the claiming node's poll
#: (``supervisor.daemon.CLAIM_POLL``) on two busy cores.
FAILOVER_SLACK = 2.0


@dataclass(frozen=True)
class Plan:
    """How much of the class to run."""

    tasks: int  # in all
    level: int  # unfinished at once (more are submitted as others end)
    turns: tuple[int, int]  # script length range
    delay: float  # seconds each scripted reply takes
    faults: dict[str, int]  # how many of each
    lease: float = 3.0
    interval: float = 0.5  # heartbeat: renews the lease
    gap: tuple[float, float] = (0.5, 2.0)  # seconds between one fault's end and the next
    finish: float = 120.0  # seconds for every task to end once the faults stop

    @property
    def takeover_bound(self) -> float:
        """The longest a node's death may leave one of its tasks unclaimed."""
        return self.lease + FAILOVER_SLACK

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(
                tasks=12,
                level=12,
                turns=(30, 38),
                delay=0.8,
                faults={KILL: 2, STOP: 1, RESTART_DB: 1, CUT: 1, TWIN: 1},
            )
        return cls(
            tasks=60,
            level=24,
            turns=(80, 140),
            delay=1.0,
            faults={KILL: 20, STOP: 10, RESTART_DB: 5, CUT: 5, TWIN: 5},
            finish=300.0,
        )


def say(message: str) -> None:
    print(f"nodes: {message}", file=sys.stderr, flush=True)


# -- process trees ----------------------------------------------------------------------------


def freeze_tree(root: int) -> list[psutil.Process]:
    """SIGSTOP process ``root`` and every descendant, walking the tree again until no new
    one appears (a process that forked just before its parent stopped is found on the next
    walk; a stopped one forks no more). The frozen processes, root first."""
    frozen: dict[int, psutil.Process] = {}
    while True:
        try:
            top = psutil.Process(root)
            found = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        new = [p for p in found if p.pid not in frozen]
        if not new:
            return list(frozen.values())
        for proc in new:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)  # (psutil checks it is still that process)
                frozen[proc.pid] = proc
        # A signal is delivered when its process is next scheduled: walk again only once
        # each has stopped, so that no fork of theirs can come after the walk.
        poll_for(functools.partial(_halted, new), 5.0, what="SIGSTOP to land")


def _halted(procs: list[psutil.Process]) -> bool:
    """Each stopped, or gone (a zombie, or reaped)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                return False
    return True


def thaw(frozen: list[psutil.Process]) -> None:
    """SIGCONT every process ``freeze_tree`` stopped (those still there)."""
    for proc in frozen:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGCONT)


def kill_tree(root: int) -> int:
    """``kill -9`` of ``root``'s whole tree, frozen first so that none escapes by forking;
    returns once every one has died, with how many there were."""
    return kill_frozen(freeze_tree(root))


def kill_frozen(frozen: list[psutil.Process], timeout: float = 10.0) -> int:
    """SIGKILL every process ``freeze_tree`` stopped; returns once all have died (orphans
    reaped: this process is their subreaper), with how many there were."""
    for proc in frozen:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(frozen, timeout=timeout)
    reap_orphans()
    if alive:
        raise RuntimeError(f"processes outlived SIGKILL: {[p.pid for p in alive]}")
    return len(frozen)


# -- the nodes ----------------------------------------------------------------------------------


def config_text(plan: Plan) -> str:
    return (
        f"max_workers = {plan.level}\n"
        f"[heartbeat]\ninterval = {plan.interval}\ntimeout = 10.0\n"
        f"[cluster]\nlease = {plan.lease}\n"
        f"[restart]\nbackoff_initial = 0.1\nbackoff_max = 1.0\ncrash_loop_limit = 50\n"
        f'[tools]\nmodules = ["tests.chaos.effect_tools"]\n'
    )


class Node(Daemon):
    """One node: a ``Daemon`` on its own spool whose every command carries ``--store`` and
    ``--node``."""

    def __init__(self, root: Path, config: str, name: str, url: str) -> None:
        super().__init__(root, config)
        self.name = name
        self.url = url

    def command(self, *args: str) -> list[str]:
        return super().command("--store", self.url, "--node", self.name, *args)

    def cli(self, *args: str) -> tuple[int, str, str]:
        """``agentd --store URL --node NAME ARGS`` in this process; the store it used is
        closed after (a command done), so that a campaign's hundreds of commands do not
        keep hundreds of connections open."""
        try:
            return super().cli("--store", self.url, "--node", self.name, *args)
        finally:
            forget_shared()

    @property
    def pid(self) -> int | None:
        """The running daemon's pid, None when it is not running."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def cli_json(node: Node, *args: str) -> Any:
    """``agentd ARGS --json`` against the cluster, in this process: the document."""
    code, out, err = node.cli(*args, "--json")
    if code != 0:
        raise RuntimeError(f"agentd {' '.join(args)} exited {code}: {err.strip()[:300]}")
    return json.loads(out)


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
    with psycopg.connect(url, connect_timeout=5) as conn:
        for task, seq, epoch, record in conn.execute(
            "SELECT task, seq, epoch, record FROM journal ORDER BY task, seq"
        ):
            rows.setdefault(task, []).append(Row(int(seq), int(epoch), json.loads(bytes(record))))
    return rows


def events_named(url: str, name: str) -> dict[str, list[JSON]]:
    """Every task's lifecycle events called ``name``, in order, from the events table."""
    found: dict[str, list[JSON]] = {}
    with psycopg.connect(url, connect_timeout=5) as conn:
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
    """The tasks whose live lease ``node`` holds, and its epoch of each."""
    with psycopg.connect(url, connect_timeout=5) as conn:
        return {
            task: int(epoch)
            for task, epoch in conn.execute(
                "SELECT id, epoch FROM tasks WHERE node = %s AND lease_expires > now()",
                (node,),
            )
        }


def registered(listed: list[JSON], name: str) -> set[int]:
    """The pid of the daemon that ``agentd nodes --json`` lists as node ``name``, if alive."""
    return {int(n["pid"]) for n in listed if n["name"] == name and n["alive"] and n["pid"]}


def serving(
    name: str,
    listed: list[JSON],
    rows: dict[str, JSON],
    daemons: set[int],
    ancestors: Callable[[int], set[int]] | None = None,
) -> set[int]:
    """Which of ``daemons`` (live processes started as node ``name``) serve the name: the one
    ``agentd nodes --json`` lists for it, and each that the worker of a task running on
    that node (a status row) descends from. More than one is two live daemons under one
    name: one of them runs tasks unlisted, the fault class 21 counts."""
    parents = ancestors or _ancestors
    found = registered(listed, name) & daemons
    for row in rows.values():
        pid = row.get("pid")
        if row.get("node") == name and row.get("state") == "running" and isinstance(pid, int):
            found |= parents(pid) & daemons
    return found


def _ancestors(pid: int) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {p.pid for p in psutil.Process(pid).parents()}
    return set()


# -- the tasks ------------------------------------------------------------------------------


def task_script(task: str, turns: int, delay: float, offset: int) -> list[JSON]:
    """``turns`` turns that call the chaos tools of every effect class in turn, then a final
    answer. Tags and call ids carry the task's name: the effects log is the whole cluster's."""
    responses = []
    for i in range(1, turns):
        tool, inputs = (
            ("chaos_lookup", {"name": f"{task}-plan"}),
            ("chaos_set", {"name": f"{task}-plan", "value": f"v{i}"}),
            ("chaos_send", {"to": "ops", "body": f"{task} step {i}"}),
            ("chaos_enqueue", {"item": f"{task}-job-{i}"}),
            ("chaos_charge", {"amount": i}),
        )[(i + offset) % 5]
        use = {
            "type": "tool_use",
            "id": f"toolu_{task}_{i}",
            "name": tool,
            "input": {"tag": f"{task}.{i}", **inputs},
        }
        responses.append(reply(text(f"Step {i}."), use, delay=delay))
    responses.append(reply(text("All done."), delay=delay))
    return responses


@dataclass
class Fault:
    """One fault delivered: what, to whom, when (Unix time), and the leases its victim held."""

    kind: str
    node: str | None
    at: float
    held: dict[str, int] = field(default_factory=dict)  # task -> epoch
    processes: int = 0


class Cluster:
    """The database, the three nodes and their proxies, the tasks and the operator."""

    def __init__(self, root: Path, db: ThrowawayCluster, url: str, plan: Plan) -> None:
        self.root = root
        self.db = db
        self.url = url  # the schema's URL, straight to the server
        self.plan = plan
        self.proxies = {name: SeverableProxy.in_front_of(url) for name in NODES}
        self.effects = root / "effects.jsonl"
        self.env = {EFFECTS_ENV: str(self.effects), JITTER_ENV: "0.05"}
        self.nodes = {
            name: Node(
                root / name,
                config_text(plan),
                name,
                self.proxies[name].url_for(url),
            )
            for name in NODES
        }
        self.operator = Node(root / "operator", config_text(plan), "operator", url)
        self.turns: dict[str, int] = {}  # task -> its script's length
        self.ended: set[str] = set()
        self.seen: list[dict[str, list[Row]]] = []  # the journal as read at each fault
        self.faults: list[Fault] = []
        self.holds_decided = 0
        self.deaths: list[str] = []  # daemons that ended though no fault killed them
        self.twins: list[Node] = []  # the second daemons of a name (``twin``)
        self.twin_samples = 0  # samples taken while two daemons of a name ran
        self.two_serving = 0  # ... in which two of them served the name
        self.superseded = 0  # thawed daemons that said ``node_superseded``
        self.registered_again = 0  # ... and took their name back once it was free

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        for node in self.nodes.values():
            node.start(self.env, timeout=60)

    def cleanup(self) -> None:
        for node in self.nodes.values():
            if node.pid is not None:
                with contextlib.suppress(psutil.Error, RuntimeError):
                    kill_tree(node.pid)
            node.cleanup()
        for twin in self.twins:
            twin.cleanup()
        self.operator.cleanup()
        for proxy in self.proxies.values():
            proxy.close()

    # -- tasks ----------------------------------------------------------------------------

    def submit(self, rng: random.Random) -> str:
        name = f"t{len(self.turns):03d}"
        turns = rng.randint(*self.plan.turns)
        script = self.root / f"{name}.json"
        script.write_text(
            json.dumps({"responses": task_script(name, turns, self.plan.delay, rng.randrange(5))})
        )
        code, _, err = self.operator.cli(
            "submit", "--name", name, "--script", str(script), "--prompt", f"Task {name}.",
            "--max-turns", str(turns + 10),  # (a full-mode script is longer than the default)
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"submit {name} exited {code}: {err.strip()[:300]}")
        self.turns[name] = turns
        return name

    def rows(self) -> dict[str, JSON]:
        """The cluster's status rows, by task."""
        return {row["id"]: row for row in cli_json(self.operator, "status")["tasks"]}

    def unfinished(self) -> list[str]:
        with contextlib.suppress(Exception):  # (the database may be away: ask again later)
            for task, row in self.rows().items():
                if row["state"] in FINAL:
                    self.ended.add(task)
        return sorted(self.turns.keys() - self.ended)

    def top_up(self, rng: random.Random) -> None:
        room = self.plan.level - len(self.unfinished())
        for _ in range(min(room, self.plan.tasks - len(self.turns))):
            self.submit(rng)

    def decide_holds(self) -> None:
        """Decide every held call like a careful operator who checks the outside world (the
        effects log): its effect is there, so record that outcome; else re-run it. Only
        between faults (see the module docstring)."""
        try:
            held = cli_json(self.operator, "dangling")
        except Exception:  # (the database may be away, or a node mid-claim: next time)
            return
        lines = read_log(self.effects)
        for row in held:
            done = [
                line
                for line in lines
                if line.get("call_id") == row["call_id"] and line.get("kind") == "effect"
            ]
            args = ["--result", f"{done[-1]['result']} (verified in the ledger)"] if done else []
            code, _, _ = self.operator.cli("approve-dangling", row["task"], row["call_id"], *args)
            self.holds_decided += code == 0

    def observe(self) -> None:
        with contextlib.suppress(Exception):
            self.seen.append(journal_rows(self.url))

    # -- faults ---------------------------------------------------------------------------

    def victim(self, rng: random.Random) -> str:
        """A node that holds leases, drawn by how many it holds (any node when none does)."""
        held = [len(leases_of(self.url, name)) for name in NODES]
        return rng.choices(NODES, weights=held)[0] if any(held) else rng.choice(NODES)

    def kill(self, rng: random.Random) -> Fault:
        name = self.victim(rng)
        node = self.nodes[name]
        assert node.proc is not None
        frozen = freeze_tree(node.proc.pid)  # dead to the cluster from here on
        if node.proc.poll() is not None:  # (it ended by itself just before)
            self.died(node)
        fault = Fault(KILL, name, time.time(), leases_of(self.url, name))
        fault.processes = kill_frozen(frozen)
        node.proc.wait(timeout=10)
        with contextlib.suppress(AssertionError):  # (its tasks moved, or the node comes back)
            poll_for(lambda: self.moved(fault), self.plan.takeover_bound + 2.0, interval=0.2)
        # (its name is free again at once: a row of this host whose process is gone is
        # this node's last life, ``PostgresStore.join``)
        node.start(self.env, timeout=60)
        return fault

    def stop(self, rng: random.Random) -> Fault:
        name = self.victim(rng)
        node = self.nodes[name]
        assert node.proc is not None
        frozen = freeze_tree(node.proc.pid)  # (a daemon that ended meanwhile: chores see it)
        fault = Fault(STOP, name, time.time(), leases_of(self.url, name), len(frozen))
        time.sleep(self.plan.lease + rng.uniform(1.0, 2.0))  # the fault: longer than the lease
        thaw(frozen)
        time.sleep(2 * self.plan.interval)  # its fenced workers wake and find out
        return fault

    def twin(self, rng: random.Random) -> Fault:
        name = self.victim(rng)
        node = self.nodes[name]
        assert node.proc is not None
        frozen = freeze_tree(node.proc.pid)
        fault = Fault(TWIN, name, time.time(), leases_of(self.url, name), len(frozen))
        time.sleep(self.plan.lease + rng.uniform(1.0, 2.0))  # its node row goes stale too
        twin = Node(
            self.root / f"{name}-twin{len(self.twins)}",
            config_text(self.plan),
            name,
            self.proxies[name].url_for(self.url),
        )
        self.twins.append(twin)
        twin.start(self.env, timeout=60)  # (refused, exit 78, if the name were still live)
        thaw(frozen)
        # The thawed daemon finds out at its next renewal (every third of a lease): its
        # workers may run until then. Then both run: sample who serves the name.
        time.sleep(self.plan.lease / 3 + 2 * self.plan.interval)
        daemons = {p for p in (node.pid, twin.pid) if p is not None}
        end = time.monotonic() + self.plan.lease / 2
        while time.monotonic() < end:
            with contextlib.suppress(Exception):  # (a command refused: sample again)
                found = serving(name, cli_json(self.operator, "nodes"), self.rows(), daemons)
                self.twin_samples += 1
                self.two_serving += len(found) > 1
            time.sleep(0.25)
        logged = [e.get("event") for e in node.log_events()]
        self.superseded += "node_superseded" in logged
        twin.stop()
        with contextlib.suppress(AssertionError):  # (the name is free: it takes it back)
            poll_for(
                lambda: node.pid in registered(cli_json(self.operator, "nodes"), name),
                2 * self.plan.lease,
                interval=0.2,
            )
            self.registered_again += 1
        return fault

    def restart_db(self, rng: random.Random) -> Fault:
        fault = Fault(RESTART_DB, None, time.time())
        self.db.stop(immediate=True)
        time.sleep(rng.uniform(0.5, 2.0))  # the fault itself: down a moment
        self.db.start()
        return fault

    def cut(self, rng: random.Random) -> Fault:
        name = self.victim(rng)
        fault = Fault(CUT, name, time.time(), leases_of(self.url, name))
        self.proxies[name].sever()
        time.sleep(self.plan.lease + rng.uniform(1.0, 2.0))  # the fault: longer than the lease
        self.proxies[name].restore()
        time.sleep(2 * self.plan.interval)  # its workers reconnect and find out
        return fault

    def moved(self, fault: Fault) -> bool:
        """Every task the victim held has a row of a newer lease (or has ended)."""
        rows = journal_rows(self.url)
        return all(
            any(r.epoch > epoch for r in rows.get(task, [])) for task, epoch in fault.held.items()
        )

    def run_faults(self, rng: random.Random) -> None:
        schedule = [kind for kind, n in self.plan.faults.items() for _ in range(n)]
        rng.shuffle(schedule)
        deliver: dict[str, Callable[[random.Random], Fault]] = {
            KILL: self.kill,
            STOP: self.stop,
            RESTART_DB: self.restart_db,
            CUT: self.cut,
            TWIN: self.twin,
        }
        for kind in schedule:
            self.chores(rng, rng.uniform(*self.plan.gap))
            if not self.unfinished():
                say(f"every task ended before the {kind} fault: {len(self.faults)} delivered")
                return
            self.observe()
            fault = deliver[kind](rng)
            self.faults.append(fault)
            say(
                f"{kind} {fault.node or ''}: {len(fault.held)} leases held, "
                f"{len(self.unfinished())} tasks unfinished, {time.time() - fault.at:.1f} s"
            )

    def chores(self, rng: random.Random, seconds: float) -> None:
        """For ``seconds``: top the tasks up, decide held calls, start again a node whose
        daemon ended on its own (a violation: a daemon survives its database going away)."""
        end = time.monotonic() + seconds
        while True:
            for node in self.nodes.values():
                if node.pid is None:
                    self.died(node)
                    node.start(self.env, timeout=60)
            self.top_up(rng)
            self.decide_holds()
            if time.monotonic() >= end:
                return
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def died(self, node: Node) -> None:
        """Note that ``node``'s daemon ended though no fault killed it, and how."""
        code = node.proc.returncode if node.proc is not None else None
        last = node.log().strip().splitlines()[-1:] or ["(no log)"]
        self.deaths.append(f"{node.name} exited {code}: {last[0][:200]}")

    def finish(self, rng: random.Random) -> bool:
        """Wait for every task to end, submitting the rest and deciding holds meanwhile."""
        deadline = time.monotonic() + self.plan.finish
        while time.monotonic() < deadline:
            self.chores(rng, 0.0)
            if len(self.turns) >= self.plan.tasks and not self.unfinished():
                return True
            time.sleep(0.5)
        return False


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
) -> Audit:
    """The figures of one run, from what the cluster left: the status rows, the journal
    rows, the ``task_claimed`` events, the journals read at each fault and the effects log.
    A function of its inputs alone, so that it can be checked on made-up ones."""
    out = Audit(tasks=len(turns))
    intents: Counter[str] = Counter()
    completed: set[str] = set()
    for task, n in sorted(turns.items()):
        row = status.get(task)
        mine = rows.get(task, [])
        if row is None or row["state"] not in FINAL:
            out.lost += 1
            out.note(f"{task}: {'missing from status' if row is None else row['state']}")
        state = fold("", [r.record for r in mine])
        live = [t.turn for t in state.turns if not t.rewound]
        out.doubled += len(live) - len(set(live))
        done = row is not None and (row["state"], row.get("reason")) == ("done", "end_turn")
        if done and sorted(live) == list(range(1, n + 1)):
            completed.add(task)
        elif row is not None and row["state"] in FINAL:
            out.note(f"{task}: {row['state']} ({row.get('reason')}), turns {live}")
        try:
            assert_paired(state.messages)
        except AssertionError as exc:
            out.unpaired += 1
            out.note(f"{task}: {exc}")
        out.fenced_records += fenced(task, mine, claimed.get(task, []), out)
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
    for task in turns:
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


def fenced(task: str, rows: list[Row], claimed: list[Claim], out: Audit) -> int:
    """Rows written by an owner whose lease had already moved on: an epoch below an earlier
    row's (the old owner wrote after its successor did), or a row stamped after the claim of
    a later epoch (the old owner wrote after its successor took the task)."""
    bad = 0
    highest = 0
    for r in rows:
        stamp = stamped(r)
        later = [e for e, _, at in claimed if e > r.epoch and stamp is not None and at < stamp]
        if r.epoch < highest:
            out.note(f"{task}: row {r.seq} of epoch {r.epoch} after one of epoch {highest}")
        elif later:
            out.note(
                f"{task}: row {r.seq} of epoch {r.epoch} stamped after epoch {later[0]}'s claim"
            )
        bad += r.epoch < highest or bool(later)
        highest = max(highest, r.epoch)
    return bad


def stamped(row: Row) -> float | None:
    """When the worker stamped a record (Unix time); None for one without a stamp."""
    try:
        return parse_time(str(row.record["at"]))
    except (KeyError, ValueError):
        return None


# -- figures -----------------------------------------------------------------------------------


def zero(name: str, value: int) -> Figure:
    return Figure(FAULT, name, value, value != 0)


def failover_figures(what: str, found: list[Takeover], plan: Plan) -> list[Figure]:
    """Failover after one kind of fault: the claims against their bound, the next steps
    p50 and max against the lease, the slowest told."""
    claims = [t.claim if t.claim is not None else float("inf") for t in found]
    steps = [t.step for t in found]
    slowest = max(found, key=lambda t: t.step).what if found else "-"
    late = max(claims, default=0.0)
    return [
        Figure(FAULT, f"failover after {what}: tasks taken over", len(found)),
        Figure(
            FAULT,
            f"failover after {what}: claimed elsewhere, max s (bound {plan.takeover_bound:g} s)",
            late,
            late > plan.takeover_bound,
        ),
        Figure(
            FAULT,
            f"failover after {what}: next step, p50 s (lease {plan.lease:g} s)",
            statistics.median(steps) if steps else 0.0,
        ),
        Figure(FAULT, f"failover after {what}: next step, max s", max(steps, default=0.0)),
        Figure(FAULT, f"failover after {what}: slowest", slowest),
    ]


def figures(plan: Plan, cluster: Cluster, found: Audit, finished: bool) -> list[Figure]:
    delivered = Counter(f.kind for f in cluster.faults)
    pct = round(100.0 * found.completed / found.tasks, 1) if found.tasks else 0.0
    out = [
        Figure(FAULT, "nodes", len(NODES)),
        Figure(FAULT, "lease s", plan.lease),
        Figure(FAULT, "tasks", found.tasks),
        Figure(FAULT, "kill -9 of a node's process tree", delivered[KILL]),
        Figure(
            FAULT, "processes killed", sum(f.processes for f in cluster.faults if f.kind == KILL)
        ),
        Figure(FAULT, "SIGSTOP of a node's tree past its lease", delivered[STOP]),
        Figure(FAULT, "PostgreSQL restarts", delivered[RESTART_DB]),
        Figure(FAULT, "network cuts past the lease", delivered[CUT]),
        Figure(FAULT, "thawed duplicates of a node name", delivered[TWIN]),
        Figure(
            FAULT,
            "faults not delivered (tasks ended first)",
            sum(plan.faults.values()) - len(cluster.faults),
            len(cluster.faults) < sum(plan.faults.values()),
        ),
        Figure(FAULT, "holds decided", cluster.holds_decided),
        zero("daemon deaths no fault caused", len(cluster.deaths)),
        zero("two live daemons under one name (samples)", cluster.two_serving),
        Figure(FAULT, "duplicates: samples with both daemons running", cluster.twin_samples),
        Figure(
            FAULT,
            "duplicates: thawed daemon superseded",
            cluster.superseded,
            cluster.superseded != delivered[TWIN],
        ),
        Figure(
            FAULT,
            "duplicates: name registered again once free",
            cluster.registered_again,
            cluster.registered_again != delivered[TWIN],
        ),
        zero("tasks lost", found.lost),
        zero("recorded steps lost", found.steps_lost),
        zero("steps recorded twice", found.doubled),
        zero("records by a fenced epoch", found.fenced_records),
        zero("tool runs without an intent", found.runs_without_intent),
        zero("unsafe effects repeated", found.unsafe_repeated),
        zero("keyed effects repeated", found.keyed_repeated),
        zero("unsafe or keyed effects missing", found.effects_missing),
        zero("transcripts not paired", found.unpaired),
        Figure(FAULT, "tasks completed %", pct, pct != 100.0),
        Figure(FAULT, "all tasks ended in time", str(finished), not finished),
        *failover_figures("kill -9", found.failover.get(KILL, []), plan),
        *failover_figures("SIGSTOP", found.failover.get(STOP, []), plan),
        *failover_figures("a cut", found.failover.get(CUT, []), plan),
        *failover_figures("a thawed duplicate", found.failover.get(TWIN, []), plan),
    ]
    if found.examples or cluster.deaths:
        out.append(Figure(FAULT, "examples", "; ".join([*cluster.deaths, *found.examples])))
    return out


# -- the class --------------------------------------------------------------------------------


def run(quick: bool, *, seed: int | None = None) -> list[Figure]:
    """The class, quick or full: its figures."""
    seed = random.randrange(1 << 30) if seed is None else seed
    plan = Plan.of(quick)
    rng = random.Random(seed)
    started = time.monotonic()
    head = [Figure(FAULT, "seed (--seed replays the choices)", str(seed))]
    with (
        tempfile.TemporaryDirectory(prefix="agentd-nodes-") as folder,
        ThrowawayCluster.create() as db,
        fresh_schema(db.url) as url,
        subreaper(),
    ):
        cluster = Cluster(Path(folder), db, url, plan)
        try:
            cluster.start()
            cluster.top_up(rng)
            cluster.run_faults(rng)
            finished = cluster.finish(rng)
            status = cluster.rows()
            found = audit(
                cluster.turns,
                status,
                journal_rows(url),
                claims_of(events_named(url, "task_claimed")),
                cluster.seen,
                read_log(cluster.effects),
                cluster.faults,
            )
            fenced_workers = sum(map(len, events_named(url, "lease_lost").values()))
        finally:
            cluster.cleanup()
    return [
        *head,
        *figures(plan, cluster, found, finished),
        Figure(FAULT, "workers fenced (lease_lost events)", fenced_workers),
        Figure(FAULT, "runtime s", time.monotonic() - started),
    ]


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.nodes", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
