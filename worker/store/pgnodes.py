"""The nodes of a cluster in the PostgreSQL store (docs/design.md section 10): a daemon
registers its process as its node under the name's next epoch (``join``), renews that
registration with its leases (``TaskLeases.renew_all``), and frees the name as it stops
(``leave``); ``nodes`` lists the live ones."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from worker.errors import ConfigError
from worker.store import pgschema
from worker.store.base import NodeInfo

if TYPE_CHECKING:
    from worker.store.pgdatabase import Database


class NodeRegistry:
    """The node table as node ``node`` sees it, with ``lease`` seconds for a registration
    to count as live. ``registration`` is this process's registration as the node
    (epoch, pid, host, workers), while it holds one."""

    def __init__(self, db: Database, node: str, lease: float) -> None:
        self._db = db
        self._node = node
        self._lease = lease
        self.registration: tuple[int, int, str, int] | None = None

    def join(self, max_workers: int) -> int:
        """Register this process as the node, under the name's next epoch; a live daemon
        of another process that holds the name refuses it (``ConfigError``), and so does
        another registration of this one's (``SupersededError``'s: one that came after)."""
        host, pid = socket.gethostname(), os.getpid()
        mine = self.registration[0] if self.registration is not None else None
        with self._db.step() as conn:
            other = conn.execute(
                "SELECT host, pid FROM nodes WHERE name = %s AND seen_at > now() - "
                "make_interval(secs => %s) AND CASE WHEN %s::bigint IS NULL THEN "
                "(host, pid) <> (%s, %s) ELSE (host, pid, epoch) <> (%s, %s, %s) END",
                (self._node, self._lease, mine, host, pid, host, pid, mine),
            ).fetchone()
            if other is not None and not (other[0] == host and not _pid_alive(int(other[1]))):
                # (a row of this host whose process is gone: this node's last life, which
                # crashed; a service manager restarts it at once, before a lease is over)
                raise ConfigError(
                    f"node name {self._node!r} is in use by a live node (pid {other[1]} on "
                    f"{other[0]}); give this node another name with --node or `node`."
                )
            epoch = conn.execute(
                "INSERT INTO nodes (name, host, pid, max_workers, schema_version, epoch) "
                "VALUES (%s, %s, %s, %s, %s, 1) ON CONFLICT (name) DO UPDATE SET "
                "host = excluded.host, pid = excluded.pid, max_workers = excluded.max_workers, "
                "schema_version = excluded.schema_version, seen_at = now(), "
                "epoch = nodes.epoch + 1, "
                "started_at = CASE WHEN (nodes.host, nodes.pid) = (excluded.host, excluded.pid) "
                "THEN nodes.started_at ELSE now() END RETURNING epoch",
                (self._node, host, pid, max_workers, pgschema.SCHEMA_VERSION),
            ).fetchone()[0]  # type: ignore[index]  # (an upsert returns its row)
        self.registration = (int(epoch), pid, host, max_workers)
        return int(epoch)

    def leave(self) -> None:
        """The name is free: its row stays (pid 0, never seen), so that the next daemon to
        register it takes the next epoch, never one a frozen daemon may still hold."""
        self.registration = None
        with self._db.step() as conn:
            conn.execute(
                "UPDATE nodes SET pid = 0, seen_at = '-infinity' "
                "WHERE name = %s AND (host, pid) = (%s, %s)",
                (self._node, socket.gethostname(), os.getpid()),
            )

    def nodes(self) -> list[NodeInfo]:
        with self._db.step() as conn:
            rows = conn.execute(
                "SELECT n.name, n.host, n.pid, n.max_workers, "
                "extract(epoch FROM now() - n.seen_at)::float8, "
                "(SELECT count(*) FROM tasks t "
                "WHERE t.node = n.name AND t.lease_expires IS NOT NULL), "
                "n.epoch FROM nodes n WHERE n.pid > 0 ORDER BY n.name"
            ).fetchall()
        return [
            NodeInfo(
                name, host, pid, workers, int(tasks), max(0.0, age), age <= self._lease, int(epoch)
            )
            for name, host, pid, workers, age, tasks, epoch in rows
        ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
