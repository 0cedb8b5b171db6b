"""A real daemon under the emulated systemd unit (``tests.unitjail``), as a ``Daemon``.

``UnitDaemon(root, config)`` behaves as ``tests.daemon.Daemon`` does (spool, cli,
submit, wait_state, cleanup...), except that ``agentd start`` (and ``run_cli``) run in
the jail as the unit's unprivileged user (``nobody`` here: the machine runs as root),
with the seccomp filters and mounts of the unit ``agentd unit`` prints, or of the unit
``unit`` says (``old_unit``: the control). The user's home there is ``root``, as the
unit's header makes it (``useradd --home-dir /var/lib/agentd``, its state directory):
its ``~/.pgpass`` is ``root/.pgpass``. ``here(argv)`` runs any other program the same way.

Ownership: the daemon's folder (``root``) belongs to that user, and what this process
writes for the daemon must too. ``cli`` and ``submit`` run inside ``as_user()``, which
sets this thread's filesystem ids to the user's (``setfsuid``): the files they make are
the user's. A test that writes into the spool or a workspace itself does so inside
``daemon.as_user()``; a tree its child processes made (which ``setfsuid`` does not reach:
an exec takes the effective ids again), such as a repository, it hands over with
``daemon.give(path)``. Everything the daemon is to see lives under ``root``: the unit's
``PrivateTmp=`` covers the rest of /tmp, ``ProtectHome=`` every home, and only ``root``
is bound back (the unit's ``StateDirectory=``), with agentd's own folders where they lie
below /tmp (the unit's ``BindReadOnlyPaths=``: a clone there).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from supervisor.unit import Installation, agentd_command, agentd_folders, render
from tests import unitjail
from tests.daemon import Daemon

#: The unit's user: an unprivileged one the machine has.
USER = "nobody"


def unit_text(*, allow_jit: bool = False) -> str:
    """What ``agentd unit`` prints for this installation."""
    install = Installation(
        agentd_command(), Path("/etc/agentd/agentd.toml"), None, folders=agentd_folders()
    )
    return render(install, user=False, allow_jit=allow_jit)


class UnitDaemon(Daemon):
    """A daemon run as systemd would run the unit ``unit`` (default: ``agentd unit``)."""

    def __init__(self, root: Path, config: str, *, unit: str | None = None) -> None:
        self.user = pwd.getpwnam(USER)
        super().__init__(root, config)
        self.unit_path = root / "agentd.service"
        self.unit_path.write_text(unit if unit is not None else unit_text())
        for path in (root, self.config_path, self.unit_path):
            os.chown(path, self.user.pw_uid, self.user.pw_gid)
        root.chmod(0o700)  # (the unit's StateDirectoryMode=)

    def here(self, argv: list[str]) -> list[str]:
        return unitjail.command(self.unit_path, USER, self.root, argv, home=self.root)

    def give(self, path: Path) -> Path:
        for folder, dirs, files in os.walk(path):
            for name in (folder, *(os.path.join(folder, n) for n in dirs + files)):
                os.chown(name, self.user.pw_uid, self.user.pw_gid, follow_symlinks=False)
        return path

    @contextlib.contextmanager
    def as_user(self) -> Iterator[None]:
        with fs_identity(self.user.pw_uid, self.user.pw_gid):
            yield

    def cli(self, *args: str) -> tuple[int, str, str]:
        with self.as_user():
            return super().cli(*args)

    def submit(self, responses: list[dict[str, Any]], name: str, **kwargs: Any) -> str:
        with self.as_user():
            return super().submit(responses, name, **kwargs)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_CAPABILITY_VERSION_3 = 0x20080522


@contextlib.contextmanager
def fs_identity(uid: int, gid: int) -> Iterator[None]:
    """This thread's filesystem user and group are ``uid``/``gid`` inside the block: as
    root, what it makes is theirs. (A nonzero fsuid makes the kernel drop the thread's
    file capabilities; they are raised again at once, so that it still reaches the
    test's own folders, such as pytest's, which are root's and 0700.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    old_gid, old_uid = libc.setfsgid(gid), libc.setfsuid(uid)
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) == 0:
        for half in data:
            half.effective = half.permitted
        libc.capset(ctypes.byref(header), data)
    try:
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


def why_not() -> str | None:
    """Why this machine cannot run a daemon under the emulated unit, or None."""
    if (why := unitjail.why_not()) is not None:
        return why
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no user {USER!r} to run the unit as"
    return None


def factory(*, unit: str | None = None) -> Callable[[Path, str], Daemon]:
    """``Host.daemon`` for the emulated unit (``unit``: another unit's text)."""
    return partial(UnitDaemon, unit=unit)
