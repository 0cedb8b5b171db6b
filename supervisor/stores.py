"""Which ``TaskStore`` the supervisor works on: chosen here, and nowhere else.

Every other module of the supervisor reaches a task's durable bytes through the store
this module hands out, typed as the ``TaskStore`` Protocol (``worker.store.base``), so
the backend is chosen here alone:

* the file store of the spool, by default (one per spool in a process: ``spool_store``,
  so that the daemon and the commands it runs share its ownership epochs);
* a shared store that several nodes serve (PostgreSQL: ``open_shared``, which the command
  line calls for ``--store``, ``$AGENTD_STORE`` or the config's ``store``), handed in with
  the spool (``Spool.on``): the ``shared`` of a ``Spool`` and of its ``TaskDir``s. No
  lookup is global: what a function works on is what it was given.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from worker.errors import ConfigError
from worker.spool import Spool, TaskDir
from worker.store.base import SharedStore, TaskStore
from worker.store.durable import atomic_write_json, load_json
from worker.store.files import spool_store

if TYPE_CHECKING:
    from worker.store.postgres import PostgresStore

#: What a command that needs the PostgreSQL store says where psycopg is not installed (a
#: plain ``pip install agentd``: it is the ``postgres`` extra).
PSYCOPG_MISSING = (
    "the PostgreSQL store needs psycopg, which is not installed: pip install 'agentd[postgres]'"
)


def postgres_store() -> type[PostgresStore]:
    """The PostgreSQL store's class; ``ConfigError`` saying how to install psycopg when
    it cannot be imported."""
    try:
        from worker.store.postgres import PostgresStore  # noqa: PLC0415  (psycopg: only with a store)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "psycopg":
            raise
        raise ConfigError(PSYCOPG_MISSING) from None
    return PostgresStore


def open_shared(url: str, *, node: str | None, lease: float, migrate: bool = False) -> SharedStore:
    """The PostgreSQL store at ``url`` (its schema checked, or created or migrated with
    ``migrate``: ``agentd start``, ``agentd store init``), for ``Spool.on``; its caller
    closes it."""
    return postgres_store()(url, node=node, lease=lease, migrate=migrate)


#: A node's spool records the store it serves (``record_store``), so that a command on
#: that spool without ``--store`` works on the cluster instead of an empty spool.
STORE_RECORD = "store.json"


def public_url(url: str) -> str:
    """``url`` without its password (in the netloc or a ``password=`` parameter): what
    may be written down; libpq finds the password in its usual places."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}@{host}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def record_store(root: Path, url: str) -> None:
    """Write down, in the spool at ``root``, the store a node on it serves (no password)."""
    atomic_write_json(root / STORE_RECORD, {"url": public_url(url)})


def recorded_store(root: Path) -> str | None:
    """The store a node on the spool at ``root`` served (``record_store``), or None."""
    with contextlib.suppress(OSError, ValueError):
        data = load_json((root / STORE_RECORD).read_bytes())
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            return str(data["url"])
    return None


def store_for(spool: Spool) -> TaskStore:
    """The store of the tasks of ``spool``: the shared one it is on, else its files."""
    return spool.shared if spool.shared is not None else spool_store(spool.root)


def store_of(task: TaskDir) -> TaskStore:
    """The store ``task`` lives in: the shared one its spool is on, else the spool's files."""
    return task.shared if task.shared is not None else spool_store(task.root)
