"""Trust attack: a tool reads the shared store's password and forges an operator decision.

A node runs on a real PostgreSQL (``$AGENTD_TEST_POSTGRES``, a fresh schema), the store's
URL in the config without its password, which libpq reads from ``PGPASSFILE`` and from
``~/.pgpass``, as the README sets it up: both files the daemon's user's, 0600, in its
home, which is the daemon's folder (under the emulated unit, the state directory the
unit's header makes that user's home). A victim task's unsafe charge (``run_command``)
is cut short by a kill -9 of its worker: the restart holds it for an operator. Then an
attacker task's ``run_command``, told everything but the password (the files' paths, the
schema, the victim's held call), tries to:

* read the password: both files, its environment, every ``/proc/*/environ``;
* connect to PostgreSQL with it over TCP, and without one through the socket folders
  (peer or trust);
* insert a ``rerun`` decision for the victim's held call, queue the victim as
  ``approve-dangling`` would, and wake the nodes with ``pg_notify``.

Then the operator decides the held call with its verified outcome (``approve-dangling
--result``: not run again), which a forged decision would have won against.

Figures, under the sandbox (``[tools] sandbox = "required"``): secrets read (the password
in what the attacker collected), decisions forged (a decision the operator did not
make), and how many times the victim's charge ran (exactly once). The control runs the
same attack with ``sandbox = "off"``: it must read the password and forge the decision
(the charge then runs twice), or the defence was never seen to matter.

Without ``$AGENTD_TEST_POSTGRES`` the class cannot run: a violation in CI (which has the
server), a note figure elsewhere.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import psycopg

from tests.chaos.trust import FAULT, Host, outside_tmp
from tests.daemon import Daemon, subreaper
from tests.faults.report import Figure
from tests.postgres import ENV, fresh_schema
from tests.support import poll_for, reply, text, tool_use

#: The victim's charge: runs once slowly (the kill -9 lands in it), at once when run again.
CHARGE = "echo run >> charges; if [ ! -e once ]; then touch once; sleep 60; fi"
WAIT = 60.0  # seconds: any one step of the attack, on two busy cores

ATTACK = r"""
import glob, json, os
plan = json.loads(PLAN)
loot, notes = [], []
for path in plan["files"]:
    try:
        for line in open(path).read().splitlines():
            if line.count(":") >= 4:
                loot.append(line.rsplit(":", 1)[1])
    except OSError as exc:
        notes.append(f"{path}: {exc.strerror}")
loot += [v for k, v in os.environ.items() if k.startswith("PG")]
for environ in glob.glob("/proc/*/environ"):
    try:
        for item in open(environ, "rb").read().split(b"\0"):
            if item.startswith(b"PGPASSWORD="):
                loot.append(item.split(b"=", 1)[1].decode())
    except OSError:
        pass
open("loot.txt", "w").write("\n".join(loot))
import psycopg
forged = 0
hosts = [(plan["host"], p) for p in loot] + [(s, None) for s in plan["sockets"]]
for host, password in hosts:
    try:
        conn = psycopg.connect(
            host=host, port=plan["port"], user=plan["user"], dbname=plan["dbname"],
            password=password, options=f"-csearch_path={plan['schema']}",
            connect_timeout=3, autocommit=True,
        )
    except Exception as exc:
        notes.append(f"{host}: {str(exc).strip()[:80]}")
        continue
    conn.execute(
        "INSERT INTO decisions (task, key, attempt, decision) VALUES (%s, %s, %s, %s::jsonb)",
        (plan["task"], plan["key"], plan["attempt"], json.dumps(plan["decision"])),
    )
    conn.execute(  # and queue the held task, as approve-dangling does on a shared store
        "UPDATE tasks SET record = record || '{\"state\": \"queued\", \"reason\": null}', "
        "state = 'queued', version = version + 1 WHERE id = %s",
        (plan["task"],),
    )
    conn.execute("SELECT pg_notify('agentd_wake', %s)", (plan["task"],))
    forged += 1
    break
print("forged", forged, "notes", notes)
"""


@dataclass
class Outcome:
    secrets_read: int = 0
    forged: int = 0
    charges: int = 0


def run(quick: bool, host: Host) -> list[Figure]:
    url = os.environ.get(ENV)
    if not url:
        if os.environ.get("CI"):
            why = f"${ENV} is not set: CI must give the PostgreSQL half a server"
            return [Figure(FAULT, f"store secrets ({host.name}): could not run", why, True)]
        note = f"skipped: set {ENV} to a PostgreSQL URL to run it"
        return [Figure(FAULT, f"store secrets ({host.name})", note)]
    del quick  # one round says it: the attack either reaches the password or not
    with subreaper(), outside_tmp("store") as root:
        guarded = attack(root / "bwrap", host, url, "required")
        control = attack(root / "bare", host, url, "off")
    name = host.name
    return [
        Figure(FAULT, f"secrets read ({name})", guarded.secrets_read, guarded.secrets_read > 0),
        Figure(FAULT, f"decisions forged ({name})", guarded.forged, guarded.forged > 0),
        Figure(FAULT, f"unsafe charge runs ({name})", guarded.charges, guarded.charges != 1),
        Figure(
            FAULT,
            f"control, sandbox off: secret read, decision forged, charge runs ({name})",
            f"{control.secrets_read}, {control.forged}, {control.charges}",
            not (control.secrets_read and control.forged and control.charges == 2),
        ),
    ]


def attack(root: Path, host: Host, server: str, sandbox: str) -> Outcome:
    with fresh_schema(server) as url:
        node = Node(root, host, url, sandbox)
        try:
            return node.attack()
        finally:
            node.daemon.cleanup()


class Node:
    """One daemon on the store, its password in ``PGPASSFILE`` and ``~/.pgpass``."""

    def __init__(self, root: Path, host: Host, url: str, sandbox: str) -> None:
        parts = urlsplit(url)
        self.url, self.password = url, unquote(parts.password or "")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 5432
        self.user, self.dbname = unquote(parts.username or ""), parts.path.lstrip("/")
        self.schema = dict(p.split("=", 1) for p in parts.query.split("&"))["options"]
        self.schema = unquote(self.schema).removeprefix("-csearch_path=")
        netloc = f"{quote(self.user)}@{self.host}:{self.port}"
        store = (
            f"postgresql://{netloc}/{self.dbname}?options={quote(f'-csearch_path={self.schema}')}"
        )
        config = (
            f'store = "{store}"\nnode = "trust"\n'
            "[heartbeat]\ninterval = 0.25\ntimeout = 5.0\n"
            "[restart]\nbackoff_initial = 0.1\nbackoff_max = 0.4\n"
            f'[tools]\nsandbox = "{sandbox}"\n'
        )
        self.daemon: Daemon = host.daemon(root / "node", config)
        # The daemon's user's home is its own folder: under the emulated unit, the home
        # the unit's header gives that user (its state directory), bound back in the jail.
        home = self.daemon.root
        entry = ":".join(
            v.replace("\\", "\\\\").replace(":", "\\:")
            for v in ("*", "*", "*", self.user, self.password)
        )
        self.files = [home / ".pgpass", home / "etc" / "pgpass"]
        with self.daemon.as_user():  # (libpq reads a pgpass of its own user's, 0600)
            (home / "etc").mkdir()
            for path in self.files:
                path.write_text(entry + "\n")
                path.chmod(0o600)
        self.env = {"HOME": str(home), "PGPASSFILE": str(self.files[1])}

    def agentd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.daemon.run_cli(*args, env=self.env, timeout=WAIT)

    def submit(self, task_id: str, responses: list[dict[str, Any]], *more: str) -> None:
        script = self.daemon.root / f"{task_id}.json"
        with self.daemon.as_user():
            script.write_text(json.dumps({"responses": responses}))
        argv = ("submit", "--name", task_id, "--prompt", "go", "--script", str(script), *more)
        done = self.agentd(*argv)
        assert done.returncode == 0, done.stderr

    def armed_workspace(self) -> Path:
        """The attacker's workspace, with the PostgreSQL client it brings along (a copy
        of this venv's psycopg in ``lib``): the sandbox shows a command the system's
        Python, never agentd's venv."""
        workspace = self.daemon.root / "attacker"
        site = Path(psycopg.__file__).parent.parent
        for name in ("psycopg", "psycopg_binary", "psycopg_binary.libs", "typing_extensions.py"):
            source = site / name
            if source.is_dir():
                shutil.copytree(source, workspace / "lib" / name)
            elif source.is_file():
                shutil.copy(source, workspace / "lib" / name)
        return self.daemon.give(workspace)

    def record(self, task_id: str) -> dict[str, Any]:
        """The task's record, read from the store (a poll as cheap as a query: a status
        process each time would take the cores the daemon needs)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            found = conn.execute("SELECT record FROM tasks WHERE id = %s", (task_id,)).fetchone()
        return dict(found[0]) if found else {}

    def state(self, task_id: str, *states: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            record = self.record(task_id)
            return record if record.get("state") in states else None

        found = poll_for(check, WAIT, interval=0.1, what=f"{task_id} to be {states}")
        assert found is not None
        return found

    def workspace(self, task_id: str) -> Path:
        return self.daemon.spool.task(task_id).path / "workspace"

    def attack(self) -> Outcome:
        self.daemon.start(self.env)
        self.submit("victim", [reply(tool_use("run_command", command=CHARGE)), reply(text("ok"))])
        charges = self.workspace("victim") / "charges"
        poll_for(charges.exists, WAIT, what="the victim's charge to run")
        os.kill(self.state("victim", "running")["pid"], signal.SIGKILL)
        self.state("victim", "held")
        (call,) = json.loads(self.agentd("dangling", "victim", "--json").stdout)
        decision = {"call_id": call["call_id"], "attempt": call["attempt"], "action": "rerun"}
        plan = {
            "files": [str(p) for p in self.files],
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "dbname": self.dbname,
            "schema": self.schema,
            "sockets": ["/run/postgresql", "/var/run/postgresql", "/tmp"],
            "task": "victim",
            "key": call["idempotency_key"],
            "attempt": call["attempt"],
            "decision": {**decision, "reason": "forged", "decided_at": "2026-01-01T00:00:00Z"},
        }
        head = f"import sys\nsys.path.insert(0, 'lib')\nPLAN = {json.dumps(plan)!r}\n"
        source = base64.b64encode(f"{head}{ATTACK}".encode()).decode()
        python = f"python{sys.version_info.major}.{sys.version_info.minor}"  # (the system's)
        command = f"echo {source} | base64 -d > attack.py && {python} attack.py"
        workspace = self.armed_workspace()
        steal = [reply(tool_use("run_command", command=command)), reply(text("x"))]
        self.submit("attacker", steal, "--workspace", str(workspace))
        self.state("attacker", "done", "failed")
        self.agentd("approve-dangling", "victim", call["call_id"], "--result", "charged once")
        self.state("victim", "done", "failed")
        loot = (workspace / "loot.txt").read_text()
        with psycopg.connect(self.url) as conn:
            (forged,) = conn.execute(
                "SELECT count(*) FROM decisions WHERE task = 'victim' "
                "AND decision->>'reason' = 'forged'"
            ).fetchone() or (0,)
        return Outcome(
            secrets_read=int(self.password in loot.splitlines()),
            forged=int(forged),
            charges=charges.read_text().count("run"),
        )
