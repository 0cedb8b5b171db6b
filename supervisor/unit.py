"""``agentd unit [--user]``: a systemd unit for this installation (docs/design.md section 2).

One template makes both units, so the system unit and the user unit cannot drift apart
in what they share (``Type=notify``, the watchdog, the restart policy, exit 78, the stop
grace, the seccomp filters):

- the *system* unit (``/etc/systemd/system/agentd.service``) runs as user ``agentd``
  with the spool in ``StateDirectory=agentd`` (``/var/lib/agentd``) and the hardening of
  ``systemd/agentd.service`` (``systemd-analyze security`` exposure 2.5 at most), less
  only what bubblewrap needs to sandbox run_command inside it;
- the *user* unit (``~/.config/systemd/user/agentd.service``) runs under the user's own
  manager. It keeps the seccomp-based settings, which need no privilege, and drops what
  a user manager cannot do or what would hide the user's own files: ``User=``,
  ``ProtectHome=``, the mount-namespace ``Protect*``/``Private*`` settings. A user
  manager's ``StateDirectory=`` is below ``$XDG_CONFIG_HOME`` on systemd before 253, so
  the user unit names its spool instead.

The paths are this installation's: the ``agentd`` script next to ``sys.executable``
(the venv or pipx environment agentd runs from), the config and the spool the caller
resolved. Everything written into the unit is escaped for systemd (``%`` and ``$``,
quotes around a path with spaces); paths under the user's home become ``%h/...``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from worker.config import RestartConfig

#: Where the system unit finds the API key: systemd reads it as root and hands it to the
#: service as the credential ``anthropic_api_key`` ($CREDENTIALS_DIRECTORY).
SYSTEM_CREDENTIAL = "/etc/agentd/anthropic_api_key"
USER_CREDENTIAL = "%E/agentd/anthropic_api_key"  # %E: the user's $XDG_CONFIG_HOME
CREDENTIAL_NAME = "anthropic_api_key"

#: Folders that ProtectHome=yes hides from the system unit.
_HOME_FOLDERS = ("/home", "/root", "/run/user")


#: Folders that PrivateTmp= gives the system unit a fresh copy of.
_TMP_FOLDERS = ("/tmp", "/var/tmp")  # noqa: S108  (names, not files made)


@dataclass(frozen=True)
class Installation:
    """What a unit needs to know about where agentd lives on this machine."""

    command: tuple[str, ...]  # argv that runs agentd: its script, or python -m supervisor
    config: Path | None  # the config file the daemon reads (None: discovery/defaults)
    spool: Path | None  # None: the system unit's StateDirectory
    home: Path | None = None  # the user's home, written as %h in a user unit
    folders: tuple[Path, ...] = ()  # what agentd runs from (``agentd_folders``)


def agentd_folders() -> tuple[Path, ...]:
    """The folders this agentd runs from: its environment (``sys.prefix``), the Python
    it is made from, and its source where that is elsewhere (an editable install), each
    resolved, none inside another."""
    import supervisor  # noqa: PLC0415  (this very package: where its source lives)

    found = {
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
        Path(supervisor.__file__).resolve().parent.parent,
    }
    return tuple(sorted(p for p in found if not any(p != q and p.is_relative_to(q) for q in found)))


def _tmp_folder(path: Path) -> str:
    return next(folder for folder in _TMP_FOLDERS if path.is_relative_to(folder))


def _under(path: Path, folders: tuple[str, ...]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def tmp_folders(install: Installation) -> list[Path]:
    """What agentd runs from under /tmp or /var/tmp, which the system unit's
    ``PrivateTmp=`` would hide from the service: bound back read-only
    (``BindReadOnlyPaths=``), as a clone tried under ``mktemp -d`` needs."""
    return [path for path in install.folders if _under(path, _TMP_FOLDERS)]


def agentd_command(executable: str = sys.executable) -> tuple[str, ...]:
    """The ``agentd`` script of the environment this Python runs from.

    Not resolved through symlinks: a venv's ``bin/python`` is a symlink to the base
    interpreter, whose folder has no ``agentd``.
    """
    script = Path(executable).with_name("agentd")
    if script.is_file():
        return (str(script),)
    return (executable, "-m", "supervisor")


def home_warnings(install: Installation) -> list[str]:
    """What the system unit names below a home folder, which ``ProtectHome=yes`` hides
    from the service, or below /tmp, which ``PrivateTmp=`` does (agentd's own folders
    there are bound back, ``tmp_folders``; a spool or a config is not): it would fail at
    start, so the CLI says so before it is installed."""
    named = {"agentd": Path(install.command[0]), "config": install.config}
    named["spool"] = install.spool
    homes = [
        f"{what} {path} is below a home folder, which ProtectHome=yes hides from the "
        "service; install agentd outside /home (e.g. in /opt/agentd/venv) or use --user."
        for what, path in named.items()
        if path is not None and _under(path, _HOME_FOLDERS)
    ]
    return homes + [
        f"{what} {path} is below {_tmp_folder(path)}, "
        "of which PrivateTmp=yes gives the service a fresh, empty copy: it would not see "
        f"it; put the {what} outside /tmp and /var/tmp (e.g. in /etc/agentd, /var/lib/agentd)."
        for what, path in named.items()
        if what != "agentd" and path is not None and _under(path, _TMP_FOLDERS)
    ]


# -- the template ------------------------------------------------------------------------

_SYSTEM_HEADER = """\
# agentd: supervisor for long-running LLM agent workers (system unit).
# Written by `agentd unit`. Install:
#
#   useradd --system --home-dir /var/lib/agentd --shell /usr/sbin/nologin agentd
#   agentd init --system                           # /etc/agentd/agentd.toml, no secrets in it
#   install -m 0600 /dev/null {credential}   # then write the API key into it
#   agentd unit | sudo tee /etc/systemd/system/agentd.service
#   systemctl enable --now agentd
#
# The spool is {spool}. Run the operator CLI as the same user, so that what it writes
# stays readable by the daemon:
#   sudo -u agentd {command} --spool {spool} status
#
# Workers and every tool they run (run_command's shell too) inherit this sandbox: they
# can write only under the spool (a task's default workspace is there), see no /home,
# and reach the network only over IPv4/IPv6. If tasks need a workspace elsewhere, add it
# to ReadWritePaths= (`systemctl edit agentd`); ProtectHome=yes hides /home, so a
# workspace there also needs ProtectHome=read-only or tmpfs plus BindPaths=.
#
# run_command runs in bubblewrap inside this sandbox: the unit allows the namespaces,
# system calls, netlink socket and /proc that bwrap needs, and no more (each line below
# says why), and the config says sandbox = "required", so that a tool never runs bare.
# {jit}
"""

_USER_HEADER = """\
# agentd: supervisor for long-running LLM agent workers (user unit).
# Written by `agentd unit --user`. Install:
#
#   agentd unit --user > ~/.config/systemd/user/agentd.service
#   install -m 0600 /dev/null {credential}   # then write the API key into it
#   systemctl --user daemon-reload && systemctl --user enable --now agentd
#   loginctl enable-linger "$USER"    # keep it running while you are logged out
#
# The spool is {spool}; the config {config}.
# {jit}
"""

#: The header's word on MemoryDenyWriteExecute=, by ``allow_jit``.
_JIT = {
    False: "Tools that run a JIT (node, java) need `agentd unit --allow-jit` "
    "(MemoryDenyWriteExecute=no).",
    True: "Written with --allow-jit: MemoryDenyWriteExecute=no, so that tools may run a JIT "
    "(node, java).",
}

# Settings both units share. {placeholders} are filled by _render.
_SERVICE = """\
[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
ExecReload=/bin/kill -HUP $MAINPID
{environment}\
# The API key, read by systemd and handed over as $CREDENTIALS_DIRECTORY/{name}.
LoadCredential={name}:{credential}
{environment_file}
# Liveness: the supervisor sends WATCHDOG=1 from its main loop every WatchdogSec/2.
WatchdogSec=30
# A crash restarts the supervisor; exit 78 (configuration error) waits for a fix.
Restart=on-failure
RestartSec=2
RestartPreventExitStatus=78
# On SIGTERM the supervisor stops its workers at a safe point, as `agentd stop` does
# (SIGTERM, restart.stop_grace = {stop_grace:g} s by default, then SIGKILL). KillMode=mixed sends
# SIGTERM to the supervisor only; whatever is left once it has exited (or once
# TimeoutStopSec runs out) gets SIGKILL. Keep TimeoutStopSec well above stop_grace.
KillMode=mixed
TimeoutStopSec=45

{identity}\
UMask=0077
# The daemon's cgroup is its own to divide: each task's tools get a cgroup of their own
# with [tools] max_processes and max_memory, so that a fork bomb starves no other task.
Delegate=pids memory

# Hardening. `systemd-analyze security` rates this unit; the test suite keeps the system
# unit's exposure at 2.5 or lower.
NoNewPrivileges=yes
{namespaces}\
# AF_NETLINK: bwrap brings up loopback in a network namespace of its own (network = false).
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
# The namespaces bwrap creates for run_command; net always, as a reload may turn the
# network off. Not uts or cgroup, which it never asks for.
RestrictNamespaces=user mnt pid ipc net
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute={mdwe}
{ipc}\
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
# Nothing of agentd changes priorities, affinity or NUMA policy; a tool's `nice` still
# runs its command (it only warns), and the unit's exposure stays within the test's 2.5.
SystemCallFilter=~@resources
# Allowed again after ~@privileged: the calls bwrap makes to set up its namespaces (its
# mounts, the new root, the user namespace's ids, dropping its capabilities).
SystemCallFilter=mount umount2 pivot_root setgroups setresuid capset
SystemCallErrorNumber=EPERM
"""

_UNIT = """\
[Unit]
Description=agentd, supervisor for long-running LLM agent workers
"""

_TMP_BINDS = """\
# agentd runs from below /tmp or /var/tmp, of which PrivateTmp= gives the service a fresh
# copy: bound back read-only. systemd-tmpfiles may clean those folders at boot, so an
# installation for good belongs elsewhere (e.g. /opt/agentd/venv).
"""

_SYSTEM_ENVIRONMENT_FILE = """\
# Other variables (ANTHROPIC_BASE_URL, ...). Read by systemd as root, so 0600.
EnvironmentFile=-/etc/agentd/env
"""

_SYSTEM_IDENTITY = """\
User=agentd
Group=agentd
StateDirectory=agentd
StateDirectoryMode=0700
"""

# What only a system manager can set up: capabilities, mount namespaces, device and
# kernel protections. A user manager lacks the privilege (or hides the user's own home).
_SYSTEM_NAMESPACES = """\
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
PrivateUsers=yes
PrivateIPC=yes
DevicePolicy=closed
# no: the read-only mounts these leave under /proc are locked, and bwrap cannot mount
# run_command's own /proc beneath them ("Can't mount proc"). The files stay read-only to
# an unprivileged user, and CapabilityBoundingSet= leaves no capability to change them.
ProtectKernelTunables=no
ProtectKernelModules=yes
ProtectKernelLogs=no
# no: the daemon gives each task's tools a cgroup of their own below the one delegated
# to it (Delegate= above), which needs the cgroup tree writable there.
ProtectControlGroups=no
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
# Not ProcSubset=pid: psutil reads /proc/stat (boot time) to date the worker processes
# it checks, and tools such as ps or free need the rest of /proc as well.
"""

_SYSTEM_IPC = """\
RemoveIPC=yes
KeyringMode=private
PrivateMounts=yes
"""


def render(install: Installation, *, user: bool, allow_jit: bool = False) -> str:
    """The system unit, or with ``user`` the user unit, for ``install``; ``allow_jit``
    writes ``MemoryDenyWriteExecute=no`` for tools that run a JIT (node, java)."""
    home = install.home if user else None
    spool = _path(install.spool, home) if install.spool is not None else "/var/lib/agentd"
    config = _path(install.config, home) if install.config is not None else None
    argv = [_path(Path(install.command[0]), home), *install.command[1:]]
    argv += ["start", "--log-format", "json"]
    if install.spool is not None:
        argv += ["--spool", spool]
    fill = {
        "exec_start": " ".join(_exec_arg(a) for a in argv),
        "environment": _assignment("AGENTD_CONFIG", config) if config else "",
        "name": CREDENTIAL_NAME,
        "stop_grace": RestartConfig().stop_grace,
        "mdwe": "no" if allow_jit else "yes",
    }
    if user:
        if install.spool is None:
            raise ValueError("a user unit needs the spool it serves")
        fill |= {
            "credential": USER_CREDENTIAL,
            "environment_file": "",
            "identity": "",
            "namespaces": "",
            "ipc": "",
        }
        header = _USER_HEADER.format(
            credential=USER_CREDENTIAL.replace("%E", "~/.config"),
            spool=spool.replace("%h", "~"),
            config=config.replace("%h", "~")
            if config
            else "none yet (built-in defaults) until `agentd init` writes one",
            jit=_JIT[allow_jit],
        )
        head, tail = _UNIT, "[Install]\nWantedBy=default.target\n"
    else:
        identity = _SYSTEM_IDENTITY
        if install.spool is not None:  # a spool outside the StateDirectory must be writable
            identity += f"ReadWritePaths={_exec_arg(spool)}\n"
        if binds := tmp_folders(install):
            identity += _TMP_BINDS + "".join(
                f"BindReadOnlyPaths={_exec_arg(_path(path, None))}\n" for path in binds
            )
        fill |= {
            "credential": SYSTEM_CREDENTIAL,
            "environment_file": _SYSTEM_ENVIRONMENT_FILE,
            "identity": identity,
            "namespaces": _SYSTEM_NAMESPACES,
            "ipc": _SYSTEM_IPC,
        }
        header = _SYSTEM_HEADER.format(
            credential=SYSTEM_CREDENTIAL,
            spool=spool,
            command=install.command[0],
            jit=_JIT[allow_jit],
        )
        head = _UNIT + "Wants=network-online.target\nAfter=network-online.target\n"
        tail = "[Install]\nWantedBy=multi-user.target\n"
    return "\n".join([header, head, _SERVICE.format(**fill), tail])


def _path(path: Path, home: Path | None) -> str:
    """``path`` with systemd's specifiers escaped; below ``home`` it is ``%h/...``."""
    if home is not None and path.is_relative_to(home) and path != home:
        return "%h/" + str(path.relative_to(home)).replace("%", "%%")
    return str(path).replace("%", "%%")


def _exec_arg(value: str) -> str:
    """One ExecStart= argument: ``$`` escaped, quoted when it holds a blank or a quote."""
    value = value.replace("$", "$$")
    if any(c in value for c in " \t\"'\\"):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _assignment(name: str, value: str) -> str:
    """An ``Environment=`` line (no ``$`` expansion there, so only quoting)."""
    text = f"{name}={value}"
    if any(c in text for c in " \t\"'\\"):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"Environment={text}\n"
