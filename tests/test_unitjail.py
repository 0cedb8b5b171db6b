"""The emulated systemd unit (``tests/unitjail.py``) and what it proves about the unit.

Under the unit as it shipped before (``RestrictNamespaces=yes``, no netlink, bwrap's
calls refused, /proc covered) bubblewrap cannot start, each obstacle on its own; under
the unit ``agentd unit`` prints now, it works, and a daemon's tasks run their commands
under it (the status row says ``bwrap``). The jail is checked too: it models every
directive of the shipped units (a new one fails ``test_the_jail_models_every_...``),
and its filters bite.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.unit import Installation, agentd_command, render
from tests import unitjail
from tests.daemon import Daemon, subreaper
from tests.support import REPO, reply, text, tool_use, worker_env
from tests.unitdaemon import USER, UnitDaemon, unit_text, why_not

UNIT = REPO / "systemd" / "agentd.service"

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"{why_not()}")

PROBE = "from worker.tools.sandbox import probe; print(probe('bwrap', False).problem)"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder of the unit's user, bound into the jail."""
    user = pwd.getpwnam(USER)
    path = tmp_path / "jail"
    path.mkdir()
    os.chown(path, user.pw_uid, user.pw_gid)
    return path


def in_jail(folder: Path, unit: str, *argv: str) -> subprocess.CompletedProcess[str]:
    path = folder / "agentd.service"
    path.write_text(unit)
    return subprocess.run(
        unitjail.command(path, USER, folder, list(argv)),
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def bwrap_problem(folder: Path, unit: str) -> str:
    """What ``worker.tools.sandbox.probe`` says of bwrap (network off: every namespace)
    as the unit's user in the jail: ``None`` when it works."""
    done = in_jail(folder, unit, sys.executable, "-c", PROBE)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def user_unit() -> str:
    install = Installation(agentd_command(), None, Path("/tmp/spool"), Path("/root"))
    return render(install, user=True)


@pytest.mark.parametrize(
    "unit",
    [UNIT.read_text, unit_text, lambda: unit_text(allow_jit=True), user_unit],
    ids=["systemd/agentd.service", "agentd unit", "agentd unit --allow-jit", "--user"],
)
def test_the_jail_models_every_directive_of_the_shipped_units(unit: object) -> None:
    assert callable(unit)
    assert unitjail.unmodelled(unit()) == []
    for reason in unitjail.UNMODELLED.values():
        assert reason.strip()


def test_a_directive_the_jail_does_not_model_stops_it(folder: Path) -> None:
    unit = unit_text().replace("[Service]\n", "[Service]\nProtectSomething=yes\n")
    done = in_jail(folder, unit, "/bin/true")
    assert done.returncode == 78
    assert "ProtectSomething" in done.stderr


def test_under_the_new_unit_bwrap_works_under_the_old_it_cannot(folder: Path) -> None:
    assert bwrap_problem(folder, unit_text()) == "None"
    old = bwrap_problem(folder, unitjail.old_unit(unit_text()))
    assert "No permissions to create new namespace" in old


#: Each allowance of the unit taken back alone, and what bwrap then says.
TAKEN_BACK = {
    "namespaces": (r"^RestrictNamespaces=.*$", "RestrictNamespaces=yes", "new namespace"),
    "net namespace": (
        r"^RestrictNamespaces=.*$",
        "RestrictNamespaces=user mnt pid ipc",
        "new namespace",
    ),
    "tunables": (r"^ProtectKernelTunables=no$", "ProtectKernelTunables=yes", "mount proc"),
    "kernel logs": (r"^ProtectKernelLogs=no$", "ProtectKernelLogs=yes", "mount proc"),
    "netlink": (r" AF_NETLINK$", "", "NETLINK"),
    "bwrap's calls": (r"^SystemCallFilter=mount .*\n", "", "bwrap"),
}


@pytest.mark.parametrize("what", TAKEN_BACK)
def test_each_allowance_is_needed(folder: Path, what: str) -> None:
    pattern, replacement, said = TAKEN_BACK[what]
    unit, count = re.subn(pattern, replacement, unit_text(), count=1, flags=re.MULTILINE)
    assert count == 1
    problem = bwrap_problem(folder, unit)
    assert problem != "None" and said in problem, problem


CHECKS = r"""
import ctypes, errno, mmap, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def refused(call):
    return call() != 0 and ctypes.get_errno()
out = {
    "uid": os.getuid(),
    "uts": refused(lambda: libc.unshare(0x04000000)) == errno.EPERM,
    "packet": None,
    "suid": None,
    "wx": None,
    "sys_ro": None,
}
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
except OSError as exc:
    out["packet"] = exc.errno == errno.EAFNOSUPPORT
open("f", "w").close()
try:
    os.chmod("f", 0o4755)
except OSError as exc:
    out["suid"] = exc.errno == errno.EPERM
libc.mmap.restype = ctypes.c_void_p
c_int = ctypes.c_int
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_long]
address = libc.mmap(None, 4096, 0x7, 0x22, -1, 0)  # PROT_READ|WRITE|EXEC, PRIVATE|ANONYMOUS
out["wx"] = address in (None, ctypes.c_void_p(-1).value)
mounts = [line.split() for line in open("/proc/self/mountinfo")]
out["sys_ro"] = any(m[4] == "/proc/sys" and "ro" in m[5].split(",") for m in mounts)
print(__import__("json").dumps(out))
"""


def test_the_jails_filters_bite(folder: Path) -> None:
    """As the unit's user, with its filters: no UTS namespace, no packet socket, no
    set-user-ID file, no memory both writable and executable (unless --allow-jit), and
    /proc/sys read-only only under ProtectKernelTunables=yes."""

    def checks(unit: str) -> dict[str, object]:
        script = f"import os; os.chdir({str(folder)!r})\n{CHECKS}"
        done = in_jail(folder, unit, sys.executable, "-c", script)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    found = checks(unit_text())
    assert found == {
        "uid": pwd.getpwnam(USER).pw_uid,
        "uts": True,
        "packet": True,
        "suid": True,
        "wx": True,
        "sys_ro": False,
    }
    assert checks(unit_text(allow_jit=True))["wx"] is False
    assert checks(unitjail.old_unit(unit_text()))["sys_ro"] is True


# -- a daemon under the unit -----------------------------------------------------------


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    with subreaper():
        try:
            yield daemons
        finally:
            for daemon in daemons:
                daemon.cleanup()


COMMAND = [reply(tool_use("run_command", command="echo inside > out.txt")), reply(text("Done."))]


def test_a_daemon_under_the_unit_runs_commands_under_bwrap(
    tmp_path: Path, made: list[Daemon]
) -> None:
    daemon = UnitDaemon(tmp_path / "d", '[tools]\nsandbox = "required"\n')
    made.append(daemon)
    daemon.start(timeout=60)
    task = daemon.submit(COMMAND, name="t")
    row = daemon.wait_state(task, "done", timeout=60)
    assert row["sandbox"] == "bwrap"
    assert (daemon.task(task).path / "workspace" / "out.txt").read_text() == "inside\n"
    assert (daemon.task(task).path / "workspace" / "out.txt").stat().st_uid != 0
    _, out, _ = daemon.cli("status")
    assert "run_command sandbox: bwrap" in out.splitlines()[0]


def test_under_the_old_unit_auto_runs_bare_and_says_so_required_refuses_to_start(
    tmp_path: Path, made: list[Daemon]
) -> None:
    old = unitjail.old_unit(unit_text())
    bare = UnitDaemon(tmp_path / "auto", "", unit=old)
    made.append(bare)
    bare.start(timeout=60)
    assert [e for e in bare.log_events() if e.get("event") == "sandbox_unavailable"]
    task = bare.submit(COMMAND, name="t")
    assert bare.wait_state(task, "done", timeout=60)["sandbox"].startswith("bare: ")
    _, out, _ = bare.cli("status")
    assert "run_command sandbox: bare: " in out.splitlines()[0]

    refused = UnitDaemon(tmp_path / "required", '[tools]\nsandbox = "required"\n', unit=old)
    made.append(refused)
    done = refused.run_cli("start")
    assert done.returncode == 78, done
    assert done.stderr.startswith("agentd: tools.sandbox: ") and done.stderr.count("\n") == 1


def test_submit_refuses_a_workspace_in_the_hosts_tmp_which_the_unit_does_not_see(
    tmp_path: Path, made: list[Daemon]
) -> None:
    """The unit's PrivateTmp= gives the daemon a /tmp of its own: ``submit --workspace``
    of a folder in the host's /tmp says so in one line (exit 2) instead of queueing a task
    whose workspace the daemon would make empty in its own /tmp. A folder the unit binds
    back (its state directory) is taken (the control)."""
    daemon = UnitDaemon(tmp_path / "d", '[tools]\nsandbox = "required"\n')
    made.append(daemon)
    daemon.start(timeout=60)
    host_tmp = daemon.give(Path(tempfile.mkdtemp(prefix="agentd-ws-", dir="/tmp")))
    try:
        code, out, err = daemon.cli("submit", "--prompt", "x", "--workspace", str(host_tmp))
        assert code == 2 and out == "", err
        assert err.count("\n") == 1
        assert f"--workspace {host_tmp}: the daemon on {daemon.spool.root}" in err
        assert "has a /tmp of its own (systemd's PrivateTmp=), where this folder is not" in err
        with daemon.as_user():
            (daemon.root / "ws").mkdir()
        code, out, err = daemon.cli(
            "submit", "--prompt", "x", "--workspace", str(daemon.root / "ws")
        )
        assert code == 0, err
    finally:
        shutil.rmtree(host_tmp, ignore_errors=True)


def test_a_server_in_the_hosts_tmp_says_the_unit_has_a_tmp_of_its_own(
    tmp_path: Path, made: list[Daemon]
) -> None:
    """An MCP server (a script, run by Python) a user put in the host's /tmp is not in the
    /tmp of a daemon under the unit: `agentd config check` there fails in one line that
    says so, after the server's own last words."""
    host_tmp = Path(tempfile.mkdtemp(prefix="agentd-server-", dir="/tmp"))
    try:
        server = host_tmp / "server.py"
        server.write_text("print('never reached')\n")
        config = (
            '[tools]\nsandbox = "required"\n'
            f'[mcp.servers.mine]\ncommand = ["python3", "{server}"]\n'
        )
        daemon = UnitDaemon(tmp_path / "d", config)
        made.append(daemon)
        done = daemon.run_cli("config", "check", timeout=120)
        assert done.returncode == 1, done  # (a server that cannot start here: marked, exit 1)
        assert done.stderr.count("\n") == 1, done.stderr
        assert "mcp.servers.mine: cannot start:" in done.stderr
        assert (
            f"{server} does not exist here: it is under the host's temporary folder, which a "
            "daemon run by `agentd unit` (PrivateTmp=) has a fresh copy of" in done.stderr
        )
    finally:
        shutil.rmtree(host_tmp, ignore_errors=True)
