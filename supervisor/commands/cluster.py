"""The cluster: ``agentd nodes`` (the nodes that share the store; on the spool's files, this
machine alone) and ``agentd store init`` (its schema)."""

from __future__ import annotations

import argparse

from supervisor.commands.context import out
from supervisor.commands.parsing import Commands, json_flag
from supervisor.coordination import running_pid
from supervisor.overview import status_document
from worker.config import Config
from worker.config import node_name as local_node
from worker.errors import UsageError
from worker.protocol import TaskStatus
from worker.spool import Spool
from worker.store.pgschema import SCHEMA_VERSION


def add_parser(commands: Commands) -> None:
    p = commands.add("nodes", cmd_nodes, "the nodes that share the store")
    json_flag(p, "the nodes")
    p = commands.add("store", cmd_store, "the shared store's schema", reads_spool=False)
    p.add_argument("action", choices=("init",), metavar="init", help="create or migrate the schema")


def cmd_nodes(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """The nodes that share the store; on the spool's files, this machine alone."""
    cluster = spool.shared
    if cluster is not None:
        nodes = [n.to_json() for n in cluster.nodes()]
    else:
        pid = running_pid(spool)
        running = status_document(spool)["tasks"]
        nodes = [
            {
                "name": local_node(),
                "host": local_node(),
                "pid": pid,
                "epoch": None,
                "max_workers": config.max_workers,
                "tasks": sum(1 for t in running if t["state"] == TaskStatus.RUNNING),
                "heartbeat_age": None,
                "alive": pid is not None,
            }
        ]
    if args.json:
        out(nodes)
        return 0
    print(
        f"{'NAME':<16} {'HOST':<20} {'PID':>8} {'EPOCH':>5} {'TASKS':>5} {'MAX':>4} {'SEEN':>7}  "
        "STATE"
    )
    for n in nodes:
        age = n["heartbeat_age"]
        seen = f"{age:.1f}s" if isinstance(age, (int, float)) else "-"
        state = "alive" if n["alive"] else "gone"
        print(
            f"{n['name']:<16} {n['host']:<20} {n['pid'] or '-':>8} {n['epoch'] or '-':>5} "
            f"{n['tasks']:>5} "
            f"{n['max_workers']:>4} {seen:>7}  {state}"
        )
    return 0


def cmd_store(args: argparse.Namespace, config: Config, spool: Spool) -> int:
    """``agentd store init``: ``main`` created or migrated the schema already."""
    cluster = spool.shared
    if cluster is None:
        raise UsageError(
            "no shared store is given; name one with --store URL, $AGENTD_STORE or `store`."
        )
    print(f"agentd store {cluster!r}: schema version {SCHEMA_VERSION}, ready")
    return 0
