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
  from (``serving``). Then the second stops, and the first must register the name again;
* the faults of ``tests.chaos.nodefaults``: a frozen node's tool (its tree stopped past
  the lease mid unsafe call, then an approve, a cancel or a rewind from another node,
  then SIGCONT), the database read-only past the lease (half the time as a failover,
  every session cut), a node's link cut mid-commit, and wall-clock steps of ±2 minutes
  on the database host (libfaketime under PostgreSQL) and on a node (``nodeclock``).

Throughout, node ``n3`` runs in a time namespace whose monotonic and boot-time clocks are
a day ahead of the others' (``nodeclock.TimeNamespace``): no lease, kill timer or
heartbeat age may compare two nodes' monotonic clocks. Every status read samples the
heartbeat ages of running tasks, and an age a day off (or below 0) counts.

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
* effects done twice (unsafe or keyed, the frozen tool's included), effects after a
  successful cancel (but the call the cancel named, within the time it named), node
  deaths by a database fault, leases moved by a clock step (a claim that took a lease
  over, or a worker fenced, between a step and a lease after the step back: counted by
  event number, not by any clock), tasks held for a call that ran (a hold of a call
  whose effect was logged before it, on a task no node took over: the worker had its
  result in hand), and what the frozen tool's commands said;
* tasks completed (100 %), and failover: from a node's death (or stop, or cut) to the
  claim of each of its tasks by another node (its ``task_claimed`` event), bounded by the
  lease plus the taker's margin and ``FAILOVER_SLACK``, and to the task's next step under
  the new lease (the first journal row of a higher epoch), p50 and max against the lease.
  The next step is shown, not bounded: it may wait on the outside world, as a keyed call
  does on the keyed service's lock while a frozen worker holds it until its SIGCONT.

``python -m tests.chaos.nodes [--full] [--seed N]`` prints the table and exits 1 on any
violation; ``tests/test_campaigns.py`` runs the quick mode in ``make test``.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from supervisor.pgcluster import ThrowawayCluster
from tests.chaos import nodefaults
from tests.chaos.effect_tools import EFFECTS_ENV, JITTER_ENV, read_log
from tests.chaos.nodeaudit import (
    FINAL,
    Audit,
    Fault,
    Row,
    Takeover,
    audit,
    claims_of,
    effects_after,
    events_named,
    journal_rows,
    leases_of,
)
from tests.chaos.nodeclock import DAY, DatabaseClock, NodeClocks, TimeNamespace
from tests.chaos.nodefaults import (
    DATABASE_FAULTS,
    DB_CLOCK,
    FROZEN,
    MIDCOMMIT,
    NODE_CLOCK,
    READ_ONLY,
)
from tests.chaos.trees import freeze_tree, kill_frozen, kill_tree, thaw
from tests.daemon import Daemon, subreaper
from tests.daemon import config_text as daemon_config
from tests.faults.report import Figure, campaign_main
from tests.postgres import SeverableProxy, fresh_schema
from tests.support import poll_for, reply, text
from worker.store.pglease import TAKEOVER_MARGIN

JSON = dict[str, Any]
FAULT = "21 nodes"
NODES = ("n1", "n2", "n3")
KILL, STOP, RESTART_DB, CUT, TWIN = "kill", "stop", "db restart", "cut", "twin"
#: The node whose monotonic clocks run a day ahead (a time namespace of its own).
AHEAD = "n3"
#: Seconds past the lease and a taker's margin (``TAKEOVER_MARGIN``) another node may take
#: to claim a dead node's task ("the lease plus a second or two", docs/design.md section
#: 10): the claiming node's poll (``supervisor.placement.CLAIM_POLL``) on two busy cores.
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
        return self.lease + TAKEOVER_MARGIN + FAILOVER_SLACK

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(
                tasks=12,
                level=12,
                turns=(95, 110),
                delay=0.8,
                faults={
                    KILL: 1, STOP: 1, RESTART_DB: 1, CUT: 1, TWIN: 1, FROZEN: 1,
                    READ_ONLY: 1, MIDCOMMIT: 1, DB_CLOCK: 1, NODE_CLOCK: 1,
                },
                finish=180.0,
            )  # fmt: skip
        return cls(
            tasks=100,
            level=24,
            turns=(120, 180),
            delay=1.0,
            faults={
                KILL: 20, STOP: 10, RESTART_DB: 5, CUT: 5, TWIN: 5, FROZEN: 6,
                READ_ONLY: 4, MIDCOMMIT: 6, DB_CLOCK: 4, NODE_CLOCK: 4,
            },
            finish=900.0,
        )  # fmt: skip


def say(message: str) -> None:
    print(f"nodes: {message}", file=sys.stderr, flush=True)


# -- the nodes ----------------------------------------------------------------------------------


def config_text(plan: Plan) -> str:
    return daemon_config(
        max_workers=plan.level,
        interval=plan.interval,
        timeout=10.0,
        model_call=None,
        tool_call=None,
        backoff_max=1.0,
        crash_loop_limit=50,
        stop_grace=None,
        sandbox=None,
        tool_modules=("tests.chaos.effect_tools",),
        extra=f"[cluster]\nlease = {plan.lease}\n",
    )


class Node(Daemon):
    """One node: a ``Daemon`` on its own spool whose every command carries ``--store`` and
    ``--node``."""

    def __init__(
        self,
        root: Path,
        config: str,
        name: str,
        url: str,
        *,
        env: dict[str, str] | None = None,
        namespace: TimeNamespace | None = None,
    ) -> None:
        super().__init__(root, config)
        self.name = name
        self.url = url
        self.env = env or {}  # its own: the clock it reads (``nodeclock.NodeClocks``)
        self.namespace = namespace  # a time namespace it runs in

    def here(self, argv: list[str]) -> list[str]:
        return self.namespace.enter_argv(argv) if self.namespace is not None else argv

    def start(
        self,
        env: dict[str, str] | None = None,
        *,
        timeout: float = 60.0,
        args: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        return super().start({**(env or {}), **self.env}, timeout=timeout, args=args)

    def command(self, *args: str) -> list[str]:
        return super().command("--store", self.url, "--node", self.name, *args)

    def cli(self, *args: str) -> tuple[int, str, str]:
        """``agentd --store URL --node NAME ARGS`` in this process (which closes the store
        it opened when the command is done, so that a campaign's hundreds of commands do not
        keep hundreds of connections open)."""
        return super().cli("--store", self.url, "--node", self.name, *args)

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
        self.dbclock = DatabaseClock(db)
        self.clocks = NodeClocks(root)
        self.ahead = TimeNamespace(DAY)
        self.nodes = {name: self.node(name, root / name) for name in NODES}
        self.operator = Node(root / "operator", config_text(plan), "operator", url)
        self.turns: dict[str, int] = {}  # task -> its script's length
        self.extra: set[str] = set()  # tasks of a fate of their own (the frozen tool's)
        self.ended: set[str] = set()
        self.seen: list[dict[str, list[Row]]] = []  # the journal as read at each fault
        self.faults: list[Fault] = []
        self.holds_decided = 0
        self.deaths: list[str] = []  # daemons that ended though no fault killed them
        self.deaths_by_db = 0  # ... after a fault of the database (the last one delivered)
        self.twins: list[Node] = []  # the second daemons of a name (``twin``)
        self.twin_samples = 0  # samples taken while two daemons of a name ran
        self.two_serving = 0  # ... in which two of them served the name
        self.superseded = 0  # thawed daemons that said ``node_superseded``
        self.registered_again = 0  # ... and took their name back once it was free
        self.frozen: list[nodefaults.Frozen] = []  # the frozen tool's runs
        self.first_action = 0  # which operator action the first frozen tool gets
        self.cuts_at_reply = 0  # statements whose reply a mid-commit cut took
        self.leases_moved: list[JSON] = []  # moved during a clock step
        self.skewed: list[tuple[str, float, float, int]] = []  # node, from, to, offset
        self.age_samples = 0  # running tasks' heartbeat ages read in status
        self.ages_off: list[str] = []  # ... below 0 or a day off
        self.last_kind = ""  # the fault delivered last (what a death is put down to)
        self.status: dict[str, JSON] = {}  # the status rows once every task ended
        self.notes: list[str] = []  # what the figures' examples tell

    def node(self, name: str, root: Path) -> Node:
        """Node ``name`` (or a second daemon of it) on a spool at ``root``, through its
        proxy, on its wall clock; ``AHEAD`` in its time namespace."""
        return Node(
            root,
            config_text(self.plan),
            name,
            self.proxies[name].url_for(self.url),
            env=self.clocks.env(name),
            namespace=self.ahead if name == AHEAD else None,
        )

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.dbclock.install()  # (the server restarted under libfaketime, at offset 0)
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
        self.ahead.close()

    # -- tasks ----------------------------------------------------------------------------

    def submit(self, rng: random.Random) -> str:
        name = f"t{len(self.turns):03d}"
        turns = rng.randint(*self.plan.turns)
        self.submit_script(name, task_script(name, turns, self.plan.delay, rng.randrange(5)), turns)
        self.turns[name] = turns
        return name

    def submit_script(self, name: str, responses: list[JSON], turns: int) -> None:
        script = self.root / f"{name}.json"
        script.write_text(json.dumps({"responses": responses}))
        code, _, err = self.operator.cli(
            "submit", "--name", name, "--script", str(script), "--prompt", f"Task {name}.",
            "--max-turns", str(turns + 10),  # (a full-mode script is longer than the default)
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"submit {name} exited {code}: {err.strip()[:300]}")

    def rows(self) -> dict[str, JSON]:
        """The cluster's status rows, by task; each running task's heartbeat age sampled
        (one below 0 or a day off compared two nodes' monotonic clocks)."""
        rows = {row["id"]: row for row in cli_json(self.operator, "status")["tasks"]}
        for row in rows.values():
            age = row.get("heartbeat_age")
            if row["state"] == "running" and isinstance(age, int | float):
                self.age_samples += 1
                if not 0.0 <= age < DAY / 2:
                    self.ages_off.append(f"{row['id']} on {row.get('node')}: {age:.1f} s")
        return rows

    def dangling(self) -> list[JSON]:
        return list(cli_json(self.operator, "dangling"))

    def unfinished(self) -> list[str]:
        with contextlib.suppress(Exception):  # (the database may be away: ask again later)
            for task, row in self.rows().items():
                if row["state"] in FINAL:
                    self.ended.add(task)
        return sorted((self.turns.keys() | self.extra) - self.ended)

    def top_up(self, rng: random.Random) -> None:
        room = self.plan.level - len(self.unfinished())
        for _ in range(min(room, self.plan.tasks - len(self.turns))):
            self.submit(rng)

    def decide_holds(self) -> None:
        """Decide every held call like a careful operator who checks the outside world (the
        effects log): its effect is there, so record that outcome; else re-run it. Only
        between faults (see the module docstring)."""
        try:
            held = self.dangling()
        except Exception:  # (the database may be away, or a node mid-claim: next time)
            return
        lines = read_log(self.effects)
        for row in held:
            done = [
                line
                for line in lines
                if line.get("call_id") == row["call_id"] and line.get("kind") == "effect"
            ]
            args = (
                ["--result", f"{done[-1]['result']} (verified in the ledger)"]
                if done
                else ["--rerun"]
            )
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
        twin = self.node(name, self.root / f"{name}-twin{len(self.twins)}")
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
            FROZEN: lambda rng: nodefaults.frozen_tool(self, rng),
            READ_ONLY: lambda rng: nodefaults.read_only(self, rng),
            MIDCOMMIT: lambda rng: nodefaults.midcommit(self, rng),
            DB_CLOCK: lambda rng: nodefaults.db_clock(self, rng),
            NODE_CLOCK: lambda rng: nodefaults.node_clock(self, rng),
        }
        self.first_action = rng.randrange(len(nodefaults.ACTIONS))
        for kind in schedule:
            self.chores(rng, rng.uniform(*self.plan.gap))
            if not self.unfinished():
                say(f"every task ended before the {kind} fault: {len(self.faults)} delivered")
                return
            self.observe()
            self.last_kind = kind
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
        self.deaths.append(f"{node.name} exited {code} after a {self.last_kind}: {last[0][:200]}")
        self.deaths_by_db += self.last_kind in DATABASE_FAULTS

    def finish(self, rng: random.Random) -> bool:
        """Wait for every task to end, submitting the rest and deciding holds meanwhile."""
        deadline = time.monotonic() + self.plan.finish
        while time.monotonic() < deadline:
            self.chores(rng, 0.0)
            if len(self.turns) >= self.plan.tasks and not self.unfinished():
                return True
            time.sleep(0.5)
        return False


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


def figures(
    plan: Plan,
    cluster: Cluster,
    found: Audit,
    finished: bool,
    effects: list[JSON],
    late: list[JSON],
) -> list[Figure]:
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
        *frozen_figures(cluster, effects),
        Figure(FAULT, "read-only database phases past the lease", delivered[READ_ONLY]),
        Figure(
            FAULT,
            "mid-commit cuts (replies lost)",
            cluster.cuts_at_reply,
            cluster.cuts_at_reply < delivered[MIDCOMMIT],
        ),
        Figure(FAULT, "wall-clock steps of ±2 min on the database host", 2 * delivered[DB_CLOCK]),
        Figure(FAULT, "wall-clock steps of ±2 min on a node", 2 * delivered[NODE_CLOCK]),
        Figure(FAULT, f"monotonic clocks of {AHEAD} ahead (time namespace), s", DAY),
        Figure(
            FAULT,
            "faults not delivered (tasks ended first)",
            sum(plan.faults.values()) - len(cluster.faults),
            len(cluster.faults) < sum(plan.faults.values()),
        ),
        Figure(FAULT, "holds decided", cluster.holds_decided),
        zero("daemon deaths no fault caused", len(cluster.deaths)),
        zero("node deaths by a database fault", cluster.deaths_by_db),
        zero("effects done twice", found.unsafe_repeated + found.keyed_repeated),
        zero("effects after a successful cancel", len(late)),
        zero("leases moved by a clock step", len(cluster.leases_moved)),
        zero("tasks held for a call that ran once", found.held_ran),
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
        Figure(FAULT, "heartbeat ages read in status", cluster.age_samples),
        zero("heartbeat ages below 0 or a day off", len(cluster.ages_off)),
        Figure(FAULT, "tasks completed %", pct, pct != 100.0),
        Figure(FAULT, "all tasks ended in time", str(finished), not finished),
        *failover_figures("kill -9", found.failover.get(KILL, []), plan),
        *failover_figures("SIGSTOP", found.failover.get(STOP, []), plan),
        *failover_figures("a cut", found.failover.get(CUT, []), plan),
        *failover_figures("a thawed duplicate", found.failover.get(TWIN, []), plan),
    ]
    told = [*cluster.deaths, *cluster.notes, *found.examples, *cluster.ages_off[:2]]
    told += [f"{m['task']}: {m.get('event')} in a clock step" for m in cluster.leases_moved[:2]]
    told += [f"{e['tag']} took effect after its cancel" for e in late[:2]]
    if told:
        out.append(Figure(FAULT, "examples", "; ".join(told)))
    return out


def frozen_figures(cluster: Cluster, effects: list[JSON]) -> list[Figure]:
    """The frozen tool: how often each action came, whether each command said what it
    must, and whether each task ended as decided (approved or rewound: done, charged
    once; cancelled: cancelled, charged never)."""
    runs = cluster.frozen
    by = Counter(run.action for run in runs)
    rows = cluster.status
    charges = Counter(str(line.get("tag")) for line in effects if line.get("kind") == "effect")
    ended = 0
    for run in runs:
        row = rows.get(run.task) or {}
        want = ("cancelled", 0) if run.action == nodefaults.CANCEL else ("done", 1)
        got = (row.get("state"), charges[f"{run.task}.1"])
        ended += got == want
        if got != want:
            cluster.notes.append(f"{run.task} ({run.action} on {run.node}): {got[0]} "
                                  f"({row.get('reason')}), charged {got[1]}")  # fmt: skip
    told = sum(run.told for run in runs)
    return [
        Figure(
            FAULT,
            "frozen tool: a node stopped past its lease mid unsafe call, then "
            + ", ".join(f"{a} {by[a]}" for a in nodefaults.ACTIONS),
            len(runs),
        ),
        Figure(
            FAULT,
            "frozen tool: hold, cancel or cut off line naming the node and its lease's end",
            told,
            told != len(runs),
        ),
        Figure(
            FAULT,
            "frozen tool: tasks ended as decided, charged once or never",
            ended,
            ended != len(runs),
        ),
    ]


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
        try:  # (a harness error says what the server logged last)
            cluster.start()
            cluster.top_up(rng)
            cluster.run_faults(rng)
            finished = cluster.finish(rng)
            cluster.status = status = cluster.rows()
            effects = read_log(cluster.effects)
            skewed = [
                (node, start + min(0, offset) - 1.0, end + max(0, offset) + 1.0)
                for node, start, end, offset in cluster.skewed
            ]
            found = audit(
                cluster.turns,
                status,
                journal_rows(url),
                claims_of(events_named(url, "task_claimed")),
                cluster.seen,
                effects,
                cluster.faults,
                others=cluster.extra,
                skewed=skewed,
            )
            cancels = [run.cancel for run in cluster.frozen if run.cancel is not None]
            late = effects_after(effects, cancels)
            fenced_workers = sum(map(len, events_named(url, "lease_lost").values()))
            crashes = server_crashes(db)
        except BaseException:
            say(f"PostgreSQL's log ends: {db.log.read_text()[-3000:] if db.log.exists() else ''}")
            raise
        finally:
            cluster.cleanup()
    return [
        *head,
        *figures(plan, cluster, found, finished, effects, late),
        Figure(FAULT, "workers fenced (lease_lost events)", fenced_workers),
        Figure(FAULT, "PostgreSQL server processes that crashed (its log)", len(crashes)),
        *([Figure(FAULT, "PostgreSQL crashes", "; ".join(crashes[:3]))] if crashes else []),
        Figure(FAULT, "runtime s", time.monotonic() - started),
    ]


def server_crashes(db: ThrowawayCluster) -> list[str]:
    """The lines where PostgreSQL says one of its processes died (and so every session
    was cut): none of the class's faults makes one, so each is told."""
    text = db.log.read_text(errors="replace") if db.log.exists() else ""
    return [line.strip()[:200] for line in text.splitlines() if "terminated by signal" in line]


def main(argv: list[str] | None = None) -> int:
    return campaign_main(run, "python -m tests.chaos.nodes", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
