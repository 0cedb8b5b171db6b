"""What an operator reads of the whole system, shared by the CLI and the console: the
status document (``agentd status --json``, docs/design.md section 3), the held calls
(``agentd dangling --json``) and the inbox of everything that waits for a person (the
console's ``GET /api/held``, section 12).

On a shared store (section 10) every one of them is the whole cluster's: the tasks are
read in one statement (``TaskStore.read_all``), each with the node that runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from supervisor.coordination import running_pid, supervisor_info
from supervisor.record import TaskRecord
from supervisor.status import held_calls, status_row
from supervisor.stores import store_for
from supervisor.submit import existing_task, listed_tasks
from worker import __version__
from worker.budget import BUILTIN_PRICES, Price
from worker.config import node_name as local_node
from worker.protocol import TaskStatus
from worker.spool import Spool, TaskDir

#: How the reason of a task held on its budget begins (docs/design.md section 13):
#: ``budget: $1.35 of $1.00``. Such a task waits for ``agentd budget``, not a decision.
BUDGET_REASON = "budget:"


class HeldTask(TypedDict):
    """A task that waits for a person without a held call (``GET /api/held``)."""

    task: str
    reason: str


def supervisor_json(spool: Spool) -> dict[str, Any]:
    """The ``supervisor`` object of the status document: the daemon on ``spool``."""
    pid = running_pid(spool)
    info = supervisor_info(spool) or {}
    return {
        "running": pid is not None,
        "pid": pid,
        "started_at": info.get("started_at") if pid else None,
        "cgroups": info.get("cgroups") if pid else None,
        "version": __version__,
        "spool": str(spool.root),
        "node": info.get("node") if pid else None,
        # how run_command runs, as the daemon probed it at start (docs/design.md section 3)
        "sandbox": info.get("sandbox") if pid else None,
        # the spool's size as the daemon last measured it (docs/design.md section 20)
        "spool_bytes": info.get("spool_bytes") if pid else None,
    }


#: How the status document reads one task's row: ``status_row``, or the running daemon's
#: rows, kept while the task's files stay as they were (``supervisor.status_socket``).
RowReader = Callable[[TaskDir, Mapping[str, Price]], dict[str, Any]]


def task_row(
    task: TaskDir,
    leases: dict[str, str] | None,
    node: str | None,
    prices: Mapping[str, Price] = BUILTIN_PRICES,
    read: RowReader = status_row,
) -> dict[str, Any]:
    """One task's row of the status document: ``status_row`` (its ``cost_usd`` at
    ``prices``: ``Config.price_table``; ``read``: how it is read) with its ``node`` (from
    ``leases`` on a shared store; else ``node``, this machine's, while its worker runs)."""
    row = dict(read(task, prices))
    if leases is not None:
        row["node"] = leases.get(task.id)
    else:
        row["node"] = (node or local_node()) if row["state"] == TaskStatus.RUNNING else None
    return row


def status_document(
    spool: Spool,
    task_id: str | Sequence[str] | None = None,
    prices: Mapping[str, Price] = BUILTIN_PRICES,
    read: RowReader = status_row,
) -> dict[str, Any]:
    """docs/design.md section 3: the daemon that answers, and every task (or ``task_id``,
    one id or several, each once, in the order given); on a shared store every task of
    the cluster, each with the node that runs it, and ``nodes``; each ``cost_usd`` at
    ``prices`` (``Config.price_table``); each row read with ``read``."""
    named = [task_id] if isinstance(task_id, str) else list(dict.fromkeys(task_id or ()))
    store = store_for(spool)
    cluster = spool.shared
    leases = cluster.leases() if cluster is not None else None
    rows = []
    sup = supervisor_json(spool)
    with store.read_all():
        task_dirs = [existing_task(spool, t) for t in named] if named else listed_tasks(spool)
        for task in task_dirs:
            if store.exists(task.id):
                rows.append(task_row(task, leases, sup["node"], prices, read))
    if not sup["running"] and cluster is None:
        for row in rows:  # (a task of `agentd run` is its run's: no daemon adopts it)
            task = spool.task(row["id"])
            if row["state"] == TaskStatus.RUNNING and not TaskRecord.load(task).foreground:
                unsupervised(row, store.owned(row["id"]))
    doc: dict[str, Any] = {"supervisor": sup, "tasks": rows}
    if cluster is not None:  # the node of this spool's daemon, else the one asking
        sup["node"] = sup["node"] or cluster.node
        doc["nodes"] = [n.to_json() for n in cluster.nodes()]
    return doc


#: The reason of a task whose worker runs on with no daemon (one killed, a kill -9).
RUNS_ON = "its worker runs on without a daemon; the next `agentd start` adopts it"


def unsupervised(row: dict[str, Any], alive: bool) -> None:
    """A task recorded running on a spool where no daemon runs (one was killed): its
    worker, in a session of its own, either runs on (``alive``: it holds the task's lock),
    and the next daemon adopts it, or ended too, and the next daemon resumes the task.
    The row says which, rather than a running task that nobody runs."""
    if alive:
        row["reason"] = RUNS_ON
        return
    row.update(state=TaskStatus.QUEUED, pid=None, phase=None, heartbeat_age=None, node=None)
    row["reason"] = "its worker ended while no daemon ran; the next `agentd start` resumes it"


def dangling_rows(spool: Spool, task_id: str | None = None) -> list[dict[str, Any]]:
    """``agentd dangling --json``: the held calls of every held task (or of ``task_id``)."""
    store = store_for(spool)
    rows: list[dict[str, Any]] = []
    with store.read_all():
        task_dirs = listed_tasks(spool) if task_id is None else [existing_task(spool, task_id)]
        for task in task_dirs:
            if TaskRecord.load(task).state == TaskStatus.HELD:
                rows += held_calls(task)
    return rows


def held_document(spool: Spool) -> dict[str, Any]:
    """The inbox of what waits for a person, across every task (``GET /api/held``): the
    held calls, as ``agentd dangling --json`` lists them, and the tasks held on their
    budget (held with no held call, their reason ``budget: ...``)."""
    store = store_for(spool)
    calls: list[dict[str, Any]] = []
    tasks: list[HeldTask] = []
    with store.read_all():
        for task in listed_tasks(spool):
            record = TaskRecord.load(task)
            if record.state != TaskStatus.HELD:
                continue
            held = held_calls(task)
            calls += held
            reason = record.reason or ""
            if not held and reason.startswith(BUDGET_REASON):
                tasks.append({"task": task.id, "reason": reason})
    return {"calls": calls, "tasks": tasks}
