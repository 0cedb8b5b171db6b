"""A throwaway PostgreSQL server: initdb in a temp folder, 127.0.0.1 only, removed after.

Several nodes share one PostgreSQL (docs/design.md section 10), and three places need a real
one without asking the user to set it up: ``agentd demo --cluster``, the test suite (and
``.ci/run``, through ``python -m supervisor.pgcluster``), and ``bench/cluster.py``. This
module is that server, from the PostgreSQL binaries already on the machine; it never
installs anything, and when the binaries are missing it says in one line how to get them.

It lives in ``supervisor/`` because only the daemon side (the demo) and its tests and
benchmarks start a database; a worker only ever connects to one.

The server runs as an unprivileged user: PostgreSQL refuses to run as root, so under root
the folder is handed to ``postgres`` (or ``nobody``) and every server command runs as that
user. It listens on 127.0.0.1 only, on a free port, with a random password (so the URL
carries a secret, as a real deployment's does), and its unix socket stays in the folder.
Only the standard library is used: ``.ci/run`` starts it before anything else is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from worker.errors import ClusterError

#: The one line a machine without the server binaries gets.
HOW_TO_GET = (
    "the PostgreSQL server binaries (initdb, pg_ctl, postgres) are not on this machine: "
    "install them with `apt-get install postgresql` (or put their bin folder on PATH)"
)

#: The role the throwaway server is made with, and the database its URL names.
ROLE = "agentd"
DATABASE = "postgres"

#: Users a root caller hands the server to, the first that exists.
UNPRIVILEGED_USERS = ("postgres", "nobody")

#: Server settings: local only; room for a benchmark's 200 clients besides the suite's.
#: Durability settings stay PostgreSQL's defaults (fsync, synchronous_commit on): the
#: benchmark measures real commits.
SETTINGS = {"listen_addresses": "127.0.0.1", "max_connections": "300"}

START_TIMEOUT = 60.0
_STATE_FILE = "cluster.json"


def _versioned_bins() -> list[Path]:
    """Debian's ``/usr/lib/postgresql/N/bin``, newest first."""
    found = Path("/usr/lib/postgresql").glob("*/bin")
    return sorted(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)[::-1]


def find_binaries(path: str | None = None, fallbacks: Sequence[Path] | None = None) -> Path:
    """The folder holding initdb, pg_ctl and postgres: found through ``path`` (default
    ``$PATH``; symlinks resolved, so ``/usr/local/bin/pg_ctl`` pointing into Debian's
    folder counts), else the first of ``fallbacks`` that has them (default: the newest
    ``/usr/lib/postgresql/*/bin``, then ``/usr/local/pgsql/bin``).

    Raises ClusterError with HOW_TO_GET when none has all three."""
    candidates: list[Path] = []
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name, path=path)
        if found:
            candidates.append(Path(found).resolve().parent)
    if fallbacks is None:
        fallbacks = [*_versioned_bins(), Path("/usr/local/pgsql/bin")]
    for folder in [*candidates, *fallbacks]:
        if all(os.access(folder / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return folder
    raise ClusterError(HOW_TO_GET)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the server may still lose
    it to a race; ``start`` then tries another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class ServerUser:
    """Who the server runs as: the caller itself, or (under root) an unprivileged user."""

    uid: int
    gid: int

    @classmethod
    def for_caller(cls) -> ServerUser:
        if os.geteuid() != 0:
            return cls(os.getuid(), os.getgid())
        for name in UNPRIVILEGED_USERS:
            with contextlib.suppress(KeyError):
                entry = pwd.getpwnam(name)
                return cls(entry.pw_uid, entry.pw_gid)
        raise ClusterError(
            "PostgreSQL will not run as root and no unprivileged user exists to run it: "
            f"create one of {', '.join(UNPRIVILEGED_USERS)} (useradd --system postgres)"
        )

    @property
    def is_caller(self) -> bool:
        return self.uid == os.getuid()

    def check_reaches(self, folder: Path) -> None:
        """Raise ClusterError unless this user may enter ``folder`` and every folder above
        it (a root-only pytest temp dir, say, is closed to it)."""
        for step in [folder, *folder.parents]:
            mode = step.stat()
            if not (
                mode.st_mode & stat.S_IXOTH
                or (mode.st_uid == self.uid and mode.st_mode & stat.S_IXUSR)
                or (mode.st_gid == self.gid and mode.st_mode & stat.S_IXGRP)
            ):
                raise ClusterError(
                    f"PostgreSQL runs as uid {self.uid}, who cannot enter {step}: "
                    "make its folder somewhere that user can reach (the system temp dir)"
                )


class ThrowawayCluster:
    """One PostgreSQL server in its own folder (``root``): data, socket, log.

    Use as a context manager, or ``create`` then ``remove``; ``stop`` and ``start`` restart
    it on the same port and password (a test that restarts the database mid-run)::

        with ThrowawayCluster.create() as cluster:
            connect(cluster.url)
    """

    def __init__(
        self, root: Path, bindir: Path, user: ServerUser, port: int, password: str
    ) -> None:
        self.root = root
        self.bindir = bindir
        self.user = user
        self.port = port
        self.password = password
        # more environment for the server from its next start (a test's clock shim)
        self.server_env: dict[str, str] = {}

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        """A libpq URL with the password in it: a secret, as any store URL is."""
        return f"postgresql://{ROLE}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    # -- life cycle -------------------------------------------------------------------

    @classmethod
    def create(cls, parent: Path | None = None) -> ThrowawayCluster:
        """initdb in a fresh temp folder under ``parent`` (default: the system's), then
        start; the folder is removed again if anything fails."""
        bindir = find_binaries()
        user = ServerUser.for_caller()
        root = Path(tempfile.mkdtemp(prefix="agentd-pg-", dir=parent))
        cluster = cls(root, bindir, user, free_port(), secrets.token_urlsafe(18))
        try:
            if not user.is_caller:
                user.check_reaches(root.parent)
                os.chown(root, user.uid, user.gid)
            cluster._initdb()
            cluster.start()
        except BaseException:
            cluster.remove()
            raise
        return cluster

    def _initdb(self) -> None:
        pwfile = self.root / "password"
        pwfile.write_text(self.password + "\n")
        pwfile.chmod(0o600)
        if not self.user.is_caller:
            os.chown(pwfile, self.user.uid, self.user.gid)
        try:
            self._run(
                "initdb", "--pgdata", str(self.data), "--username", ROLE,
                "--pwfile", str(pwfile), "--auth", "scram-sha-256",
                "--encoding", "UTF8", "--locale", "C", "--no-instructions",
            )  # fmt: skip
        finally:
            pwfile.unlink(missing_ok=True)

    def start(self) -> None:
        """Start the server and return once it accepts connections; a port lost to a race
        is replaced by another free one (the URL changes only then)."""
        for _ in range(5):
            settings = {
                **SETTINGS,
                "port": str(self.port),
                "unix_socket_directories": str(self.root),
            }
            options = " ".join(f"-c {key}={shlex.quote(value)}" for key, value in settings.items())
            try:
                self._run(
                    "pg_ctl", "start", "--pgdata", str(self.data), "--log", str(self.log),
                    "--wait", "--timeout", str(int(START_TIMEOUT)), "--options", options,
                    env=self.server_env,
                )  # fmt: skip
            except ClusterError:
                if "could not bind" not in self._log_tail():
                    raise
                self.port = free_port()
                continue
            self._wait_accepting()
            return
        raise ClusterError(f"PostgreSQL found no free port to listen on: {self._log_tail()}")

    def stop(self, *, immediate: bool = False) -> None:
        """Stop the server: ``fast`` (sessions ended, clean shutdown) or ``immediate`` (as
        if the machine lost power: recovery on the next start). A server already down is
        fine."""
        if not (self.data / "postmaster.pid").exists():
            return
        mode = "immediate" if immediate else "fast"
        try:
            self._run("pg_ctl", "stop", "--pgdata", str(self.data), "--mode", mode, "--wait")
        except ClusterError:
            self._kill_postmaster()

    def remove(self) -> None:
        """Stop the server and delete its folder, whatever state either is in."""
        with contextlib.suppress(ClusterError, OSError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    # -- helpers ----------------------------------------------------------------------

    def _run(self, tool: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Run one server tool as the server's user (with ``env`` added to what it
        inherits, but for libpq's variables); a failure is one ClusterError line."""
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PG")}, **(env or {})}
        env["LC_ALL"] = "C"
        handed = not self.user.is_caller
        done = subprocess.run(
            [str(self.bindir / tool), *args],
            cwd=self.root,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=START_TIMEOUT + 30,
            user=self.user.uid if handed else None,
            group=self.user.gid if handed else None,
            extra_groups=[] if handed else None,  # none of root's groups
        )
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            reason = said[-1] if said else f"exit {done.returncode}"
            raise ClusterError(f"PostgreSQL {tool} failed in {self.root}: {reason}")

    def _wait_accepting(self) -> None:
        """pg_ctl --wait returns once the postmaster says it is ready; the TCP accept
        confirms it on the address the URL names."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ClusterError(
                        f"PostgreSQL started but does not accept connections on "
                        f"127.0.0.1:{self.port}: {exc}"
                    ) from exc
                time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def _kill_postmaster(self) -> None:
        """The last resort when pg_ctl cannot stop it: SIGKILL the postmaster; its
        children exit when they see it gone."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)

    # -- a server that outlives this process (.ci/run) --------------------------------

    def save(self) -> None:
        """Write what ``load`` needs to find this server again from another process."""
        state = {"bindir": str(self.bindir), "uid": self.user.uid, "gid": self.user.gid,
                 "port": self.port, "password": self.password}  # fmt: skip
        path = self.root / _STATE_FILE
        path.write_text(json.dumps(state))
        path.chmod(0o600)

    @classmethod
    def load(cls, root: Path) -> ThrowawayCluster:
        state = json.loads((root / _STATE_FILE).read_text())
        user = ServerUser(int(state["uid"]), int(state["gid"]))
        return cls(root, Path(state["bindir"]), user, int(state["port"]), str(state["password"]))


def main(argv: list[str] | None = None) -> int:
    """``python -m supervisor.pgcluster up`` starts a server in a new temp folder and
    prints ``FOLDER URL``; ``down FOLDER`` stops it and removes the folder."""
    parser = argparse.ArgumentParser(
        prog="python -m supervisor.pgcluster", description=main.__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a throwaway server; print its folder and URL")
    up.add_argument("--parent", type=Path, help="where to make its folder (default: the temp dir)")
    down = commands.add_parser("down", help="stop a server started by `up` and remove it")
    down.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cluster = ThrowawayCluster.create(args.parent)
            cluster.save()
            print(cluster.root, cluster.url)
        else:
            ThrowawayCluster.load(args.folder).remove()
    except (ClusterError, OSError, ValueError, KeyError) as exc:
        print(f"pgcluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
